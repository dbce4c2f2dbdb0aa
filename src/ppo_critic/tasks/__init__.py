"""Built-in rollout tasks whose true value function is known exactly (to train and judge a critic).

| name     | stresses                                                | value                          |
|----------|---------------------------------------------------------|--------------------------------|
| counting | a sparse terminal reward that depends on a count        | binomial tail                  |
| dense    | a reward on many tokens; gamma shapes the whole value   | geometric sums of a chain      |
| long     | 256-288 token responses, one reward at the very end     | binomial tail                  |
| recall   | a key 34+ tokens before the response decides the value  | binomial tail                  |
| lengths  | response lengths 8..96 set by a random EOS              | backward induction (float64)   |
| scale    | rewards in [-30, 50] around 10: value normalisation     | linear in the running mean     |

Each module's docstring gives its generative process and closed form; every task offers the members of
`ppo_critic.tasks.common.Task`. Every task takes a policy schedule, `task.drift` (one option of its process moves
over the iterations: `ppo_critic.config.tasks.DriftOptions`); `task.at(step)` is the fixed task of iteration `step`.
`TASK_CONFIGS` (name -> options dataclass, all in `ppo_critic.config.tasks`) is torch-free, so configs load and
`--help` runs without torch; the task classes (`TASKS`: name -> (task class, options dataclass), and each class by
its name) are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from ppo_critic.config.tasks import (
    TASK_CONFIGS,
    CountingTaskConfig,
    DenseTaskConfig,
    LengthsTaskConfig,
    LongTaskConfig,
    RecallTaskConfig,
    ScaleTaskConfig,
)

_CLASSES = {  # name -> the task class in module ppo_critic.tasks.<name>
    "counting": "CountingTask",
    "dense": "DenseTask",
    "long": "LongTask",
    "recall": "RecallTask",
    "lengths": "LengthsTask",
    "scale": "ScaleTask",
}

__all__ = [
    "TASKS",
    "TASK_CONFIGS",
    *_CLASSES.values(),
    "CountingTaskConfig",
    "DenseTaskConfig",
    "LengthsTaskConfig",
    "LongTaskConfig",
    "RecallTaskConfig",
    "ScaleTaskConfig",
]


def __getattr__(name: str) -> Any:
    """`TASKS` and the task classes, imported (with torch) when first asked for (PEP 562)."""
    if name != "TASKS" and name not in _CLASSES.values():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    classes = {key: getattr(importlib.import_module(f"{__name__}.{key}"), cls) for key, cls in _CLASSES.items()}
    globals().update(TASKS={key: (classes[key], TASK_CONFIGS[key]) for key in TASK_CONFIGS})
    globals().update({cls.__name__: cls for cls in classes.values()})
    return globals()[name]
