"""config/env.py: PPO_CRITIC_OPTIONS, the options of a critic another framework constructs."""

from __future__ import annotations

import pytest

from ppo_critic.config.critic import CriticConfig
from ppo_critic.config.env import OPTIONS_ENV, with_options


def test_the_options_apply_and_an_unbalanced_quote_is_named(monkeypatch):
    base = CriticConfig.from_any({"ppo_mini_batch_size": 4})
    monkeypatch.setenv(OPTIONS_ENV, "ema_decay=0.9 'vf_loss_type=huber'")
    config = with_options(base)
    assert (config.ema_decay, config.vf_loss_type) == (0.9, "huber")
    monkeypatch.setenv(OPTIONS_ENV, "ema_decay='0.9")
    with pytest.raises(ValueError, match=r"could not read PPO_CRITIC_OPTIONS: no closing quotation \(an unbalanced"):
        with_options(base)
