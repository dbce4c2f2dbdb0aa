"""Lengths task: EOS-terminated responses of widely varying length, the reward on the EOS, exact values against
enumeration and against Monte-Carlo returns of the task's own process, config validation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ppo_critic.tasks import TASKS, LengthsTask, LengthsTaskConfig
from ppo_critic.tasks.common import monte_carlo_value

# Values are computed in float64 and rounded once to float32 (<= 2**-24 relative); references are float64.
F32_ROUNDING = 2.0**-22
SMALL = LengthsTaskConfig(
    num_targets=1, num_fillers=2, min_response_len=2, max_response_len=6, stop_probs=(0.3, 0.6), target_prob=0.4,
    min_count=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def task() -> LengthsTask:
    return LengthsTask()


@pytest.fixture(scope="module")
def batch(task: LengthsTask) -> dict[str, torch.Tensor]:
    return task.sample(2048, torch.Generator().manual_seed(0))


def lengths_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["response_mask"].sum(-1)


def test_registry_and_vocab(task: LengthsTask):
    assert TASKS["lengths"] == (LengthsTask, LengthsTaskConfig)
    c = task.config
    assert task.eos_token_id == c.num_targets + c.num_fillers + len(c.stop_probs)
    assert task.vocab_size == task.eos_token_id + 2
    assert (task.prompt_width, task.response_width) == (c.max_prompt_len + 2, c.max_response_len)


def test_every_response_ends_with_its_only_eos(task: LengthsTask, batch: dict[str, torch.Tensor]):
    lengths, rows = lengths_of(batch), torch.arange(2048)
    eos = batch["responses"] == task.eos_token_id
    assert (eos.sum(-1) == 1).all()
    assert eos[rows, lengths - 1].all()
    assert torch.equal(task.read_lengths(batch["responses"]), lengths)
    others = batch["responses"][batch["response_mask"].bool() & ~eos]
    assert ((others >= 0) & (others < task.num_ordinary)).all()


def length_distribution(config: LengthsTaskConfig, stop: float) -> list[float]:
    """P(L = l) for l = 1..max: no EOS before min_len - 1, hazard `stop` until the last token, then a sure EOS."""
    probs, alive = [], 1.0
    for k in range(config.max_response_len):
        h = 0.0 if k < config.min_response_len - 1 else 1.0 if k == config.max_response_len - 1 else stop
        probs.append(alive * h)
        alive *= 1 - h
    return probs


def test_lengths_spread_tenfold_and_follow_the_pace(task: LengthsTask, batch: dict[str, torch.Tensor]):
    c = task.config
    _, paces = task.read_prompt(batch)
    lengths = lengths_of(batch).double()
    assert lengths.min() == c.min_response_len and lengths.max() == c.max_response_len
    assert c.max_response_len >= 10 * c.min_response_len
    for d, stop in enumerate(c.stop_probs):
        probs = length_distribution(c, stop)
        mean = sum((k + 1) * q for k, q in enumerate(probs))
        var = sum((k + 1 - mean) ** 2 * q for k, q in enumerate(probs))
        chosen = lengths[paces == d]
        assert abs(chosen.mean().item() - mean) < 5 * math.sqrt(var / len(chosen)), (d, chosen.mean(), mean)
    fast, slow = lengths[paces == 0], lengths[paces == 1]
    assert fast.median() <= 12 and slow.median() >= 24, "the pace token sets the typical length"


def test_reward_on_the_eos_counts_the_target(task: LengthsTask, batch: dict[str, torch.Tensor]):
    targets, _ = task.read_prompt(batch)
    lengths, rows = lengths_of(batch), torch.arange(2048)
    counts = ((batch["responses"] == targets[:, None]) & batch["response_mask"].bool()).sum(-1)
    rewards = batch["token_level_rewards"].clone()
    assert torch.equal(rewards[rows, lengths - 1], (counts >= task.config.min_count).float())
    rewards[rows, lengths - 1] = 0
    assert (rewards == 0).all()
    assert 0.2 < (counts >= task.config.min_count).float().mean() < 0.8, "both outcomes are common"


def enumerated_value(config: LengthsTaskConfig, stop: float, seen: int, t: int, gamma: float) -> float:
    """Σ over every continuation from token t (each token EOS, target or other; the path ends at its EOS) of its
    probability times its discounted reward: no recursion, paths written out one by one."""
    p, last = config.target_prob, config.max_response_len - 1
    total = 0.0
    for end in range(t, last + 1):  # the place of the EOS
        hazards = [0.0 if k < config.min_response_len - 1 else 1.0 if k == last else stop for k in range(last + 1)]
        if hazards[end] == 0.0:
            continue
        reach = math.prod(1 - hazards[k] for k in range(t, end)) * hazards[end]
        for hits in itertools.product((True, False), repeat=end - t):
            prob = reach * math.prod(p if hit else 1 - p for hit in hits)
            total += prob * gamma ** (end - t) * (seen + sum(hits) >= config.min_count)
    return total


@pytest.mark.parametrize("gamma", [1.0, 0.7])
def test_values_equal_enumeration(gamma: float):
    task = LengthsTask(SMALL)
    batch = task.sample(48, torch.Generator().manual_seed(4))
    values = task.true_values(batch, gamma=gamma)
    targets, paces = task.read_prompt(batch)
    lengths = lengths_of(batch)
    assert set(lengths.tolist()) == set(range(2, 7))
    for row in range(48):
        hits = (batch["responses"][row] == targets[row]).tolist()
        stop = SMALL.stop_probs[int(paces[row])]
        for t in range(int(lengths[row])):
            expected = enumerated_value(SMALL, stop, sum(hits[:t]), t, gamma)
            assert values[row, t].item() == pytest.approx(expected, rel=F32_ROUNDING, abs=1e-30)


# Monte-Carlo agreement: N continuations per check. A check passes when the mean discounted return (in [0, 1]) is
# within 5 standard errors (from the sample variance, <= 0.0036) of the closed form, plus float32 rounding for
# degenerate returns. To show the checks could fail, the test asserts at those with an uncertain outcome (value in
# [0.05, 0.95]) that 10 standard errors are below the smallest effect there: a target count off by one (c_t ± 1)
# and, with gamma < 1, the undiscounted value. A closed form off by such an effect is > 5 standard errors away.
N = 20_000


@pytest.mark.parametrize("gamma", [1.0, 0.95])
def test_values_match_monte_carlo(task: LengthsTask, gamma: float):
    batch = task.sample(64, torch.Generator().manual_seed(11))
    values, undiscounted = task.true_values(batch, gamma=gamma), task.true_values(batch, gamma=1.0)
    table = task.value_table(gamma)
    targets, paces = task.read_prompt(batch)
    lengths = lengths_of(batch)
    rows = [int((paces == 0).nonzero()[0]), *(int(i) for i in (paces == 1).nonzero()[:3, 0])]
    assert lengths[rows].max() > 30, "a long response is among the checked ones"
    checked = 0
    for row in rows:
        length, m = int(lengths[row]), task.config.min_count
        hits = (batch["responses"][row] == targets[row]).tolist()
        for t in sorted({0, length // 2, length - 1}):
            generator = torch.Generator().manual_seed(1000 + 31 * row + t)
            mean, stderr = monte_carlo_value(task, batch, row, t, gamma, N, generator)
            v = values[row, t].item()
            assert abs(mean - v) <= 5 * stderr + F32_ROUNDING * max(1.0, abs(v)), (row, t, mean, v)
            if 0.05 <= v <= 0.95:
                seen = min(sum(hits[:t]), m)
                neighbours = [c for c in (seen - 1, seen + 1) if 0 <= c <= min(t, m) and c != seen]
                effects = [abs(table[paces[row], t, c].item() - v) for c in neighbours]
                effects += [abs(undiscounted[row, t].item() - v)] if gamma < 1 else []
                assert all(10 * stderr < effect for effect in effects), (row, t, stderr, effects)
                checked += 1
    assert checked >= 4, "many checks involve an uncertain outcome"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_targets": 0}, "num_targets"),
        ({"num_fillers": 0}, "num_fillers"),
        ({"min_prompt_len": 3, "max_prompt_len": 2}, "max_prompt_len"),
        ({"min_response_len": 0}, "min_response_len"),
        ({"min_response_len": 97}, "max_response_len"),
        ({"stop_probs": ()}, "stop_probs"),
        ({"stop_probs": (0.2, 1.5)}, "stop_probs"),
        ({"target_prob": 1.0}, "target_prob"),
        ({"min_count": 0}, "min_count"),
        ({"min_count": 97}, "min_count"),
    ],
)
def test_bad_config_names_the_field(overrides: dict, field: str):
    with pytest.raises(ValueError, match=rf"LengthsTaskConfig\.{field} "):
        LengthsTask(LengthsTaskConfig(**overrides))


def test_a_response_without_eos_is_rejected(task: LengthsTask, batch: dict[str, torch.Tensor]):
    bad = dict(batch, responses=batch["responses"].clone())
    bad["responses"][0] = 0
    with pytest.raises(ValueError, match="has no EOS token"):
        task.true_values(bad)
