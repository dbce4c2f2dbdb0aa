"""What every critic backend shares: input checks, loss denominators, metric accumulation and naming."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

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

    def result(
        self, batch: Batch, lr: float, elapsed_s: float, epochs: int, reduce: Callable[[Tensor, str], Tensor]
    ) -> dict[str, float]:
        """The metrics of DESIGN §3, identical on every rank: sums and extrema go through `reduce` (over DP)."""
        norms = torch.stack(self.grad_norms)  # global norms: the same on every rank
        finite = torch.isfinite(norms)
        mask = batch.response_mask.bool()
        values, returns = batch["values"].double(), batch["returns"].double()
        err = returns - values
        big = torch.tensor(torch.finfo(torch.float64).max, dtype=torch.float64, device=values.device)
        sums = reduce(
            torch.stack(
                [
                    torch.stack(self.step_losses).sum(),
                    self.tokens,
                    self.clipped,
                    self.vpred_sum,
                    *(torch.where(mask, x, 0.0).sum() for x in (values, returns, returns**2, err, err**2)),
                    mask.sum().double(),
                    batch["attention_mask"].sum().double() * epochs,
                ]
            ),
            "sum",
        )
        extrema = reduce(
            torch.stack([torch.where(mask, values, big).min(), -torch.where(mask, values, -big).max()]), "min"
        )
        step_loss, tokens, clipped, vpred, v_sum, r_sum, r_sq, e_sum, e_sq, count, seen = sums.tolist()
        n, t = max(count, 1.0), max(tokens, 1.0)
        var_returns = r_sq / n - (r_sum / n) ** 2
        var_err = e_sq / n - (e_sum / n) ** 2
        defined = var_returns > 1e-12 * (r_sq / n)
        empty = count == 0
        metrics = {
            "critic/vf_loss": step_loss / len(self.step_losses),
            "critic/vf_clipfrac": clipped / t,
            "critic/vpred_mean": vpred / t,
            "critic/grad_norm": float(torch.where(finite, norms, 0.0).sum() / finite.sum().clamp(min=1)),
            "critic/skipped_steps": float((~finite).sum()),
            "critic/vf_explained_var": 1 - var_err / var_returns if defined else 0.0,
            "critic/values_mean": v_sum / n,
            "critic/values_min": 0.0 if empty else extrema[0].item(),
            "critic/values_max": 0.0 if empty else -extrema[1].item(),
            "critic/lr": float(lr),
        }
        slowest = float(reduce(torch.tensor(elapsed_s, device=values.device), "max"))
        metrics["perf/tokens_per_s"] = seen / max(slowest, 1e-9)
        return metrics
