"""Dense task: prompt and chain statistics, rewards on every liked token, exact values against matrix powers and
against Monte-Carlo returns of the task's own chain, config validation."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_critic.tasks import TASKS, DenseTask, DenseTaskConfig
from ppo_critic.tasks.common import monte_carlo_value

# Values are computed in float64 and rounded once to float32 (<= 2**-24 relative); references are float64.
F32_ROUNDING = 2.0**-22


@pytest.fixture(scope="module")
def task() -> DenseTask:
    return DenseTask()


@pytest.fixture(scope="module")
def batch(task: DenseTask) -> dict[str, torch.Tensor]:
    return task.sample(2048, torch.Generator().manual_seed(0))


def test_registry_and_vocab(task: DenseTask):
    assert TASKS["dense"] == (DenseTask, DenseTaskConfig)
    c = task.config
    assert task.vocab_size == c.num_symbols + (c.max_response_len - c.min_response_len + 1) + 1
    assert (task.prompt_width, task.response_width) == (c.max_prompt_len + 2, c.max_response_len)


def test_prompt_names_a_liked_symbol_and_the_length(task: DenseTask, batch: dict[str, torch.Tensor]):
    c, p = task.config, task.prompt_width
    liked, lengths = task.read_prompt(batch)
    assert torch.equal(lengths, batch["response_mask"].sum(-1))
    assert torch.equal(liked, batch["input_ids"][:, p - 2])
    assert set(liked.tolist()) == set(range(c.num_symbols))
    assert set(lengths.tolist()) == set(range(c.min_response_len, c.max_response_len + 1))
    fillers = batch["input_ids"][:, : p - 2][batch["attention_mask"][:, : p - 2].bool()]
    assert ((fillers >= 0) & (fillers < c.num_symbols)).all()


def test_chain_repeats_with_the_stay_probability(task: DenseTask, batch: dict[str, torch.Tensor]):
    # A token repeats the one before it with probability s + (1 - s)/S (stay, or a fresh draw of the same symbol);
    # the first token is uniform. Both within 5 binomial standard errors.
    c, mask = task.config, batch["response_mask"].bool()
    tokens = batch["responses"]
    pairs = mask[:, 1:]
    repeats = (tokens[:, 1:] == tokens[:, :-1])[pairs].double()
    p = c.stay_prob + (1 - c.stay_prob) / c.num_symbols
    assert abs(repeats.mean().item() - p) < 5 * math.sqrt(p * (1 - p) / repeats.numel())
    first = torch.bincount(tokens[:, 0], minlength=c.num_symbols).double() / len(tokens)
    assert (first - 1 / c.num_symbols).abs().max() < 5 * math.sqrt(1 / c.num_symbols / len(tokens))


def test_rewards_on_every_liked_token(task: DenseTask, batch: dict[str, torch.Tensor]):
    liked, _ = task.read_prompt(batch)
    expected = ((batch["responses"] == liked[:, None]) & batch["response_mask"].bool()).float()
    assert torch.equal(batch["token_level_rewards"], expected)
    per_row = expected.sum(-1)
    assert per_row.mean() > 1.5 and (per_row > 1).float().mean() > 0.3, "rewards on many tokens, not only one"


def matrix_power_value(config: DenseTaskConfig, liked: int, length: int, prefix: list[int], gamma: float) -> float:
    """V_t from the transition matrix itself: Σ_j gamma^j P(x_(t+j) = liked | x_(t-1)), distributions propagated by
    explicit matrix products in float64 (no closed form)."""
    s, size = config.stay_prob, config.num_symbols
    transition = s * torch.eye(size, dtype=torch.float64) + (1 - s) / size
    if prefix:
        dist = torch.zeros(size, dtype=torch.float64)
        dist[prefix[-1]] = 1.0
        dist = dist @ transition
    else:
        dist = torch.full((size,), 1 / size, dtype=torch.float64)
    total = 0.0
    for j in range(length - len(prefix)):
        total += gamma**j * dist[liked].item()
        dist = dist @ transition
    return total


@pytest.mark.parametrize("config", [DenseTaskConfig(), DenseTaskConfig(num_symbols=3, stay_prob=0.8)], ids=str)
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
def test_values_equal_matrix_powers(config: DenseTaskConfig, gamma: float):
    task = DenseTask(config)
    batch = task.sample(24, torch.Generator().manual_seed(2))
    values = task.true_values(batch, gamma=gamma)
    liked, lengths = task.read_prompt(batch)
    for row in range(24):
        tokens = batch["responses"][row].tolist()
        for t in range(int(lengths[row])):
            expected = matrix_power_value(config, int(liked[row]), int(lengths[row]), tokens[:t], gamma)
            assert values[row, t].item() == pytest.approx(expected, rel=F32_ROUNDING, abs=F32_ROUNDING)


# Monte-Carlo agreement: N continuations per check. A check passes when the mean discounted return is within 5
# standard errors (from the sample variance) of the closed form, plus float32 rounding for degenerate returns. To
# show each check could fail, the test also asserts that 10 standard errors are below the smallest effect checked
# there: the value had x_(t-1) been (or not been) the liked symbol (the chain's memory, s·G(gamma·s, n), t >= 1)
# and, with n >= 4 tokens left, the value under the other gamma (discounting; nearer the end it is too small for
# N). A closed form off by such an effect is then > 5 standard errors from the estimate. Exactness at finer
# scales is test_values_equal_matrix_powers' job.
N = 20_000
OTHER_GAMMA = {1.0: 0.9, 0.9: 1.0}


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_values_match_monte_carlo(task: DenseTask, gamma: float):
    batch = task.sample(8, torch.Generator().manual_seed(11))
    values, other = task.true_values(batch, gamma=gamma), task.true_values(batch, gamma=OTHER_GAMMA[gamma])
    lengths = batch["response_mask"].sum(-1).tolist()
    s, discount_checks = task.config.stay_prob, 0
    for row in range(4):
        for t in sorted({0, 1, lengths[row] // 2, lengths[row] - 2}):
            generator = torch.Generator().manual_seed(1000 + 31 * row + t)
            mean, stderr = monte_carlo_value(task, batch, row, t, gamma, N, generator)
            v = values[row, t].item()
            assert abs(mean - v) <= 5 * stderr + F32_ROUNDING * max(1.0, abs(v)), (row, t, mean, v)
            n = lengths[row] - t
            effects = [s * sum((gamma * s) ** j for j in range(n))] if t > 0 else []
            effects += [abs(other[row, t].item() - v)] if n >= 4 else []
            assert all(10 * stderr < effect for effect in effects), (row, t, stderr, effects)
            discount_checks += n >= 4
    assert discount_checks >= 8


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_symbols": 1}, "num_symbols"),
        ({"num_symbols": 2.0}, "num_symbols"),
        ({"min_prompt_len": -1}, "min_prompt_len"),
        ({"min_prompt_len": 5, "max_prompt_len": 4}, "max_prompt_len"),
        ({"min_response_len": 0}, "min_response_len"),
        ({"min_response_len": 9, "max_response_len": 8}, "max_response_len"),
        ({"stay_prob": 1.0}, "stay_prob"),
        ({"stay_prob": -0.1}, "stay_prob"),
    ],
)
def test_bad_config_names_the_field(overrides: dict, field: str):
    with pytest.raises(ValueError, match=rf"DenseTaskConfig\.{field} "):
        DenseTask(DenseTaskConfig(**overrides))


def test_stay_prob_zero_is_an_iid_response():
    task = DenseTask(DenseTaskConfig(stay_prob=0.0))
    batch = task.sample(16, torch.Generator().manual_seed(0))
    lengths = batch["response_mask"].sum(-1)
    t = torch.arange(task.response_width)
    expected = ((lengths[:, None] - t) / task.config.num_symbols).clamp(min=0)  # n tokens left, each liked w.p. 1/S
    assert torch.allclose(batch["true_values"], expected.float(), rtol=F32_ROUNDING, atol=0)
