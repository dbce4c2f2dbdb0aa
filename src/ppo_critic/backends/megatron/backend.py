"""The megatron-core backend of a `CriticWorker`: the HF value model (same seed on every rank) converted to this
rank's TP × PP slice, wrapped in megatron DDP with the (distributed) optimizer, run by `MegatronPPOCritic`, and
checkpointed per rank. A checkpoint resumes with the same layout; across layouts, go through an HF export and
`critic.model.path`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ppo_critic.backends.build import export_skeleton, model_from_config
from ppo_critic.backends.megatron import parallel as mp
from ppo_critic.backends.megatron.critic import MegatronPPOCritic
from ppo_critic.backends.megatron.model import Shapes, build_megatron_value_model, check_supported, transformer_config
from ppo_critic.config.critic import CriticConfig, ModelConfig
from ppo_critic.models.hf import unwrap
from ppo_critic.parallel.layout import ParallelLayout
from ppo_critic.parallel.mesh import compute_dtype, select_device
from ppo_critic.parallel.offload import Offloader
from ppo_critic.run.checkpoint import export_hf, load_state_dicts, save_state_dicts


class MegatronBackend:
    """Model chunks, megatron optimizer, critic and per-rank checkpoint layout for `strategy: megatron`."""

    def __init__(
        self, config: CriticConfig, device: str, seed: int, dist_timeout_s: float, layout: ParallelLayout | None
    ):
        self.config, mcfg = config, config.megatron
        torch.manual_seed(seed)
        hf_model = model_from_config(config.model, 1, config)  # same seed: same weights on every rank
        tp_pp = (mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size)
        check_supported(hf_model.config, *tp_pp, mcfg.virtual_pipeline_model_parallel_size)
        mp.initialize(mcfg, dist_timeout_s)
        self.device = select_device(device)  # after: torchrun's LOCAL_RANK is the current device by then
        if layout is not None:
            raise ValueError("strategy=megatron builds its process groups from the megatron layout; pass none")
        self.layout = mp.layout()  # megatron's groups, wrapped
        sizes = self.layout.rank_sizes(config)
        self.hf_config, self.shapes = hf_model.config, Shapes.of(hf_model.config)
        dtype = compute_dtype(config.torch_dtype_name, self.device)
        on_cpu = self.device.type == "cpu"
        chunks = build_megatron_value_model(
            self.hf_config, transformer_config(self.hf_config, mcfg, dtype, use_cpu_initialization=on_cpu)
        )
        mp.load_hf_weights(chunks, hf_model.state_dict(), self.shapes)
        del hf_model
        with _megatron_needs_cuda(self.device):
            self.model = mp.wrap_ddp(chunks, mcfg.use_distributed_optimizer)
            self.optimizer = mp.build_optimizer(
                self.model, config.optim, config.grad_clip, mcfg.use_distributed_optimizer
            )
        self.scheduled = self.optimizer.optimizer  # the torch optimizer whose rates the LR schedule sets
        self.critic = MegatronPPOCritic.of(config, sizes, self.model, self.optimizer, self.layout)
        self.offload = Offloader(nn.Module(), None, self.device)  # moves nothing: offload keys are refused here

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The critic's weights under HF value-model names (CPU, on every rank)."""
        return mp.gather_hf_weights(self.model, self.shapes)

    def save(self, root: str | Path, step: int, tensors: dict[str, Tensor], state: dict, keep: int | None) -> Path:
        """Each rank's model chunks, optimizer shard and moving average, `tensors`, and the layout in the state."""
        state = {**state, "megatron_layout": self._layout()}
        return save_state_dicts(root, step, {**self._rank_state(), "extra": tensors}, state, keep)

    def load(
        self, path: str | Path, templates: dict[str, Tensor], check: Callable[[dict[str, Any]], None]
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Fill model, optimizer state and main params in place once the files verify, the layout is this job's
        and `check` passes; `templates` filled and returned with the JSON state."""

        def same_layout(state: dict[str, Any]) -> None:
            saved = state.get("megatron_layout")
            if saved != self._layout():
                raise ValueError(
                    f"checkpoint {path} was written with the megatron layout {saved}, this job runs "
                    f"{self._layout()}; resume with the same layout, or export it to HF and start from that with "
                    "critic.model.path"
                )
            check(state)

        state_dict = {**self._rank_state(), "extra": dict(templates)}
        state = load_state_dicts(path, state_dict, same_layout)
        return state_dict["extra"], state

    def export_hf(self, out_dir: str | Path, replace: bool | Callable[[Path], object]) -> Path:
        """The gathered HF weights; under `value_norm` the statistics are folded into the head (raw values)."""
        state = self.hf_state_dict()
        skeleton = export_skeleton(ModelConfig(), self.hf_config)
        norm = self.critic.value_norm
        if norm.enabled:
            head = torch.nn.Linear(state["score.weight"].shape[1], 1, dtype=state["score.weight"].dtype)
            head.load_state_dict({"weight": state["score.weight"], "bias": state["score.bias"]})
            norm.fold_into(head)
            state |= {"score.weight": head.weight.detach(), "score.bias": head.bias.detach()}
        return export_hf(skeleton, out_dir, state_dict=state, replace=replace)

    def _layout(self) -> dict[str, int]:
        from megatron.core import parallel_state as ps

        return {
            "world": torch.distributed.get_world_size(),
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "vpp": len(self.model),
        }

    def _rank_state(self) -> dict[str, Any]:
        """This rank's tensors under rank-unique names: model chunks, the inner optimizer's state and the
        parameters it steps (fp32 main copies, or shards of them with the distributed optimizer)."""
        inner = self.optimizer.optimizer
        if not inner.state:  # a fresh optimizer: create its state with a step that changes nothing
            _zero_step(inner)
        params = [p for group in inner.param_groups for p in group["params"]]
        model = {
            f"chunk{i}.{k}": v
            for i, chunk in enumerate(self.model)
            for k, v in unwrap(chunk).state_dict().items()
            if isinstance(v, Tensor)
        }
        optim = {
            "main": {str(i): p.data for i, p in enumerate(params)},
            "state": {str(i): inner.state[p] for i, p in enumerate(params) if p in inner.state},
        }
        rank = f"rank{torch.distributed.get_rank()}"
        ema = {"ema": {rank: self.critic.ema.state_dict()}} if self.critic.ema is not None else {}
        return {"model": {rank: model}, "optim": {rank: optim}, **ema}


def _zero_step(optimizer: torch.optim.Optimizer) -> None:
    """One step with zero gradients and learning rate 0: the optimizer's state exists, the parameters are untouched."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        group["lr"] = lr
        for p in group["params"]:
            p.grad = None


@contextlib.contextmanager
def _megatron_needs_cuda(device: torch.device) -> Iterator[None]:
    """megatron-core puts its gradient buffers and optimizer state on CUDA whatever the device; on a machine without
    CUDA say so, instead of torch's bare "Torch not compiled with CUDA enabled" (a CPU build) or "Found no NVIDIA
    driver" (a CUDA build) from deep inside it."""
    try:
        yield
    except (AssertionError, RuntimeError) as err:
        if device.type == "cuda" or torch.cuda.is_available():
            raise
        raise ValueError(
            "critic.strategy=megatron needs CUDA GPUs (megatron-core allocates its gradient buffers on CUDA); on "
            f"this machine use critic.strategy=fsdp2, ddp or none ({err})"
        ) from err
