"""verl 0.7's own `DataParallelPPOCritic` as a path of `ppo-critic bench`: the same module, optimizer, batch and
micro-batching as ppo-critic's paths, called the way verl's FSDP `CriticWorker` calls it, so that speed is
compared against verl itself in one process.

What differs from verl on a GPU, and why: verl's critic always runs its forward under bf16 autocast, so for an
fp32 comparison (`dtype=float32`) that autocast is switched off in verl's critic module only (both sides then
compute in the same precision); and verl's remove-padding path takes its unpad/pad functions from flash-attn,
which has no CPU build, so without flash-attn it gets verl's own copy of them (`verl.utils.npu_flash_attn_utils`,
the same functions verl uses on NPUs).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn


class _TorchWithoutAutocast:
    """`torch` as verl's critic module sees it, with `autocast` a no-op (everything else is torch's)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def autocast(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class VerlBenchPath:
    """verl's critic over `module` and `optimizer` (taken as they are): `compute_values` / `update_critic` on
    ppo-critic's plain batch dicts, with the `meta_info` verl's worker sets."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        mini_batch: int,
        micro: int,
        budget: int,
        dynamic: bool,
        packed: bool,
        dtype: torch.dtype,
    ):
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(
                f"dtype={dtype}: verl's critic computes under bf16 autocast (float32 here: autocast off); "
                "choose dtype=bfloat16 or float32 for the verl paths"
            )
        from verl.workers.config import FSDPCriticConfig, HFModelConfig
        from verl.workers.config.critic import FSDPCriticModelCfg

        self.fp32 = dtype == torch.float32
        with tempfile.TemporaryDirectory() as model_dir:  # verl's config reads the HF config from a directory
            hf_config = copy.deepcopy(module.config)
            hf_config.architectures = [type(module).__name__]
            hf_config.save_pretrained(model_dir)
            config = FSDPCriticConfig(
                strategy="fsdp",
                ppo_mini_batch_size=mini_batch,
                ppo_micro_batch_size_per_gpu=micro,
                forward_micro_batch_size_per_gpu=micro,
                use_dynamic_bsz=dynamic,
                ppo_max_token_len_per_gpu=budget,
                forward_max_token_len_per_gpu=budget,
                model=FSDPCriticModelCfg(path=model_dir, use_remove_padding=packed),
                model_config=HFModelConfig(path=model_dir, load_tokenizer=False),
            )
            with contextlib.redirect_stdout(io.StringIO()):  # verl prints its use_remove_padding setting
                self.critic = verls_critic_class()(config, module, optimizer)
        self.meta = {"micro_batch_size": micro, "use_dynamic_bsz": dynamic, "max_token_len": budget}
        self.last_compute_metrics: dict[str, float] = {}

    def compute_values(self, batch: dict[str, Tensor]) -> Tensor:
        with self._on_this_machine():
            return self.critic.compute_values(_data_proto(batch, self.meta))

    def update_critic(self, batch: dict[str, Tensor]) -> dict[str, Any]:
        with self._on_this_machine():
            return self.critic.update_critic(_data_proto(batch, {}))

    @contextlib.contextmanager
    def _on_this_machine(self) -> Iterator[None]:
        """verl's critic with fp32 autocast off (dtype float32) and its unpad functions without flash-attn."""
        from unittest import mock

        with contextlib.ExitStack() as stack:
            if self.fp32:
                stack.enter_context(mock.patch("verl.workers.critic.dp_critic.torch", _TorchWithoutAutocast()))
            if importlib.util.find_spec("flash_attn") is None:
                stack.enter_context(
                    mock.patch("verl.utils.attention_utils._get_attention_functions", _verls_torch_unpad_functions)
                )
            yield


def verls_critic_class() -> type:
    """verl's own `DataParallelPPOCritic`, also where `ppo_critic.integrations.verl` has put ours in its place."""
    from verl.workers.critic import dp_critic

    cls = dp_critic.DataParallelPPOCritic
    if cls.__module__.startswith("ppo_critic"):
        from ppo_critic.integrations.verl import REPLACED

        cls = REPLACED[dp_critic.__name__]
    return cls


def _verls_torch_unpad_functions() -> tuple[Any, Any, Any, Any]:
    from verl.utils import npu_flash_attn_utils as fns

    return fns.index_first_axis, fns.pad_input, fns.rearrange, fns.unpad_input


def _data_proto(batch: dict[str, Tensor], meta: dict[str, Any]) -> Any:
    from verl import DataProto

    return DataProto.from_dict(tensors=dict(batch), meta_info=dict(meta))
