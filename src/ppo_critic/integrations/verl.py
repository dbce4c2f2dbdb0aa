"""ppo-critic's critics inside verl 0.7.x's own workers (verl's legacy critic API), with nothing else changed.

The one line a verl user adds, before launching verl's trainer as usual:

    export VERL_USE_EXTERNAL_MODULES=ppo_critic.integrations.verl

verl imports this module in every process that imports verl (the driver and each Ray worker), and from then on
verl's `CriticWorker`s construct ppo-critic's critics: `DataParallelPPOCritic` in `verl.workers.fsdp_workers`
(fsdp / fsdp2) and `MegatronPPOCritic` in `verl.workers.megatron_workers`, with verl's config, data and calls.
For the FSDP worker, `critic.model.external_lib=ppo_critic.integrations.verl` does the same.

ppo-critic's own options, which verl's critic config dataclasses cannot carry, come from the environment:
`PPO_CRITIC_OPTIONS="ema_decay=0.9 shuffle=true"` (key=value pairs of the critic section, as on the command line).
"""

from __future__ import annotations

from typing import Any

from ppo_critic.config.critic import CriticConfig
from ppo_critic.config.env import OPTIONS_ENV, with_options
from ppo_critic.critics import dp, megatron
from ppo_critic.integrations.hooks import after_import, installed_version

TESTED_VERL = "0.7"  # the releases whose legacy critic API this integration implements (0.7.x)
__all__ = ["OPTIONS_ENV", "REPLACED", "DataParallelPPOCritic", "MegatronPPOCritic", "critic_config", "install"]


def critic_config(config: Any) -> CriticConfig:
    """verl's critic config read by ppo-critic (`CriticConfig.from_any`), then `PPO_CRITIC_OPTIONS` applied."""
    return with_options(CriticConfig.from_any(config))


class DataParallelPPOCritic(dp.DataParallelPPOCritic):
    """ppo-critic's data-parallel critic as verl's FSDP `CriticWorker` constructs it (+ `PPO_CRITIC_OPTIONS`)."""

    def __init__(self, config: Any, critic_module: Any, critic_optimizer: Any):
        super().__init__(critic_config(config), critic_module, critic_optimizer)


class MegatronPPOCritic(megatron.MegatronPPOCritic):
    """ppo-critic's megatron critic as verl's megatron `CriticWorker` constructs it (+ `PPO_CRITIC_OPTIONS`)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        super().__init__(critic_config(config), *args, **kwargs)


# verl module -> (attribute, our class); verl binds the megatron critic by name when megatron_workers loads
PATCHES: dict[str, tuple[str, type]] = {
    "verl.workers.critic.dp_critic": ("DataParallelPPOCritic", DataParallelPPOCritic),
    "verl.workers.critic": ("DataParallelPPOCritic", DataParallelPPOCritic),
    "verl.workers.critic.megatron_critic": ("MegatronPPOCritic", MegatronPPOCritic),
    "verl.workers.megatron_workers": ("MegatronPPOCritic", MegatronPPOCritic),
}


_INSTALLED: list[bool] = []
REPLACED: dict[str, type] = {}  # verl module -> verl's own class that the patch replaced there (to compare with)


def _patch(module: Any) -> None:
    name, ours = PATCHES[module.__name__]
    original = getattr(module, name, None)
    if original is not None and original is not ours:
        REPLACED.setdefault(module.__name__, original)
        setattr(module, name, ours)


def install() -> None:
    """Make verl's workers construct ppo-critic's critics (idempotent): patch the verl modules already loaded and
    every one loaded later. Raises ImportError for a verl without the legacy critic API."""
    version = installed_version("verl")
    if version is not None and not version.startswith(TESTED_VERL + "."):
        raise ImportError(
            f"ppo_critic.integrations.verl implements verl {TESTED_VERL}.x's critic API (DataParallelPPOCritic / "
            f"MegatronPPOCritic in verl.workers.critic); the installed verl is {version}. With verl >= 0.9 set "
            "critic.strategy=ppo_critic instead (ppo-critic's engine plugin loads with verl); or install "
            f"verl=={TESTED_VERL}.*"
        )
    if not _INSTALLED:
        for name in PATCHES:
            after_import(name, _patch)
        _INSTALLED.append(True)


install()
