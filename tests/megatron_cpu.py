"""Test-only: run megatron-core on CPU with gloo. Never imported by the library.

megatron-core (0.16 to 0.19) assumes CUDA in a few places: tensors created with `device="cuda"` or
`torch.cuda.current_device()` (pipeline p2p buffers, token counters, gradient buffers),
`torch.cuda.synchronize()`, `torch.cuda.current_stream()` (0.19's gradient reduction), and optimizer checks that
parameters are `torch.cuda.*Tensor`.
`redirect_cuda_to_cpu()` gives those megatron modules a `torch` whose factory functions put such tensors on
the CPU, and makes `Tensor.type()` (no arguments) name CPU float tensors as their CUDA types.
"""

from __future__ import annotations

import importlib
import types

import torch

MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.utils",
)
_FACTORIES = ("empty", "zeros", "ones", "tensor", "full", "arange")


def _cpu(device):
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return "cpu"
    return device


def _factory(fn):
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return fn(*args, **kwargs)

    return call


class _CpuCuda(types.SimpleNamespace):
    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _cpu_torch() -> types.ModuleType:
    proxy = types.ModuleType("torch_on_cpu")
    proxy.__dict__.update(torch.__dict__)
    for name in _FACTORIES:
        setattr(proxy, name, _factory(getattr(torch, name)))
    proxy.cuda = _CpuCuda(
        current_device=lambda: "cpu", synchronize=lambda *a, **k: None, current_stream=torch.cpu.current_stream
    )
    return proxy


_tensor_type = torch.Tensor.type


def _type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu" and self.is_floating_point():
        return _tensor_type(self).replace("torch.", "torch.cuda.", 1)
    return _tensor_type(self, dtype, non_blocking, **kwargs)


def redirect_cuda_to_cpu(modules=MODULES) -> None:
    """Point the CUDA-only tensor creation and type checks of megatron at the CPU (idempotent)."""
    proxy = _cpu_torch()
    for name in modules:
        importlib.import_module(name).torch = proxy
    torch.Tensor.type = _type
