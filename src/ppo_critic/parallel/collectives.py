"""Every tensor collective ppo-critic issues itself. Each tensor handed to torch.distributed, inputs and outputs
alike, lives on a device the group's backend takes (NCCL: CUDA only; gloo: CPU; both under `cpu:gloo,cuda:nccl`),
and results come back on the caller's device (DESIGN §8). A caller never allocates a collective's buffers itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# the device types each backend takes tensors of (gloo's CUDA support covers a few collectives only: not relied on)
BACKEND_DEVICES = {"nccl": frozenset({"cuda"}), "gloo": frozenset({"cpu"}), "mpi": frozenset({"cpu"})}
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def served_device_types(group: object = None) -> frozenset[str]:
    """The device types the backend of `group` (default: the world) takes, from its name: `nccl`, `gloo`, or a
    per-device list such as `cpu:gloo,cuda:nccl`."""
    served: set[str] = set()
    for part in str(dist.get_backend(group)).split(","):
        device, _, backend = part.rpartition(":")
        served |= {device} if device else BACKEND_DEVICES.get(backend, frozenset({"cpu", "cuda"}))
    return frozenset(served)


def comm_device(device: torch.device, group: object = None) -> torch.device:
    """`device` when the group's backend takes its tensors, else the device it does take (CUDA: the current one)."""
    served = served_device_types(group)
    if device.type in served:
        return device
    if "cuda" in served:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(x: Tensor, op: str = "sum", group: object = None) -> Tensor:
    """`op` (sum, max or min) of `x` over `group`, as a new tensor on x's device (`x` is left as it is)."""
    y = x.to(comm_device(x.device, group), copy=True)
    dist.all_reduce(y, op=OPS[op], group=group)
    return y.to(x.device)


def all_reduce_(x: Tensor, op: str = "sum", group: object = None) -> None:
    """`op` of `x` over `group`, in place (through a copy only when x's device is not the backend's)."""
    device = comm_device(x.device, group)
    if device == x.device:
        dist.all_reduce(x, op=OPS[op], group=group)
        return
    y = x.to(device)
    dist.all_reduce(y, op=OPS[op], group=group)
    x.copy_(y)


def all_gather(x: Tensor, group: object = None) -> list[Tensor]:
    """Every rank's `x` (one shape on all ranks), in rank order, on x's device."""
    y = x.to(comm_device(x.device, group)).contiguous()
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, y, group=group)
    return [p.to(x.device) for p in parts]


def all_gather_rows(local: Tensor, counts: list[int], group: object = None) -> Tensor:
    """The rows of every rank (`counts[r]` on rank r, this rank's being `local`) concatenated in rank order, on
    local's device: padded to one shape for the collective, trimmed after."""
    padded = local.new_zeros((max(counts), *local.shape[1:]))
    padded[: len(local)] = local
    parts = all_gather(padded, group)
    return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])


def all_to_all(inputs: list[Tensor], group: object = None) -> list[Tensor]:
    """`inputs[r]` (one shape for every r) goes to rank r; returns what each rank sent here, on the inputs' device.
    One flat `all_to_all_single`: gloo has no list all-to-all before torch 2.13."""
    device = inputs[0].device
    sent = torch.cat([t.reshape(-1) for t in inputs]).to(comm_device(device, group))
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return [part.view(inputs[0].shape).to(device) for part in received.chunk(len(inputs))]


def broadcast_(x: Tensor, src: int, group: object = None) -> None:
    """`x` of global rank `src` onto every rank of `group`, in place."""
    device = comm_device(x.device, group)
    y = x if device == x.device else x.to(device)
    dist.broadcast(y, src, group=group)
    if y is not x:
        x.copy_(y)
