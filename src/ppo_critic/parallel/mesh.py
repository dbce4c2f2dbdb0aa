"""Device selection, torchrun process groups and the (dp, sp) layout of ranks."""

from __future__ import annotations

from dataclasses import dataclass

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
