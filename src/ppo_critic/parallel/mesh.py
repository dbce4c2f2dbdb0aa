"""Device selection, torchrun process groups and the (dp, sp) layout of ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BACKEND_CUDA = "cpu:gloo,cuda:nccl"  # torch.distributed's backend of a CUDA job (as torchtitan's with offload, verl's)


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` → the current CUDA device when there is one, else `cpu`; `cuda` → the current CUDA device; anything
    else is checked and returned as a device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device={name!r} is not a torch device name (use auto, cpu, cuda or cuda:N)") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but CUDA is not available here; use device=auto or cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """The compute dtype when none is configured: bf16 on CUDA (as verl), float32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def compute_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The autocast dtype: the configured one (`critic.dtype`, a torch dtype name), else `default_dtype`."""
    return default_dtype(device) if name is None else getattr(torch, name)


def select_device(name: str = "auto") -> torch.device:
    """`resolve_device`, made the current CUDA device: CUDA events, synchronisation, memory statistics, the
    peak-FLOPs probe and NCCL then all use it. Call it after `init_distributed`, which makes LOCAL_RANK's current."""
    device = resolve_device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def init_distributed(timeout_s: float = 600.0) -> bool:
    """Join torchrun's process group when launched by it; False when single-process. On CUDA the group has NCCL for
    CUDA tensors and gloo for CPU ones (FSDP2's CPU offload reduces CPU gradients); on CPU gloo alone."""
    import datetime
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(BACKEND_CUDA if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return True


@dataclass(frozen=True)
class Groups:
    """Who works with whom: data parallelism over `dp` (different data), Ulysses over `sp` (same data, split
    sequences). Ranks are laid out (dp, sp), so the ranks of one sp group are consecutive."""

    dp_group: object | None = None
    dp_size: int = 1
    dp_rank: int = 0
    sp_group: object | None = None
    sp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_size * self.sp_size


def parallel_groups(sp_size: int = 1) -> Groups:
    """The (dp, sp) groups of the default process group; a single process gets `Groups()`."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if sp_size != 1:
            raise ValueError(
                f"ulysses_sequence_parallel_size={sp_size} needs {sp_size} processes per sequence; launch with torchrun"
            )
        return Groups()
    world = dist.get_world_size()
    if world % sp_size:
        raise ValueError(f"world size {world} is not divisible by ulysses_sequence_parallel_size={sp_size}")
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
    return Groups(
        dp_group=mesh["dp"].get_group(),
        dp_size=world // sp_size,
        dp_rank=mesh["dp"].get_local_rank(),
        sp_group=mesh["sp"].get_group(),
        sp_size=sp_size,
    )
