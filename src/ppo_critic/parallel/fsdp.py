"""The former home of `parallelize` and `shard`, now `ppo_critic.backends.data_parallel.fsdp`; trainers that
import them from here keep working (PEP 562, resolved on first use)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """`name` from the data-parallel backend's `fsdp` module."""
    from ppo_critic.backends.data_parallel import fsdp

    return getattr(fsdp, name)
