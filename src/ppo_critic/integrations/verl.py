"""ppo-critic's critics inside verl 0.7.x's own workers (verl's legacy critic API), with nothing else changed.

The one line a verl user adds, before launching verl's trainer as usual:

    export VERL_USE_EXTERNAL_MODULES=ppo_critic.integrations.verl

verl imports this module in every process that imports verl (the driver and each Ray worker), and from then on
verl's `CriticWorker`s construct ppo-critic's critics: `DataParallelPPOCritic` in `verl.workers.fsdp_workers`
(fsdp / fsdp2) and `MegatronPPOCritic` in `verl.workers.megatron_workers`, with verl's config, data and calls.
For the FSDP worker, `critic.model.external_lib=ppo_critic.integrations.verl` does the same. verl's engine worker
(`trainer.use_legacy_worker_impl=disable`) would train verl's own critic instead: built for the critic, it is refused.

ppo-critic's own options, which verl's critic config dataclasses cannot carry, come from the environment:
`PPO_CRITIC_OPTIONS="ema_decay=0.9 shuffle=true"` (key=value pairs of the critic section, as on the command line).

verl's FSDP worker builds a LoRA critic itself (peft, `TaskType.TOKEN_CLS`): the value head then trains as the copy
peft keeps of a module named `score` or `classifier` (`modules_to_save`). A model whose head verl's worker left
frozen (a head of another name) is refused naming the key.
"""

from __future__ import annotations

import functools
from typing import Any

from ppo_critic.backends.data_parallel import critic as dp
from ppo_critic.backends.megatron import critic as megatron
from ppo_critic.config.critic import CriticConfig
from ppo_critic.config.env import OPTIONS_ENV, named_in_refusals, with_options
from ppo_critic.config.verl import LEGACY_WORKER_ERROR, to_mapping
from ppo_critic.integrations.hooks import after_import, installed_version
from ppo_critic.models.hf import find_value_head, unwrap

TESTED_VERL = "0.7"  # the releases whose legacy critic API this integration implements (0.7.x)
__all__ = ["OPTIONS_ENV", "REPLACED", "DataParallelPPOCritic", "MegatronPPOCritic", "critic_config", "install"]


def critic_config(config: Any) -> CriticConfig:
    """verl's critic config read by ppo-critic (`CriticConfig.from_any`), then `PPO_CRITIC_OPTIONS` applied."""
    return with_options(CriticConfig.from_any(config))


class DataParallelPPOCritic(dp.DataParallelPPOCritic):
    """ppo-critic's data-parallel critic as verl's FSDP `CriticWorker` constructs it (+ `PPO_CRITIC_OPTIONS`)."""

    def __init__(self, config: Any, critic_module: Any, critic_optimizer: Any):
        check_value_head_trains(critic_module, config)
        with named_in_refusals():
            super().__init__(critic_config(config), critic_module, critic_optimizer)


def check_value_head_trains(critic_module: Any, config: Any) -> None:
    """Refuse a model whose value head verl's worker froze: verl's own critic would fit the values through the
    backbone alone on a random head, silently. Unchecked where the head is not found or its parameters are out of
    sight (FSDP1 flattens them into its own)."""
    try:
        parent, name = find_value_head(critic_module)
    except ValueError:
        return
    model = unwrap(critic_module)
    holder = getattr(parent, name) if parent is model else parent  # the head, or what holds it (peft's wrapper)
    params = list(holder.parameters())
    if params and not any(p.requires_grad for p in params):
        head = next(n for n, m in model.named_modules() if m is holder)
        raise ValueError(_frozen_head_error(to_mapping(config).get("model") or {}, head))


def _frozen_head_error(model: dict[str, Any], head: str) -> str:
    """One line: the verl key that froze the head (LoRA), why that stops the critic, and the fix."""
    rank = model.get("lora_rank")
    key = f"critic.model.lora_rank={rank}" if rank else "critic.model"
    fix = (
        "use a critic whose head is named score or classifier (the heads verl's LoRA critic trains)"
        if rank
        else "leave the head's parameters trainable (requires_grad)"
    )
    return f"{key}: verl's worker left the value head {head!r} frozen, so the critic could never fit values; {fix}"


class MegatronPPOCritic(megatron.MegatronPPOCritic):
    """ppo-critic's megatron critic as verl's megatron `CriticWorker` constructs it (+ `PPO_CRITIC_OPTIONS`)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        with named_in_refusals():
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


def _refuse_verls_engine_critic(module: Any) -> None:
    """verl 0.7's engine worker (`trainer.use_legacy_worker_impl=disable`) would train the critic itself, with no
    ppo-critic critic inside: refused when built for the value model (verl's actor and reference are untouched)."""
    init = module.TrainingWorker.__init__
    if getattr(init, "refuses_value_model", False):
        return

    @functools.wraps(init)
    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(config, "model_type", None) == "value_model":
            raise ValueError(LEGACY_WORKER_ERROR)
        init(self, config, *args, **kwargs)

    __init__.refuses_value_model = True
    module.TrainingWorker.__init__ = __init__


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
        after_import("verl.workers.engine_workers", _refuse_verls_engine_critic)
        _INSTALLED.append(True)


install()
