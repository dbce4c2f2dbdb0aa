"""Counting task: batch layout, determinism, exact values vs binomial tails and Monte-Carlo, config validation."""

from __future__ import annotations

import math
import time

import pytest
import torch

from ppo_critic.data.batch import Batch
from ppo_critic.tasks import TASKS, CountingTask, CountingTaskConfig

SMALL = CountingTaskConfig(
    num_targets=2, num_fillers=3, min_prompt_len=0, max_prompt_len=2, min_response_len=2, max_response_len=7,
    target_prob=0.4, min_count=3,
)  # fmt: skip


@pytest.fixture(scope="module")
def task() -> CountingTask:
    return CountingTask()


@pytest.fixture(scope="module")
def batch(task: CountingTask) -> dict[str, torch.Tensor]:
    return task.sample(512, torch.Generator().manual_seed(0))


def lengths_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["response_mask"].sum(-1)


def targets_of(task: CountingTask, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["input_ids"][:, task.prompt_width - 2]


def test_registry_and_vocab(task: CountingTask):
    assert TASKS["counting"] == (CountingTask, CountingTaskConfig)
    c = task.config
    assert task.vocab_size == c.num_targets + c.num_fillers + (c.max_response_len - c.min_response_len + 1) + 1
    assert task.pad_token_id == task.vocab_size - 1
    assert (task.prompt_width, task.response_width) == (c.max_prompt_len + 2, c.max_response_len)


def test_layout_shapes_and_dtypes(task: CountingTask, batch: dict[str, torch.Tensor]):
    p, r = task.prompt_width, task.response_width
    expected = {
        "input_ids": ((512, p + r), torch.int64),
        "attention_mask": ((512, p + r), torch.int64),
        "position_ids": ((512, p + r), torch.int64),
        "responses": ((512, r), torch.int64),
        "response_mask": ((512, r), torch.int64),
        "token_level_rewards": ((512, r), torch.float32),
        "true_values": ((512, r), torch.float32),
    }
    assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == expected
    Batch.from_any(batch).validate()


def test_padding_masks_and_positions(task: CountingTask, batch: dict[str, torch.Tensor]):
    p = task.prompt_width
    ids, attn = batch["input_ids"], batch["attention_mask"]
    prompt_mask, response_mask = attn[:, :p], attn[:, p:]
    assert (prompt_mask.diff(dim=-1) >= 0).all(), "prompts must be left-padded"
    assert (response_mask.diff(dim=-1) <= 0).all(), "responses must be right-padded"
    assert torch.equal(response_mask, batch["response_mask"])
    assert torch.equal(ids[:, p:], batch["responses"])
    assert torch.equal(ids == task.pad_token_id, attn == 0)
    assert ((ids >= 0) & (ids < task.vocab_size)).all()
    positions = batch["position_ids"]
    first_valid = attn.argmax(-1)
    assert (positions.gather(1, first_valid[:, None]) == 0).all()
    valid_positions = [positions[i][attn[i].bool()] for i in range(len(ids))]
    assert all(torch.equal(v, torch.arange(len(v))) for v in valid_positions)


def test_prompt_structure_and_length_ranges(task: CountingTask, batch: dict[str, torch.Tensor]):
    c, p = task.config, task.prompt_width
    ids, attn = batch["input_ids"], batch["attention_mask"]
    targets, length_tokens, lengths = targets_of(task, batch), ids[:, p - 1], lengths_of(batch)
    assert ((targets >= 0) & (targets < c.num_targets)).all()
    assert torch.equal(length_tokens - task.num_ordinary + c.min_response_len, lengths)
    fillers = ids[:, : p - 2][attn[:, : p - 2].bool()]
    assert ((fillers >= c.num_targets) & (fillers < task.num_ordinary)).all()
    prompt_lens = attn[:, : p - 2].sum(-1)
    assert set(prompt_lens.tolist()) == set(range(c.min_prompt_len, c.max_prompt_len + 1))
    assert set(lengths.tolist()) == set(range(c.min_response_len, c.max_response_len + 1))
    assert set(targets.tolist()) == set(range(c.num_targets))


def test_rewards_on_last_token_only(task: CountingTask, batch: dict[str, torch.Tensor]):
    lengths, targets = lengths_of(batch), targets_of(task, batch)
    rewards, mask = batch["token_level_rewards"].clone(), batch["response_mask"].bool()
    counts = ((batch["responses"] == targets[:, None]) & mask).sum(-1)
    rows = torch.arange(len(lengths))
    assert torch.equal(rewards[rows, lengths - 1], (counts >= task.config.min_count).float())
    rewards[rows, lengths - 1] = 0
    assert (rewards == 0).all()
    assert 0.1 < (counts >= task.config.min_count).float().mean() < 0.95, "both outcomes should be common"


def test_response_token_distribution(task: CountingTask):
    big = task.sample(4096, torch.Generator().manual_seed(1))
    targets, mask = targets_of(task, big), big["response_mask"].bool()
    tokens = big["responses"][mask]
    is_target = (big["responses"] == targets[:, None])[mask].double()
    p, n = task.config.target_prob, is_target.numel()
    assert abs(is_target.mean().item() - p) < 4 * math.sqrt(p * (1 - p) / n)
    others = tokens[~is_target.bool()]
    assert ((others >= 0) & (others < task.num_ordinary)).all()
    counts = torch.bincount(others, minlength=task.num_ordinary).double()
    assert counts.min() > 0.5 * counts.mean(), "non-target tokens are uniform over the ordinary tokens"


def test_deterministic_per_seed(task: CountingTask):
    a = task.sample(64, torch.Generator().manual_seed(7))
    b = task.sample(64, torch.Generator().manual_seed(7))
    c = task.sample(64, torch.Generator().manual_seed(8))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["input_ids"], c["input_ids"])


def test_sample_is_fast(task: CountingTask):
    g = torch.Generator().manual_seed(0)
    task.sample(256, g)
    elapsed = []
    for _ in range(5):
        start = time.perf_counter()
        task.sample(256, g)
        elapsed.append(time.perf_counter() - start)
    assert min(elapsed) < 0.05


# true_values are computed in float64 and rounded once to float32: <= 2**-24 relative on values in [0, 1]; the
# references below are float64 (a float32 value times 0.9**k adds one more such rounding). 2**-23 bounds both.
F32_ROUNDING = 2.0**-23


def tail(n: int, k: int, p: float) -> float:
    """P(Binomial(n, p) >= k), independently of the task's table."""
    return sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(max(k, 0), n + 1))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_t0_is_binomial_tail(task: CountingTask, batch: dict[str, torch.Tensor], gamma: float):
    c = task.config
    values = task.true_values(batch, gamma=gamma)
    for length, v in zip(lengths_of(batch).tolist(), values[:, 0].tolist(), strict=True):
        assert v == pytest.approx(gamma ** (length - 1) * tail(length, c.min_count, c.target_prob), abs=F32_ROUNDING)


def test_sampled_true_values_and_masking(task: CountingTask, batch: dict[str, torch.Tensor]):
    values = task.true_values(batch)
    assert torch.equal(values, batch["true_values"])
    assert (values[batch["response_mask"] == 0] == 0).all()
    assert ((values >= 0) & (values <= 1)).all()


def test_value_is_discount_once_count_reached(task: CountingTask, batch: dict[str, torch.Tensor]):
    gamma, m = 0.9, task.config.min_count
    values, targets = task.true_values(batch, gamma=gamma), targets_of(task, batch)
    hits = (batch["responses"] == targets[:, None]).long() * batch["response_mask"]
    seen = hits.cumsum(-1) - hits
    done = (seen >= m) & batch["response_mask"].bool()
    assert done.any()
    for i, t in done.nonzero().tolist():
        length = int(lengths_of(batch)[i])
        assert values[i, t].item() == pytest.approx(gamma ** (length - 1 - t), abs=F32_ROUNDING)


def test_discount_by_hand_on_one_row(task: CountingTask, batch: dict[str, torch.Tensor]):
    row = int(lengths_of(batch).argmax())
    length = int(lengths_of(batch)[row])
    undiscounted, discounted = task.true_values(batch)[row], task.true_values(batch, gamma=0.9)[row]
    for t in range(length):
        assert discounted[t].item() == pytest.approx(0.9 ** (length - 1 - t) * undiscounted[t].item(), abs=F32_ROUNDING)


def test_true_values_follow_row_order(task: CountingTask, batch: dict[str, torch.Tensor]):
    perm = torch.randperm(len(batch["input_ids"]), generator=torch.Generator().manual_seed(3))
    shuffled = Batch.from_any(batch).index(perm)
    assert torch.equal(task.true_values(shuffled, gamma=0.95), task.true_values(batch, gamma=0.95)[perm])
    assert torch.equal(task.true_values({k: v[perm] for k, v in batch.items()}), batch["true_values"][perm])


def test_true_values_reject_foreign_batches(task: CountingTask, batch: dict[str, torch.Tensor]):
    bad = dict(batch, input_ids=batch["input_ids"].clone())
    bad["input_ids"][0, task.prompt_width - 1] = 0
    with pytest.raises(ValueError, match="length token"):
        task.true_values(bad)
    with pytest.raises(ValueError, match="gamma"):
        task.true_values(batch, gamma=1.5)


def monte_carlo(task: CountingTask, batch: dict, row: int, t: int, gamma: float, n: int) -> tuple[float, float]:
    """Mean and standard error of the discounted return after keeping tokens 0..t-1 of `row` and resampling."""
    targets, lengths = task.read_prompt(batch)
    target, length = targets[row : row + 1].expand(n), lengths[row : row + 1].expand(n)
    rollouts = task.sample_responses(target, length, torch.Generator().manual_seed(1000 + 31 * row + t))
    rollouts[:, :t] = batch["responses"][row, :t]
    valid = torch.arange(task.response_width)[None, :] < length[:, None]
    success = (((rollouts == target[:, None]) & valid).sum(-1) >= task.config.min_count).double()
    returns = success * gamma ** (int(lengths[row]) - 1 - t)
    return returns.mean().item(), returns.std().item() / math.sqrt(n)


@pytest.mark.parametrize("config", [CountingTaskConfig(), SMALL], ids=["default", "small"])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_closed_form_matches_monte_carlo(config: CountingTaskConfig, gamma: float):
    task = CountingTask(config)
    batch = task.sample(8, torch.Generator().manual_seed(11))
    values = task.true_values(batch, gamma=gamma)
    lengths = lengths_of(batch).tolist()
    checked = 0
    for row in range(4):
        for t in sorted({0, lengths[row] // 2, lengths[row] - 1}):
            mean, stderr = monte_carlo(task, batch, row, t, gamma, n=20000)
            assert abs(mean - values[row, t].item()) <= 4 * stderr + 1e-6, (row, t, mean, values[row, t].item())
            checked += stderr > 0
    assert checked >= 4, "most checks should involve a non-degenerate outcome"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"min_response_len": 9, "max_response_len": 8}, "min_response_len"),
        ({"min_response_len": 0}, "min_response_len"),
        ({"min_prompt_len": 5, "max_prompt_len": 4}, "max_prompt_len"),
        ({"min_prompt_len": -1}, "min_prompt_len"),
        ({"target_prob": 0.0}, "target_prob"),
        ({"target_prob": 1.0}, "target_prob"),
        ({"target_prob": -0.5}, "target_prob"),
        ({"min_count": 0}, "min_count"),
        ({"min_count": 17}, "min_count"),
        ({"num_targets": 0}, "num_targets"),
        ({"num_fillers": 0}, "num_fillers"),
        ({"num_targets": 2.5}, "num_targets"),
    ],
)
def test_bad_config_names_the_field(overrides: dict, field: str):
    with pytest.raises(ValueError, match=f"CountingTaskConfig.{field}"):
        CountingTask(CountingTaskConfig(**overrides))
