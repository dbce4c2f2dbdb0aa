"""Scale task: offsets and worths, the large shifted terminal reward, exact values against enumeration and
against Monte-Carlo returns of the task's own process, config validation."""

from __future__ import annotations

import itertools

import pytest
import torch

from ppo_critic.tasks import TASKS, ScaleTask, ScaleTaskConfig
from ppo_critic.tasks.common import monte_carlo_value

# Values are computed in float64 and rounded once to float32 (<= 2**-24 relative, on values up to ~50); rewards
# are float32 too. References are float64.
F32_ROUNDING = 2.0**-22
SMALL = ScaleTaskConfig(num_levels=3, num_offsets=2, reward_center=-5.0, reward_spread=20.0, reward_scale=-8.0,
                        min_response_len=1, max_response_len=5)  # fmt: skip


@pytest.fixture(scope="module")
def task() -> ScaleTask:
    return ScaleTask()


@pytest.fixture(scope="module")
def batch(task: ScaleTask) -> dict[str, torch.Tensor]:
    return task.sample(4096, torch.Generator().manual_seed(0))


def test_registry_vocab_offsets_and_worths(task: ScaleTask):
    assert TASKS["scale"] == (ScaleTask, ScaleTaskConfig)
    c = task.config
    assert task.vocab_size == c.num_levels + c.num_offsets + (c.max_response_len - c.min_response_len + 1) + 1
    assert task.offsets.tolist() == [-20.0, 10.0, 40.0]
    assert task.worths.tolist() == [-1.0, -0.5, 0.0, 0.5, 1.0]
    assert ScaleTask(ScaleTaskConfig(num_offsets=1)).offsets.tolist() == [10.0]


def test_rewards_are_large_and_shifted(task: ScaleTask, batch: dict[str, torch.Tensor]):
    offsets, lengths = task.read_prompt(batch)
    rows = torch.arange(len(lengths))
    rewards = batch["token_level_rewards"].clone()
    final = rewards[rows, lengths - 1].double()
    assert final.min() >= -30 and final.max() <= 50
    assert 5 < final.mean() < 15 and final.std() > 20, "returns far from unit scale: mean ~10, std ~25"
    rewards[rows, lengths - 1] = 0
    assert (rewards == 0).all()
    worth = torch.where(batch["response_mask"].bool(), task.worths[batch["responses"].clamp(max=4)], 0.0)
    expected = task.offsets[offsets] + task.config.reward_scale * worth.sum(-1) / lengths
    assert torch.allclose(final, expected, rtol=F32_ROUNDING, atol=0)


def test_score_tokens_are_uniform(task: ScaleTask, batch: dict[str, torch.Tensor]):
    counts = torch.bincount(batch["responses"][batch["response_mask"].bool()], minlength=task.config.num_levels)
    share = counts.double() / counts.sum()
    assert (share - 0.2).abs().max() < 5 * (0.2 * 0.8 / counts.sum()) ** 0.5


def enumerated_value(task: ScaleTask, offset: int, length: int, prefix: list[int], gamma: float) -> float:
    """Mean over every equally likely continuation of the prefix of its discounted final reward."""
    c, worths = task.config, task.worths.tolist()
    rests = list(itertools.product(range(c.num_levels), repeat=length - len(prefix)))
    total = sum(task.offsets[offset].item() + c.reward_scale * sum(worths[x] for x in prefix + list(rest)) / length
                for rest in rests)  # fmt: skip
    return gamma ** (length - 1 - len(prefix)) * total / len(rests)


@pytest.mark.parametrize("gamma", [1.0, 0.6])
def test_values_equal_enumeration(gamma: float):
    task = ScaleTask(SMALL)
    batch = task.sample(48, torch.Generator().manual_seed(4))
    values = task.true_values(batch, gamma=gamma)
    offsets, lengths = task.read_prompt(batch)
    assert set(lengths.tolist()) == set(range(1, 6))
    for row in range(48):
        tokens = batch["responses"][row].tolist()
        for t in range(int(lengths[row])):
            expected = enumerated_value(task, int(offsets[row]), int(lengths[row]), tokens[:t], gamma)
            assert values[row, t].item() == pytest.approx(expected, rel=F32_ROUNDING, abs=F32_ROUNDING)


# Monte-Carlo agreement: N continuations per check. A check passes when the mean discounted return is within 5
# standard errors (from the sample variance; the return's standard deviation given a prefix is at most
# scale·sqrt(0.5/L) <= 3.6, so a standard error <= 0.025) of the closed form, plus float32 rounding for degenerate
# returns. To show each check could fail, the test asserts that 10 standard errors are below the smallest effect
# there: a running worth off by one level (scale·0.5/L >= 0.31), and, with gamma < 1 and more than one token
# left, the undiscounted value (offsets are tens). A closed form off by such an effect is > 5 standard errors away.
N = 20_000


@pytest.mark.parametrize("gamma", [1.0, 0.95])
def test_values_match_monte_carlo(task: ScaleTask, gamma: float):
    batch = task.sample(8, torch.Generator().manual_seed(11))
    values, undiscounted = task.true_values(batch, gamma=gamma), task.true_values(batch, gamma=1.0)
    lengths = batch["response_mask"].sum(-1).tolist()
    for row in range(4):
        for t in sorted({0, 1, lengths[row] // 2, lengths[row] - 1}):
            generator = torch.Generator().manual_seed(1000 + 31 * row + t)
            mean, stderr = monte_carlo_value(task, batch, row, t, gamma, N, generator)
            v = values[row, t].item()
            assert abs(mean - v) <= 5 * stderr + F32_ROUNDING * max(1.0, abs(v)), (row, t, mean, v)
            remaining = lengths[row] - t
            effects = [gamma ** (remaining - 1) * task.config.reward_scale * 0.5 / lengths[row]]
            effects += [abs(undiscounted[row, t].item() - v)] if gamma < 1 and remaining > 1 else []
            assert all(10 * stderr < effect for effect in effects), (row, t, stderr, effects)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_levels": 1}, "num_levels"),
        ({"num_offsets": 0}, "num_offsets"),
        ({"num_offsets": 2.0}, "num_offsets"),
        ({"reward_center": float("nan")}, "reward_center"),
        ({"reward_scale": float("inf")}, "reward_scale"),
        ({"reward_spread": "wide"}, "reward_spread"),
        ({"reward_spread": -1.0}, "reward_spread"),
        ({"min_prompt_len": 3, "max_prompt_len": 2}, "max_prompt_len"),
        ({"min_response_len": 0}, "min_response_len"),
        ({"min_response_len": 17}, "max_response_len"),
    ],
)
def test_bad_config_names_the_field(overrides: dict, field: str):
    with pytest.raises(ValueError, match=rf"ScaleTaskConfig\.{field} "):
        ScaleTask(ScaleTaskConfig(**overrides))
