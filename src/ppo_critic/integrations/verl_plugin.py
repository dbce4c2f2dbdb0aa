"""verl's plugin entry point (group `verl.plugins`): registers ppo-critic's value-model engine, backend `ppo_critic`,
with verl ≥ 0.9 as soon as verl's engines load.

verl loads every plugin from inside `import verl`, in the driver and in each Ray worker, and logs a plugin that fails
to load at DEBUG only; this one reports its own failures as errors (log and warning) with the reason and the fix.
`VERL_USE_EXTERNAL_PLUGINS=none` switches verl's plugin loading off.
"""

from __future__ import annotations

import logging
import warnings
from types import ModuleType

from ppo_critic.integrations.hooks import after_import, installed_version

log = logging.getLogger(__name__)
ENGINES = "verl.workers.engine"  # the module whose import also imports verl's engines and their registry
FIRST_ENGINE_RELEASE = (0, 9)  # verl ≥ 0.9 runs its critic as an engine (0.8 normalised the loss per micro-batch)


def _register(_module: ModuleType) -> None:
    """Import the engine module, whose class decorator registers it; a failure is loud, not fatal for verl."""
    try:
        import ppo_critic.integrations.verl_engine  # noqa: F401 - registers PPOCriticEngine with EngineRegistry
    except Exception as err:
        message = (
            f"ppo-critic's verl engine (critic.strategy=ppo_critic) could not be registered: {type(err).__name__}: "
            f"{err}. verl's own engines still work. Check that ppo-critic and a supported verl (0.9.x) are installed "
            "in this environment (pip install 'ppo-critic[verl]')."
        )
        log.error(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def install() -> None:
    """Register the engine once verl's engines load (nothing happens without verl, or with a verl before 0.9, which
    has no engines: its legacy critic is `ppo_critic.integrations.verl`)."""
    version = installed_version("verl")
    if version is None or _release(version) < FIRST_ENGINE_RELEASE:
        return
    after_import(ENGINES, _register)


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


install()
