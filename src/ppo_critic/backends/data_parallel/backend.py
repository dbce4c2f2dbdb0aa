"""The data-parallel backend of a `CriticWorker` (strategies none, ddp, fsdp, fsdp2; Ulysses inside): one full
model per replica, parallelised by `fsdp.parallelize`, checkpointed with DCP as one state dict."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ppo_critic.backends.build import (
    build_optimizer,
    export_skeleton,
    low_precision,
    model_from_config,
    param_groups,
)
from ppo_critic.backends.data_parallel.critic import DataParallelPPOCritic
from ppo_critic.backends.data_parallel.fsdp import parallelize
from ppo_critic.config.critic import CriticConfig
from ppo_critic.critics.objectives import objective_of
from ppo_critic.models.hf import find_value_head
from ppo_critic.models.lora import merged_model
from ppo_critic.parallel.layout import ParallelLayout, layout_of
from ppo_critic.parallel.master_weights import float32_weights
from ppo_critic.parallel.mesh import init_distributed, select_device
from ppo_critic.parallel.offload import Offloader
from ppo_critic.run.checkpoint import export_hf, load_checkpoint, save_checkpoint


class DataParallelBackend:
    """Model, optimizer, critic and checkpoint layout for the data-parallel strategies."""

    def __init__(
        self, config: CriticConfig, device: str, seed: int, dist_timeout_s: float, layout: ParallelLayout | None
    ):
        self.config = config
        init_distributed(dist_timeout_s)  # under torchrun: a rank stuck longer than this in a collective fails
        self.device = select_device(device)  # after: torchrun's LOCAL_RANK is the current device by then
        self.layout = layout or layout_of(config)
        sizes = self.layout.rank_sizes(config)
        torch.manual_seed(seed)
        outputs = objective_of(config).outputs  # the value head's outputs per token
        model = model_from_config(config.model, outputs, config).to(
            self.device
        )  # same seed: same weights on every rank
        self.hf_config = model.config
        masters = low_precision(model, config)  # critic.param_dtype: before DDP, whose buckets take the dtype
        self.model = parallelize(model, config, self.device, self.layout)
        self.optimizer = build_optimizer(param_groups(self.model, config.optim), config.optim, masters)
        self.scheduled = self.optimizer  # the torch optimizer whose rates the LR schedule sets
        self.critic = DataParallelPPOCritic.of(config, sizes, self.layout, self.model, self.optimizer)
        average = [] if self.critic.ema is None else [self.critic.ema.average]  # moves with the parameters
        self.offload = Offloader(self.model, self.optimizer, self.device, average)

    def save(self, root: str | Path, step: int, tensors: dict[str, Tensor], state: dict, keep: int | None) -> Path:
        """One DCP checkpoint: the (sharded) model (its float32 master weights under `critic.param_dtype`) and
        optimizer, the moving average and `tensors`."""
        tensors = {**tensors, **self._ema_state()}
        with float32_weights(self.optimizer):
            return save_checkpoint(root, step, self.model, self.optimizer, tensors, state, keep)

    def load(
        self, path: str | Path, templates: dict[str, Tensor], check: Callable[[dict[str, Any]], None]
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Model, optimizer and moving average from `path` once it verifies and `check` passes; the rest of
        `templates` (shape/dtype) filled and returned with the JSON state."""
        ema = self._ema_state()
        with float32_weights(self.optimizer):  # critic.param_dtype: into the masters, then rounded
            loaded, state = load_checkpoint(path, self.model, self.optimizer, {**templates, **ema}, check)
        with torch.no_grad():
            for key, average in ema.items():  # DCP loads in place; copy in case a tensor came back new
                got = loaded.pop(key)
                if got is not average:
                    average.copy_(got)
        return loaded, state

    def export_hf(self, out_dir: str | Path, replace: bool | Callable[[Path], object]) -> Path:
        """The live weights as an HF checkpoint (the float32 masters under `critic.param_dtype`): a LoRA critic
        merged, `value_norm`'s statistics folded into the head; rank 0 writes, the others join the gather and wait."""
        with float32_weights(self.optimizer):
            return self._export_hf(out_dir, replace)

    def _export_hf(self, out_dir: str | Path, replace: bool | Callable[[Path], object]) -> Path:
        """`export_hf` of the weights the parameters hold now."""
        lora, norm = bool(self.config.model.lora_rank), self.critic.value_norm
        if not lora and not norm.enabled:
            return export_hf(self.model, out_dir, replace=replace)
        options = StateDictOptions(full_state_dict=True, cpu_offload=torch.distributed.is_initialized())
        full = get_model_state_dict(self.model, options=options)  # a collective under DP
        if torch.distributed.is_initialized() and torch.distributed.get_rank() > 0:
            return export_hf(self.model, out_dir, state_dict={}, replace=replace)
        model = self._full_model(full, lora)
        if norm.enabled:
            parent, name = find_value_head(model)
            norm.fold_into(getattr(parent, name))
        return export_hf(model, out_dir, state_dict=model.state_dict(), replace=replace)

    def _full_model(self, full: dict[str, Tensor], lora: bool) -> nn.Module:
        """A plain copy of the model holding `full` (merged when LoRA): merging and folding work in place, and the
        state dict may alias the live parameters."""
        skeleton = export_skeleton(self.config.model, self.hf_config)
        skeleton.load_state_dict({k: v.detach().clone() for k, v in full.items()}, assign=True)
        return merged_model(skeleton) if lora else skeleton

    def _ema_state(self) -> dict[str, Tensor]:
        """The moving average of `critic.ema_decay` (the live tensors, sharded like the parameters; or nothing)."""
        return self.critic.ema.state_dict() if self.critic.ema is not None else {}
