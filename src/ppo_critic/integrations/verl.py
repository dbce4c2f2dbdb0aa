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

import importlib.abc
import importlib.machinery
import os
import shlex
import sys
from collections.abc import Callable
from typing import Any

from ppo_critic.config import CriticConfig
from ppo_critic.critics import dp, megatron

OPTIONS_ENV = "PPO_CRITIC_OPTIONS"
TESTED_VERL = "0.7"  # the releases whose legacy critic API this integration implements (0.7.x)


def critic_config(config: Any) -> CriticConfig:
    """verl's critic config read by ppo-critic (`CriticConfig.from_any`), then `PPO_CRITIC_OPTIONS` applied."""
    base = CriticConfig.from_any(config)
    options = shlex.split(os.environ.get(OPTIONS_ENV, ""))
    if not options:
        return base
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    bad = [o for o in options if "=" not in o]
    if bad:
        raise ValueError(f"{OPTIONS_ENV} holds {bad}; it takes key=value pairs, e.g. {OPTIONS_ENV}='ema_decay=0.9'")
    try:
        merged = OmegaConf.merge(OmegaConf.create(base.to_dict()), OmegaConf.from_dotlist(options))
        plain = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as err:
        raise ValueError(f"could not read {OPTIONS_ENV}: {err}") from err
    try:
        config = CriticConfig.from_dict(plain)
        config.validate(worker=False)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{OPTIONS_ENV}: {err}") from err
    config.verl_keys = base.verl_keys
    return config


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


REPLACED: dict[str, type] = {}  # verl module -> verl's own class that the patch replaced there (to compare with)


def _patch(module: Any) -> None:
    name, ours = PATCHES[module.__name__]
    original = getattr(module, name, None)
    if original is not None and original is not ours:
        REPLACED.setdefault(module.__name__, original)
        setattr(module, name, ours)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Replaces verl's critic classes in the modules of `PATCHES` as soon as each finishes loading, so nothing is
    imported early (this module is loaded from inside `import verl`)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in PATCHES:
            return None
        for finder in sys.meta_path:  # the spec the import system would have used without this finder
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, _patch)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    """The real loader, then `after(module)`; everything else (sources, resources) is the real loader's."""

    def __init__(self, loader: importlib.abc.Loader, after: Callable[[Any], None]):
        self.loader, self.after = loader, after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.after(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def install() -> None:
    """Make verl's workers construct ppo-critic's critics (idempotent): patch the verl modules already loaded and
    every one loaded later. Raises ImportError for a verl without the legacy critic API."""
    version = _verl_version()
    if version is not None and not version.startswith(TESTED_VERL + "."):
        raise ImportError(
            f"ppo_critic.integrations.verl implements verl {TESTED_VERL}.x's critic API (DataParallelPPOCritic / "
            f"MegatronPPOCritic in verl.workers.critic); the installed verl is {version}. Install verl=={TESTED_VERL}.*"
        )
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
    for name in PATCHES:
        if name in sys.modules:
            _patch(sys.modules[name])


def _verl_version() -> str | None:
    """The installed verl's version, without importing verl (this may run from inside `import verl`)."""
    from importlib import metadata

    try:
        return metadata.version("verl")
    except metadata.PackageNotFoundError:
        return None


install()
