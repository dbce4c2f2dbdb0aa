"""What every critic backend shares: input checks, loss denominators, metric accumulation and naming."""

from __future__ import annotations

import torch
from torch import Tensor

from ppo_critic.algos import explained_variance, masked_mean
from ppo_critic.batch import MODEL_KEYS, MULTI_MODAL, TARGET_KEYS, Batch
from ppo_critic.config import CriticConfig

UPDATE_KEYS = (*MODEL_KEYS, "response_mask", *TARGET_KEYS, MULTI_MODAL)


def compute_dtype(config: CriticConfig, device: torch.device) -> torch.dtype:
    """The autocast dtype: `config.dtype`, else bf16 on CUDA and fp32 elsewhere."""
    name = config.torch_dtype_name
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def local_loss_denominators(response_mask: Tensor) -> dict[str, Tensor]:
    """Valid tokens and non-empty sequences of a mini-batch (to be summed over DP ranks)."""
    mask = response_mask.bool()
    return {"batch_num_tokens": mask.sum().double(), "global_batch_size": (mask.sum(-1) > 0).sum().double()}


class UpdateMetrics:
    """Accumulates `update_critic` metrics on the device; one host transfer in `result()` (DESIGN §3)."""

    def __init__(self, device: torch.device):
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.tokens, self.clipped, self.vpred_sum = zero.clone(), zero.clone(), zero.clone()
        self.step_losses: list[Tensor] = []
        self.grad_norms: list[Tensor] = []

    def add_micro_batch(self, vpreds: Tensor, clipfrac: Tensor, response_mask: Tensor) -> None:
        n = response_mask.bool().sum().double()
        self.tokens += n
        self.clipped += clipfrac.detach().double() * n
        self.vpred_sum += torch.where(response_mask.bool(), vpreds.detach(), 0.0).sum().double()

    def add_step(self, loss: Tensor, grad_norm: Tensor) -> None:
        self.step_losses.append(loss.detach().double())
        self.grad_norms.append(grad_norm.detach().double())

    def result(self, batch: Batch, lr: float, elapsed_s: float, epochs: int) -> dict[str, float]:
        norms = torch.stack(self.grad_norms)
        finite = torch.isfinite(norms)
        tokens = self.tokens.clamp(min=1)
        values, returns, mask = batch["values"], batch["returns"], batch.response_mask.bool()
        valid = values[mask].double()
        empty = values.new_zeros((), dtype=torch.float64)
        stats = torch.stack(
            [
                torch.stack(self.step_losses).mean(),
                self.clipped / tokens,
                self.vpred_sum / tokens,
                torch.where(finite, norms, 0.0).sum() / finite.sum().clamp(min=1),
                (~finite).sum().double(),
                explained_variance(values, returns, mask).double(),
                masked_mean(values.float(), mask).double(),
                valid.min() if valid.numel() else empty,
                valid.max() if valid.numel() else empty,
                batch["attention_mask"].sum().double() * epochs,
            ]
        ).tolist()
        names = ["vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm", "skipped_steps", "vf_explained_var"]
        names += ["values_mean", "values_min", "values_max"]
        metrics = {f"critic/{name}": value for name, value in zip(names, stats, strict=False)}
        metrics["critic/lr"] = float(lr)
        metrics["perf/tokens_per_s"] = stats[-1] / max(elapsed_s, 1e-9)
        return metrics
