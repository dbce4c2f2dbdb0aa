"""Recall task: the key far back in the prompt, uniform responses, the terminal count reward, exact values against
enumeration and against Monte-Carlo returns of the task's own process, config validation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ppo_critic.tasks import TASKS, RecallTask, RecallTaskConfig
from ppo_critic.tasks.common import monte_carlo_value

# Values are computed in float64 and rounded once to float32 (<= 2**-24 relative); references are float64.
F32_ROUNDING = 2.0**-22
SMALL = RecallTaskConfig(
    num_symbols=3, min_distractors=0, max_distractors=4, min_response_len=1, max_response_len=6, key_prob=0.3,
    min_count=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def task() -> RecallTask:
    return RecallTask()


@pytest.fixture(scope="module")
def batch(task: RecallTask) -> dict[str, torch.Tensor]:
    return task.sample(1024, torch.Generator().manual_seed(0))


def test_registry_vocab_and_widths(task: RecallTask):
    assert TASKS["recall"] == (RecallTask, RecallTaskConfig)
    c = task.config
    assert task.vocab_size == 2 * c.num_symbols + c.num_fillers + 1 + (c.max_response_len - c.min_response_len + 1) + 1
    assert (task.prompt_width, task.response_width) == (c.max_distractors + 3, c.max_response_len)


def test_key_is_far_from_the_response(task: RecallTask, batch: dict[str, torch.Tensor]):
    c, p = task.config, task.prompt_width
    ids, attn = batch["input_ids"], batch["attention_mask"]
    first = attn[:, :p].argmax(-1)
    rows = torch.arange(len(ids))
    assert (ids[rows, first] == task.marker.first_id).all()
    keys, lengths = task.read_prompt(batch)
    assert torch.equal(task.keys.encode(keys), ids[rows, first + 1])
    assert torch.equal(lengths, batch["response_mask"].sum(-1))
    distance = p - (first + 1)  # from the key to the first response token
    assert distance.min() == c.min_distractors + 2 >= 34
    assert distance.max() == c.max_distractors + 2
    distractors = [ids[i, first[i] + 2 : p - 1] for i in range(len(ids))]
    fillers = range(task.fillers.first_id, task.fillers.end)
    assert all(((d >= fillers.start) & (d < fillers.stop)).all() for d in distractors)  # neither symbol nor key
    assert len(torch.cat(distractors).unique()) == c.num_fillers


def test_responses_are_uniform_by_default(task: RecallTask, batch: dict[str, torch.Tensor]):
    keys, _ = task.read_prompt(batch)
    mask = batch["response_mask"].bool()
    is_key = (batch["responses"] == keys[:, None])[mask].double()
    p, n = task.config.key_prob, is_key.numel()
    assert p == 1 / task.config.num_symbols
    assert abs(is_key.mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)
    counts = torch.bincount(batch["responses"][mask], minlength=task.config.num_symbols).double()
    assert (counts / n - p).abs().max() < 5 * math.sqrt(p * (1 - p) / n)


def test_reward_counts_the_key(task: RecallTask, batch: dict[str, torch.Tensor]):
    keys, lengths = task.read_prompt(batch)
    rows = torch.arange(len(keys))
    counts = ((batch["responses"] == keys[:, None]) & batch["response_mask"].bool()).sum(-1)
    rewards = batch["token_level_rewards"].clone()
    assert torch.equal(rewards[rows, lengths - 1], (counts >= task.config.min_count).float())
    rewards[rows, lengths - 1] = 0
    assert (rewards == 0).all()


def test_values_depend_on_the_far_key(task: RecallTask, batch: dict[str, torch.Tensor]):
    other = dict(batch, input_ids=batch["input_ids"].clone())
    first = batch["attention_mask"][:, : task.prompt_width].argmax(-1)
    rows = torch.arange(len(first))
    keys, _ = task.read_prompt(batch)
    other["input_ids"][rows, first + 1] = task.keys.encode((keys + 1) % task.config.num_symbols)
    changed = (task.true_values(other) != task.true_values(batch)).any(-1)
    assert changed.float().mean() > 0.5


def enumerated_value(config: RecallTaskConfig, length: int, seen: int, t: int, gamma: float) -> float:
    """Σ over every continuation of tokens t..L-1 (key or not, each with its probability) of its discounted reward."""
    p, total = config.key_prob, 0.0
    for rest in itertools.product((True, False), repeat=length - t):
        prob = math.prod(p if hit else 1 - p for hit in rest)
        total += prob * (seen + sum(rest) >= config.min_count)
    return gamma ** (length - 1 - t) * total


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_values_equal_enumeration(gamma: float):
    task = RecallTask(SMALL)
    batch = task.sample(64, torch.Generator().manual_seed(4))
    values = task.true_values(batch, gamma=gamma)
    keys, lengths = task.read_prompt(batch)
    assert set(lengths.tolist()) == set(range(1, 7))
    for row in range(64):
        hits = (batch["responses"][row] == keys[row]).tolist()
        for t in range(int(lengths[row])):
            expected = enumerated_value(SMALL, int(lengths[row]), sum(hits[:t]), t, gamma)
            assert values[row, t].item() == pytest.approx(expected, rel=F32_ROUNDING, abs=1e-30)


# Monte-Carlo agreement: N continuations per check. A check passes when the mean discounted return (in [0, 1]) is
# within 5 standard errors (from the sample variance, <= 0.0036) of the closed form, plus float32 rounding for
# degenerate returns. To show each non-degenerate check could fail, the test asserts that 10 standard errors are
# below the smallest effect there: a key count off by one (c_t ± 1: the key matched wrongly once, >= ~0.05 here)
# and, with gamma < 1 and more than 2 tokens left, the undiscounted value. A closed form off by such an effect is
# > 5 standard errors from the estimate.
N = 20_000


@pytest.mark.parametrize("config", [RecallTaskConfig(), SMALL], ids=["default", "small"])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_values_match_monte_carlo(config: RecallTaskConfig, gamma: float):
    task = RecallTask(config)
    batch = task.sample(8, torch.Generator().manual_seed(11))
    values, undiscounted = task.true_values(batch, gamma=gamma), task.true_values(batch, gamma=1.0)
    keys, lengths = task.read_prompt(batch)
    checked = 0
    for row in range(4):
        length = int(lengths[row])
        hits = (batch["responses"][row] == keys[row]).tolist()
        for t in sorted({0, length // 2, length - 1}):
            generator = torch.Generator().manual_seed(1000 + 31 * row + t)
            mean, stderr = monte_carlo_value(task, batch, row, t, gamma, N, generator)
            v = values[row, t].item()
            assert abs(mean - v) <= 5 * stderr + F32_ROUNDING * max(1.0, abs(v)), (row, t, mean, v)
            if stderr > 0:
                seen = sum(hits[:t])
                effects = [abs(enumerated_value(config, length, c, t, gamma) - v) for c in (seen - 1, seen + 1)]
                effects = [e for e in effects if e > 0]  # beyond min_count, one key more changes nothing
                effects += [abs(undiscounted[row, t].item() - v)] if gamma < 1 and length - t > 2 else []
                assert all(10 * stderr < effect for effect in effects), (row, t, stderr, effects)
                checked += 1
    assert checked >= 4, "most checks involve an uncertain outcome"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_symbols": 1}, "num_symbols"),
        ({"num_fillers": 0}, "num_fillers"),
        ({"min_distractors": -1}, "min_distractors"),
        ({"min_distractors": 10, "max_distractors": 9}, "max_distractors"),
        ({"max_distractors": 9.5}, "max_distractors"),
        ({"min_response_len": 0}, "min_response_len"),
        ({"min_response_len": 13}, "max_response_len"),
        ({"key_prob": 0.0}, "key_prob"),
        ({"key_prob": 1.0}, "key_prob"),
        ({"min_count": 0}, "min_count"),
        ({"min_count": 13}, "min_count"),
    ],
)
def test_bad_config_names_the_field(overrides: dict, field: str):
    with pytest.raises(ValueError, match=rf"RecallTaskConfig\.{field} "):
        RecallTask(RecallTaskConfig(**overrides))


def test_a_batch_without_the_marker_is_rejected(task: RecallTask, batch: dict[str, torch.Tensor]):
    bad = dict(batch, input_ids=batch["input_ids"].clone())
    bad["input_ids"][0, batch["attention_mask"][0].argmax()] = 0
    with pytest.raises(ValueError, match="first prompt token is not a valid marker token"):
        task.true_values(bad)
