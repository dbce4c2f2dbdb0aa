"""ppo-critic's own critic options for critics that another framework constructs from its own config (which cannot
carry them): `PPO_CRITIC_OPTIONS="ema_decay=0.9 shuffle=true"`, key=value pairs of the critic section."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
from collections.abc import Iterator

from ppo_critic.config.critic import CriticConfig

OPTIONS_ENV = "PPO_CRITIC_OPTIONS"


def with_options(base: CriticConfig) -> CriticConfig:
    """`base` with `PPO_CRITIC_OPTIONS` applied (checked as the critic checks its config; errors name the variable);
    the verl keys `base` set aside are kept."""
    try:
        options = shlex.split(os.environ.get(OPTIONS_ENV, ""))
    except ValueError as err:  # shlex's bare "No closing quotation"
        raise ValueError(
            f"could not read {OPTIONS_ENV}: {str(err).lower()} (an unbalanced ' or \"); it takes key=value pairs "
            f"separated by spaces, quoted as in a shell, e.g. {OPTIONS_ENV}='ema_decay=0.9 shuffle=true'"
        ) from err
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


@contextlib.contextmanager
def named_in_refusals() -> Iterator[None]:
    """Inside, a critic's refusal (ValueError / TypeError) that names an option `PPO_CRITIC_OPTIONS` set is raised
    again naming the variable too: the user finds where the option came from (verl's config cannot hold it)."""
    try:
        yield
    except (ValueError, TypeError) as err:
        text = str(err)
        named = (re.search(rf"(?<!\w){re.escape(key)}(?!\w)", text) for key in _option_keys())
        if OPTIONS_ENV in text or not any(named):
            raise
        raise type(err)(f"{OPTIONS_ENV}={os.environ[OPTIONS_ENV]!r}: {text}") from err


def _option_keys() -> list[str]:
    """The keys `PPO_CRITIC_OPTIONS` sets, each as given and as its last part (`model.use_remove_padding`,
    `use_remove_padding`); none when it is unset or unreadable."""
    try:
        pairs = shlex.split(os.environ.get(OPTIONS_ENV, ""))
    except ValueError:
        return []
    keys = [pair.split("=", 1)[0] for pair in pairs if "=" in pair]
    return [k for key in keys for k in (key, key.rsplit(".", 1)[-1]) if k]
