"""Long task: prompt and step statistics, the terminal majority reward, exact values against an independent
backward recursion and against Monte-Carlo returns of the task's own steps, config validation."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_critic.config.train import TrainConfig
from ppo_critic.tasks import TASKS, LongTask, LongTaskConfig
from ppo_critic.tasks.common import monte_carlo_value

# Values are computed in float64 and rounded once to float32 (<= 2**-24 relative); references are float64.
F32_ROUNDING = 2.0**-22


@pytest.fixture(scope="module")
def task() -> LongTask:
    return LongTask()


@pytest.fixture(scope="module")
def batch(task: LongTask) -> dict[str, torch.Tensor]:
    return task.sample(512, torch.Generator().manual_seed(0))


def test_registry_vocab_and_widths(task: LongTask):
    assert TASKS["long"] == (LongTask, LongTaskConfig)
    c = task.config
    assert task.vocab_size == 2 + len(c.up_probs) + (c.max_response_len - c.min_response_len + 1) + 1
    assert task.response_width == c.max_response_len >= 256


def test_prompt_names_the_drift_and_length(task: LongTask, batch: dict[str, torch.Tensor]):
    c, p = task.config, task.prompt_width
    drifts, lengths = task.read_prompt(batch)
    assert torch.equal(lengths, batch["response_mask"].sum(-1))
    assert set(drifts.tolist()) == set(range(len(c.up_probs)))
    assert lengths.min() >= c.min_response_len and lengths.max() <= c.max_response_len
    assert lengths.float().std() > 5, "lengths vary over the range"
    steps = batch["input_ids"][:, : p - 2][batch["attention_mask"][:, : p - 2].bool()]
    assert ((steps == 0) | (steps == 1)).all()


def test_up_steps_follow_the_drift(task: LongTask, batch: dict[str, torch.Tensor]):
    drifts, _ = task.read_prompt(batch)
    mask = batch["response_mask"].bool()
    for d, p in enumerate(task.config.up_probs):
        ups = (batch["responses"][drifts == d] == 0)[mask[drifts == d]].double()
        assert abs(ups.mean().item() - p) < 5 * math.sqrt(p * (1 - p) / ups.numel())


def test_reward_is_the_majority_on_the_last_token(task: LongTask, batch: dict[str, torch.Tensor]):
    lengths, rows = batch["response_mask"].sum(-1), torch.arange(512)
    ups = ((batch["responses"] == 0) & batch["response_mask"].bool()).sum(-1)
    rewards = batch["token_level_rewards"].clone()
    assert torch.equal(rewards[rows, lengths - 1], (2 * ups > lengths).float())
    rewards[rows, lengths - 1] = 0
    assert (rewards == 0).all()
    assert 0.3 < (2 * ups > lengths).float().mean() < 0.7, "both outcomes are common"


def success_table(length: int, p: float) -> list[list[float]]:
    """`table[k][u]`: P(more than length/2 ups in all) with u ups before step k, by backward recursion over the
    steps in float64 (independent of the task's binomial tails)."""
    table = [[1.0 if 2 * u > length else 0.0 for u in range(length + 1)]]
    for k in reversed(range(length)):
        after = table[0]
        table.insert(0, [p * after[u + 1] + (1 - p) * after[u] for u in range(k + 1)])
    return table


@pytest.mark.parametrize("gamma", [1.0, 0.99])
def test_values_equal_a_backward_recursion(task: LongTask, batch: dict[str, torch.Tensor], gamma: float):
    values = task.true_values(batch, gamma=gamma)
    drifts, lengths = task.read_prompt(batch)
    for row in range(3):
        length, p = int(lengths[row]), task.config.up_probs[int(drifts[row])]
        table, ups = success_table(length, p), 0
        for t in range(length):
            expected = gamma ** (length - 1 - t) * table[t][ups]
            assert values[row, t].item() == pytest.approx(expected, rel=F32_ROUNDING, abs=1e-30)
            ups += int(batch["responses"][row, t] == 0)


# Monte-Carlo agreement: N continuations per check. A check passes when the mean discounted return (in [0, 1]) is
# within 5 standard errors (from the sample variance) of the closed form, plus float32 rounding for degenerate
# returns. To show the checks could fail, the test asserts at those whose outcome is uncertain (success probability
# in [0.05, 0.95]) that 10 standard errors are below the smallest effect there: a count off by one (u_t ± 1, a
# binomial pmf near its middle, >= ~0.01) and, with gamma < 1, the undiscounted value. A closed form off by such
# an effect is > 5 standard errors away from the estimate.
N = 20_000


@pytest.mark.parametrize("gamma", [1.0, 0.99])
def test_values_match_monte_carlo(task: LongTask, gamma: float):
    batch = task.sample(16, torch.Generator().manual_seed(11))
    values, undiscounted = task.true_values(batch, gamma=gamma), task.true_values(batch, gamma=1.0)
    drifts, lengths = task.read_prompt(batch)
    checked = 0
    for row in [int((drifts == d).nonzero()[0]) for d in range(len(task.config.up_probs))]:  # a row of each drift
        length = int(lengths[row])
        table = success_table(length, task.config.up_probs[int(drifts[row])])
        for t in (0, length // 2):
            generator = torch.Generator().manual_seed(1000 + 31 * row + t)
            mean, stderr = monte_carlo_value(task, batch, row, t, gamma, N, generator)
            v = values[row, t].item()
            assert abs(mean - v) <= 5 * stderr + F32_ROUNDING * max(1.0, abs(v)), (row, t, mean, v)
            ups, discount = int((batch["responses"][row, :t] == 0).sum()), gamma ** (length - 1 - t)
            if 0.05 <= table[t][ups] <= 0.95:
                neighbours = [u for u in (ups - 1, ups + 1) if 0 <= u <= t]  # counts possible before token t
                effects = [discount * abs(table[t][u] - table[t][ups]) for u in neighbours]
                effects += [abs(undiscounted[row, t].item() - v)] if gamma < 1 else []
                assert all(10 * stderr < effect for effect in effects), (row, t, stderr, effects)
                checked += 1
    assert checked >= 3, "many checks involve an uncertain outcome"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"up_probs": ()}, "up_probs"),
        ({"up_probs": (0.5, 1.0)}, "up_probs"),
        ({"up_probs": (0.0,)}, "up_probs"),
        ({"up_probs": 0.5}, "up_probs"),
        ({"min_prompt_len": -1}, "min_prompt_len"),
        ({"min_prompt_len": 3, "max_prompt_len": 2}, "max_prompt_len"),
        ({"min_response_len": 0}, "min_response_len"),
        ({"min_response_len": 300, "max_response_len": 299}, "max_response_len"),
        ({"max_response_len": 1001}, "max_response_len"),
        ({"max_response_len": 300.0}, "max_response_len"),
    ],
)
def test_bad_config_names_the_field(overrides: dict, field: str):
    with pytest.raises(ValueError, match=rf"LongTaskConfig\.{field} "):
        LongTask(LongTaskConfig(**overrides))


def test_the_drifts_are_an_option_list():
    cfg = TrainConfig.from_mapping({"task": {"name": "long", "up_probs": [0.4, 0.6], "max_response_len": 260}})
    assert cfg.task_config() == LongTaskConfig(up_probs=(0.4, 0.6), max_response_len=260)
