"""Built-in rollout tasks whose true value function is known in closed form (to train and judge a critic).

`TASK_CONFIGS` (name -> options dataclass) is torch-free, so configs load and `--help` runs without torch; the
task classes (`TASKS`: name -> (task class, options dataclass), `CountingTask`) are imported on first use.
"""

from __future__ import annotations

from typing import Any

from ppo_critic.tasks.counting_config import CountingTaskConfig

TASK_CONFIGS = {"counting": CountingTaskConfig}

__all__ = ["TASKS", "TASK_CONFIGS", "CountingTask", "CountingTaskConfig"]


def __getattr__(name: str) -> Any:
    """`TASKS` and `CountingTask`, imported (with torch) when first asked for (PEP 562)."""
    if name not in ("TASKS", "CountingTask"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ppo_critic.tasks.counting import CountingTask

    globals().update(TASKS={"counting": (CountingTask, CountingTaskConfig)}, CountingTask=CountingTask)
    return globals()[name]
