"""A known verl critic pitfall, checked against ppo-critic: the value at and after EOS (verl PR #1850).

Before that PR verl's critic masked its values with the attention mask shifted by one (`attention_mask[:, -R-1:-1]`),
so the position right after the last response token (EOS) kept the model's output, was fitted in the update, and
GAE's `nextvalues = values[:, t + 1]` bootstrapped the EOS token from it: its target moved by γ·V_past and the target
k tokens earlier by (γλ)^k·γ·V_past. ppo-critic's GAE functions (plain, decoupled, length-adaptive) and the trainer
never read a value or reward past the last valid response token, the value *at* EOS (the state before it) is used as it
must be, `compute_values` gives exactly 0 past EOS and `update_critic` never fits those positions. Expectations are
computed by hand (γ = 0.9 throughout) and compared with `assert_close`'s float32 defaults (rtol 1.3e-6, atol 1e-5: the
rounding of decimal hand values), while a bootstrap past EOS would move the EOS token's return by γ·V_past, 90 for
V_past = 100.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

import ppo_critic.train as train_mod
from ppo_critic import DataParallelPPOCritic
from ppo_critic.algos import (
    compute_decoupled_gae_advantage_return,
    compute_gae_advantage_return,
    compute_length_adaptive_gae_advantage_return,
    masked_whiten,
)
from ppo_critic.config.train import TrainerConfig

GAMMA = 0.9
# Row A: a 2-token response (EOS at t = 1) in a horizon of 4; row B fills the horizon. `past` marks what sits beyond
# A's EOS: anything a critic or a padded reward tensor may hold there.
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
REWARDS = [[0.0, 1.0, "past", "past"], [0.0, 0.0, 0.0, 1.0]]
VALUES = [[0.5, 0.4, "past", "past"], [0.1, 0.2, 0.3, 0.4]]
# λ = 0.8 (γλ = 0.72), the episode ends at EOS (no value after it):
#   A t1: δ = 1 − 0.4 = 0.6 (verl before #1850: 1 + 0.9·V_past − 0.4)    gae 0.6             return 1.0
#   A t0: δ = 0.9·0.4 − 0.5 = −0.14 (the value at EOS bootstraps t0)     gae 0.292           return 0.792
#   B t3: δ = 1 − 0.4 = 0.6                                               gae 0.6             return 1.0
#   B t2: δ = 0.9·0.4 − 0.3 = 0.06                                        gae 0.492           return 0.792
#   B t1: δ = 0.9·0.3 − 0.2 = 0.07                                        gae 0.42424         return 0.62424
#   B t0: δ = 0.9·0.2 − 0.1 = 0.08                                        gae 0.3854528       return 0.4854528
RAW_08 = torch.tensor([[0.292, 0.6, 0.0, 0.0], [0.3854528, 0.42424, 0.492, 0.6]])
RETURNS_08 = torch.tensor([[0.792, 1.0, 0.0, 0.0], [0.4854528, 0.62424, 0.792, 1.0]])
# λ = 0.5 (γλ = 0.45): A: t0 gae −0.14 + 0.45·0.6 = 0.13; B: t2 0.06 + 0.27 = 0.33, t1 0.07 + 0.1485 = 0.2185,
#   t0 0.08 + 0.098325 = 0.178325
RAW_05 = torch.tensor([[0.13, 0.6, 0.0, 0.0], [0.178325, 0.2185, 0.33, 0.6]])
RETURNS_05 = torch.tensor([[0.63, 1.0, 0.0, 0.0], [0.278325, 0.4185, 0.63, 1.0]])
# λ = 1 (Monte-Carlo): the discounted reward-to-go, values cancel
RETURNS_MC = torch.tensor([[0.9, 1.0, 0.0, 0.0], [0.729, 0.81, 0.9, 1.0]])
PAST = [0.0, 100.0, -1e30, math.nan, math.inf]


def with_past(rows: list[list], past: float) -> torch.Tensor:
    return torch.tensor([[past if x == "past" else x for x in row] for row in rows])


@pytest.mark.parametrize("past", PAST)
def test_gae_never_bootstraps_past_eos(past):
    advantages, returns = compute_gae_advantage_return(
        with_past(REWARDS, past), with_past(VALUES, past), MASK, GAMMA, 0.8
    )
    assert_close(returns, RETURNS_08)  # verl before #1850, with V = 100 past EOS: A's returns 65.592, 91.0
    assert_close(advantages, masked_whiten(RAW_08, MASK))


@pytest.mark.parametrize("past", PAST)
def test_decoupled_gae_never_bootstraps_past_eos(past):
    rewards, values = with_past(REWARDS, past), with_past(VALUES, past)
    advantages, returns = compute_decoupled_gae_advantage_return(rewards, values, MASK, GAMMA, 0.8, 0.5)
    assert_close(returns, RETURNS_05)
    assert_close(advantages, masked_whiten(RAW_08, MASK))


@pytest.mark.parametrize("past", PAST)
def test_length_adaptive_gae_never_bootstraps_past_eos(past):
    # α = 1: the actor's λ = 1 − 1/l is 0.5 for A (l = 2) and 0.75 for B (l = 4, γλ = 0.675): B t2 0.06 + 0.405 =
    # 0.465, t1 0.07 + 0.313875 = 0.383875, t0 0.08 + 0.259115625 = 0.339115625; A as RAW_05. The critic's λ 0.5.
    rewards, values = with_past(REWARDS, past), with_past(VALUES, past)
    advantages, returns = compute_length_adaptive_gae_advantage_return(
        rewards, values, MASK, GAMMA, alpha=1.0, lam_critic=0.5
    )
    raw = torch.tensor([[0.13, 0.6, 0.0, 0.0], [0.339115625, 0.383875, 0.465, 0.6]])
    assert_close(returns, RETURNS_05)
    assert_close(advantages, masked_whiten(raw, MASK))


class _Recorder:
    """A worker stand-in for the trainer's `_iteration`: values with `past` beyond EOS (as a critic that did not mask
    them would give), and the batch `update_critic` receives."""

    def __init__(self, step: int, past: float):
        self.step, self.values, self.seen = step, with_past(VALUES, past), None

    def compute_values(self, batch):
        return self.values

    def update_critic(self, batch, lr_scale=1.0):
        self.seen = batch
        return {}


def lambda_returns(lam_a: float, lam_b: float) -> torch.Tensor:
    """The λ-returns of A and B (one λ each), by their own recursion rather than GAE's: G_t = r_t + γ·((1 − λ)·V_{t+1}
    + λ·G_{t+1}), with V and G zero after EOS."""

    def row(rewards: list[float], values: list[float], lam: float) -> list[float]:
        out, ahead, value_ahead = [], 0.0, 0.0
        for r, v in zip(reversed(rewards), reversed(values), strict=True):
            ahead = r + GAMMA * ((1 - lam) * value_ahead + lam * ahead)
            out.append(ahead)
            value_ahead = v
        return out[::-1]

    a = row(REWARDS[0][:2], VALUES[0][:2], lam_a)
    return torch.tensor([[*a, 0.0, 0.0], row(REWARDS[1], VALUES[1], lam_b)])


def test_lambda_returns_are_the_hand_computed_ones():
    assert_close(lambda_returns(0.8, 0.8), RETURNS_08)
    assert_close(lambda_returns(0.5, 0.5), RETURNS_05)
    assert_close(lambda_returns(1.0, 1.0), RETURNS_MC)


@pytest.mark.parametrize("past", [100.0, math.nan])
@pytest.mark.parametrize(
    ("step", "settings", "lams"),
    [
        (0, {"lam": 0.8, "length_adaptive_alpha": None}, (0.8, 0.8)),
        (0, {"lam": 0.8, "length_adaptive_alpha": None, "critic_warmup_steps": 1}, (1.0, 1.0)),
        (1, {"lam": 0.8, "length_adaptive_alpha": None, "critic_warmup_steps": 1}, (0.8, 0.8)),
        # α = 1 by each response's discounted length l_γ = (1 − 0.9^l)/0.1: A 1.9, B 3.439
        (0, {"length_adaptive_alpha": 1.0, "length_adaptive_scope": "response"}, (1 - 1 / 1.9, 1 - 1 / 3.439)),
    ],
    ids=["lambda", "warmup", "after-warmup", "length-adaptive"],
)
def test_the_trainers_targets_never_bootstrap_past_eos(past, step, settings, lams):
    batch = {"token_level_rewards": with_past(REWARDS, past), "response_mask": MASK}
    worker = _Recorder(step, past)
    source = type("Source", (), {"next_batch": lambda self: dict(batch)})()
    train_mod._iteration(worker, source, TrainerConfig(gamma=GAMMA, **settings))
    assert_close(worker.seen["returns"], lambda_returns(*lams))


def _batch(past: float) -> dict[str, torch.Tensor]:
    """Two rows in DESIGN §3's layout (prompt 3, response horizon 4): A's response is 2 tokens, B's 4; old values and
    returns hold `past` beyond A's EOS."""
    attention = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]])
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 0, 0], [0, 10, 11, 12, 13, 14, 15]])
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, -4:],
        "values": with_past(VALUES, past),
        "returns": with_past([[1.0, 2.0, "past", "past"], [0.5, 1.0, -1.0, 2.0]], past),
    }


def test_the_critic_gives_zero_past_eos_and_never_fits_there(tiny_qwen2):
    """verl before #1850 trained the position after EOS toward a return there; ppo-critic's loss masks it, so what
    sits past EOS in `values` / `returns` cannot change the update."""
    params = []
    for past in (0.0, 1e6, math.nan):
        model = tiny_qwen2(seed=0)
        critic = DataParallelPPOCritic({"ppo_mini_batch_size": 2}, model, torch.optim.SGD(model.parameters(), lr=0.1))
        values = critic.compute_values(_batch(past))
        assert torch.equal(values[0, 2:], torch.zeros(2)) and (values[1] != 0).all()
        critic.update_critic(_batch(past))
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert not torch.equal(params[0], torch.cat([p.detach().flatten() for p in tiny_qwen2(seed=0).parameters()]))
    assert torch.equal(params[0], params[1]) and torch.equal(params[0], params[2])
