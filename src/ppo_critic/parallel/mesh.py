"""Device selection: CUDA when present, else CPU; an explicit name wins."""

from __future__ import annotations

import torch


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` → `cuda` when available, else `cpu`; anything else is checked and returned as a device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device={name!r} is not a torch device name (use auto, cpu, cuda or cuda:N)") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but CUDA is not available here; use device=auto or cpu")
    return device


def init_distributed(timeout_s: float = 600.0) -> bool:
    """Join torchrun's process group when launched by it (nccl on CUDA, gloo on CPU); False when single-process."""
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
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return True


def dp_world(sp_size: int = 1) -> tuple[object | None, int]:
    """(process group, size) of data parallelism: the whole world (sp groups come with Ulysses), or (None, 1)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None, 1
    world = dist.get_world_size()
    if world % sp_size:
        raise ValueError(f"world size {world} is not divisible by ulysses_sequence_parallel_size={sp_size}")
    if sp_size != 1:
        raise ValueError("ulysses_sequence_parallel_size > 1 is not available yet; set it to 1")
    return dist.group.WORLD, world
