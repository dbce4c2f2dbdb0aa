"""Every rank of a job must hold the same settings: one started otherwise would train apart in silence or abort
deep in a collective. `check_ranks_agree` compares them once, on every rank, and names each key that differs."""

from __future__ import annotations

from typing import Any


def check_ranks_agree(values: dict[str, Any], what: str, fix: str) -> None:
    """Under torch.distributed (world size > 1), gather every rank's `values` (nested dicts compared by dotted key)
    and raise ValueError on every rank alike when any key differs: `{what} (<key>: rank 0 <v0>, rank 1 <v1>; ...);
    {fix}`. A no-op in one process."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    values = flat_options(values)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, values)
    keys = sorted({k for other in every for k in other.keys() | values.keys() if other.get(k) != every[0].get(k)})
    if keys:
        listed = "; ".join(f"{k}: " + ", ".join(f"rank {r} {o.get(k)!r}" for r, o in enumerate(every)) for k in keys)
        raise ValueError(f"{what} ({listed}); {fix}")


def flat_options(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` (an `override_config` stays one value)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key != "override_config":
            out |= flat_options(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out
