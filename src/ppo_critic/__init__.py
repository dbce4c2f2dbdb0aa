"""ppo-critic: train the value model (critic) of PPO for LLMs; a drop-in for verl's critics.

The public names are imported on first use (PEP 562), so `ppo-critic --help` and config errors never wait for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_PUBLIC = {
    "CriticConfig": "ppo_critic.config.critic",
    "DataParallelPPOCritic": "ppo_critic.backends.data_parallel.critic",
    "MegatronPPOCritic": "ppo_critic.backends.megatron.critic",
    "build_value_model": "ppo_critic.models",
}

__all__ = ["CriticConfig", "DataParallelPPOCritic", "MegatronPPOCritic", "build_value_model"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """A public name, imported from its module when first asked for; anything else is not here (PEP 562)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value
