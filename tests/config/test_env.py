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


def test_a_critics_refusal_of_an_option_the_variable_set_names_the_variable(monkeypatch):
    """Issue 52: refusals from the critic's constructor (here: packed rows with sdpa attention) did not name
    PPO_CRITIC_OPTIONS, where the option came from; one about an option the variable did not set is left as it is."""
    import torch

    from conftest import tiny_config
    from ppo_critic import build_value_model
    from ppo_critic.integrations.verl import DataParallelPPOCritic

    model = build_value_model(tiny_config("qwen2"))
    options = "model.use_remove_padding=true model.attn_implementation=sdpa"
    monkeypatch.setenv(OPTIONS_ENV, options)
    with pytest.raises(ValueError, match=rf"^PPO_CRITIC_OPTIONS='{options}': model.use_remove_padding: cannot run"):
        DataParallelPPOCritic({"ppo_mini_batch_size": 2}, model, torch.optim.SGD(model.parameters(), lr=0.1))
    monkeypatch.setenv(OPTIONS_ENV, "ema_decay=0.5")
    with pytest.raises(ValueError, match=r"^value_norm=popart needs"):
        DataParallelPPOCritic({"ppo_mini_batch_size": 2, "value_norm": "popart"}, nn_without_bias(), None)


def nn_without_bias():
    """A model whose value head has no bias (TRL-style `v_head`), which PopArt refuses."""
    import torch

    from ppo_critic import build_value_model

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.v_head = torch.nn.Linear(4, 1, bias=False)

        def forward(self, input_ids, **kwargs):
            return None, None, self.v_head(torch.zeros(*input_ids.shape, 4))

    return build_value_model(Model())


def test_only_a_refusal_that_names_a_key_the_variable_set_names_the_variable(monkeypatch):
    """A key counts as named where it stands as a word (`critic.optim.lr=2`), not inside another (`already`)."""
    from ppo_critic.config.env import named_in_refusals

    monkeypatch.setenv(OPTIONS_ENV, "optim.lr=2 ema_decay=0.5")
    for text, named in [("critic.optim.lr=2 is too high", True), ("critic.ema_decay > 0 needs DDP", True),
                        ("the rate is already set", False), ("ema_decays=3 is unknown", False)]:  # fmt: skip
        with pytest.raises(ValueError) as caught, named_in_refusals():
            raise ValueError(text)
        assert str(caught.value).startswith(f"{OPTIONS_ENV}='optim.lr=2 ema_decay=0.5': ") == named, text
