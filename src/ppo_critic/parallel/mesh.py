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
