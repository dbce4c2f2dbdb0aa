"""What every built-in task shares: the registry, the DESIGN §3 layout, determinism, the conventions of
`true_values` and `continue_responses` (checked on every registered task), and the helpers of `tasks.common`
and `tasks.checks` on hand-worked examples."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from ppo_critic.config.task_checks import check_lengths, check_order, check_probabilities
from ppo_critic.data.batch import Batch
from ppo_critic.tasks import TASK_CONFIGS, TASKS
from ppo_critic.tasks.common import (
    TokenBlock,
    count_values,
    discounted_return,
    geometric_sums,
    left_padded_prompts,
    monte_carlo_value,
)

NAMES = list(TASK_CONFIGS)
ROWS = 256


@pytest.fixture(scope="module", params=NAMES)
def task(request):
    return TASKS[request.param][0]()


@pytest.fixture(scope="module")
def batch(task) -> dict[str, torch.Tensor]:
    return task.sample(ROWS, torch.Generator().manual_seed(0))


def test_registry_pairs_each_task_with_its_config():
    assert list(TASKS) == NAMES == ["counting", "dense", "long", "recall", "lengths", "scale"]
    for name, (cls, config_cls) in TASKS.items():
        assert config_cls is TASK_CONFIGS[name]
        assert type(cls().config) is config_cls
        assert cls.__module__ == f"ppo_critic.tasks.{name}"
        assert config_cls.__module__ == "ppo_critic.config.tasks"
        assert all(f.default is not dataclasses.MISSING for f in dataclasses.fields(config_cls))


def test_layout_shapes_and_dtypes(task, batch):
    p, r = task.prompt_width, task.response_width
    expected = {
        "input_ids": ((ROWS, p + r), torch.int64),
        "attention_mask": ((ROWS, p + r), torch.int64),
        "position_ids": ((ROWS, p + r), torch.int64),
        "responses": ((ROWS, r), torch.int64),
        "response_mask": ((ROWS, r), torch.int64),
        "token_level_rewards": ((ROWS, r), torch.float32),
        "true_values": ((ROWS, r), torch.float32),
    }
    assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == expected
    Batch.from_any(batch).validate()
    assert task.pad_token_id == task.vocab_size - 1


def test_padding_masks_and_positions(task, batch):
    p = task.prompt_width
    ids, attn = batch["input_ids"], batch["attention_mask"]
    prompt_mask, response_mask = attn[:, :p], attn[:, p:]
    assert (prompt_mask.diff(dim=-1) >= 0).all(), "prompts must be left-padded"
    assert (response_mask.diff(dim=-1) <= 0).all(), "responses must be right-padded"
    assert prompt_mask[:, -1].all() and response_mask[:, 0].all(), "every row has a prompt and a response"
    assert torch.equal(response_mask, batch["response_mask"])
    assert torch.equal(ids[:, p:], batch["responses"])
    assert torch.equal(ids == task.pad_token_id, attn == 0)
    assert ((ids >= 0) & (ids < task.vocab_size)).all()
    positions = batch["position_ids"]
    valid_positions = [positions[i][attn[i].bool()] for i in range(ROWS)]
    assert all(torch.equal(v, torch.arange(len(v))) for v in valid_positions)


def test_rewards_are_finite_and_only_on_response_tokens(task, batch):
    rewards = batch["token_level_rewards"]
    assert torch.isfinite(rewards).all()
    assert (rewards[batch["response_mask"] == 0] == 0).all()
    assert rewards.abs().sum() > 0


def test_deterministic_per_seed(task):
    a = task.sample(32, torch.Generator().manual_seed(7))
    b = task.sample(32, torch.Generator().manual_seed(7))
    c = task.sample(32, torch.Generator().manual_seed(8))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["input_ids"], c["input_ids"])


def test_sampled_true_values_are_the_undiscounted_ones_and_zero_at_padding(task, batch):
    values = task.true_values(batch)
    assert torch.equal(values, batch["true_values"])
    assert torch.equal(task.true_values(batch, gamma=1.0), values)
    assert (values[batch["response_mask"] == 0] == 0).all()
    assert (task.true_values(batch, gamma=0.9)[batch["response_mask"] == 0] == 0).all()


def test_gamma_zero_values_are_the_expected_next_reward(task, batch):
    """With gamma = 0, V_t = E[r_t | tokens < t]: the differences r_t - V_t have mean 0 and are uncorrelated
    (martingale differences), so their mean over the batch is within 6 standard errors of 0."""
    mask = batch["response_mask"].bool()
    diff = (batch["token_level_rewards"].double() - task.true_values(batch, gamma=0.0).double())[mask]
    assert abs(diff.mean().item()) <= 6 * diff.std().item() / math.sqrt(diff.numel()) + 1e-6


def test_true_values_follow_row_order(task, batch):
    perm = torch.randperm(ROWS, generator=torch.Generator().manual_seed(3))
    shuffled = Batch.from_any(batch).index(perm)
    assert torch.equal(task.true_values(shuffled, gamma=0.95), task.true_values(batch, gamma=0.95)[perm])


def test_true_values_reject_a_bad_gamma_and_foreign_batches(task, batch):
    with pytest.raises(ValueError, match="gamma"):
        task.true_values(batch, gamma=1.5)
    bad = dict(batch, input_ids=batch["input_ids"].clone())
    bad["input_ids"][0, task.prompt_width - 1] = task.pad_token_id
    with pytest.raises(ValueError, match="was it sampled by this task"):
        task.true_values(bad)
    wide = {k: torch.cat([v, v[:, -1:]], dim=1) if k in ("responses", "input_ids") else v for k, v in batch.items()}
    with pytest.raises(ValueError, match="layout"):
        task.true_values(wide)


def test_continuations_keep_the_prefix_and_follow_the_layout(task, batch):
    row = 1
    length = int(batch["response_mask"][row].sum())
    t = length // 2
    rollouts = task.continue_responses(batch, row, t, 64, torch.Generator().manual_seed(5))
    assert set(rollouts) == {"responses", "response_mask", "token_level_rewards"}
    assert all(v.shape == (64, task.response_width) for v in rollouts.values())
    assert (rollouts["responses"][:, :t] == batch["responses"][row, :t]).all()
    assert rollouts["response_mask"][:, : t + 1].all()
    assert torch.equal(rollouts["responses"] == task.pad_token_id, rollouts["response_mask"] == 0)
    assert (rollouts["token_level_rewards"][rollouts["response_mask"] == 0] == 0).all()
    assert len(set(map(tuple, rollouts["responses"].tolist()))) > 1, "the continuations are random"
    with pytest.raises(ValueError, match="t=-1"):
        task.continue_responses(batch, row, -1, 4, torch.Generator())
    with pytest.raises(ValueError, match=f"t={length}"):
        task.continue_responses(batch, row, length, 4, torch.Generator())


def test_sample_rejects_an_empty_batch(task):
    with pytest.raises(ValueError, match="batch_size"):
        task.sample(0, torch.Generator())


# --------------------------------------------------------------------------------------------------------------
# helpers, on hand-worked examples
# --------------------------------------------------------------------------------------------------------------
def test_token_block_encodes_and_decodes_its_range():
    block = TokenBlock(first_id=10, low=4, high=6, what="length token")  # ids 10, 11, 12 stand for 4, 5, 6
    assert block.end == 13
    assert block.encode(torch.tensor([4, 6])).tolist() == [10, 12]
    assert block.decode(torch.tensor([10, 12]), "x").tolist() == [4, 6]
    with pytest.raises(ValueError, match="batch's last token is not a valid length token"):
        block.decode(torch.tensor([13]), "last token")
    with pytest.raises(ValueError, match="length token"):
        block.decode(torch.tensor([12]), "x", high=5)  # 6 > high


def test_left_padded_prompts_place_head_fillers_and_tail():
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    head, tail = torch.tensor([[80, 81], [90, 91]]), torch.tensor([[70], [71]])
    prompts, mask = left_padded_prompts(tokens, torch.tensor([4, 6]), 0, head=head, tail=tail)
    # row 0 keeps its last 4 positions (2..5): head at 2, 3, the filler at 4, the tail at 5
    assert prompts.tolist() == [[0, 0, 80, 81, 5, 70], [90, 91, 3, 4, 5, 71]]
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert tokens[0].tolist() == [1, 2, 3, 4, 5, 6], "the fillers given are not modified"


def test_geometric_sums_and_discounted_returns_by_hand():
    # q = 0.5: sums of the first n powers 0, 1, 1.5, 1.75; q = 1: n
    assert geometric_sums(0.5, 3).tolist() == [0.0, 1.0, 1.5, 1.75]
    assert geometric_sums(1.0, 3).tolist() == [0.0, 1.0, 2.0, 3.0]
    # rewards [1, 0, 2], gamma 0.5: from t0: 1 + 0.5*0 + 0.25*2 = 1.5; from t1: 0 + 0.5*2 = 1; from t2: 2
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 4.0, 0.0]])
    assert [discounted_return(rewards, t, 0.5).tolist() for t in range(3)] == [[1.5, 2.0], [1.0, 4.0], [2.0, 0.0]]


def test_count_values_by_hand():
    # p = 0.5, m = 2, L = 3, gamma 0.5; hits [1, 0, *]: before t0 no hit, needs 2 of 3: P = 4/8, discount 0.25
    #   t1: one hit, needs 1 of 2: P = 3/4, discount 0.5; t2: one hit, needs 1 of 1: P = 1/2, discount 1
    tail = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.5, 0.0], [1.0, 0.75, 0.25], [1.0, 0.875, 0.5]], dtype=torch.float64)
    hits = torch.tensor([[True, False, True, True]])  # the last column is padding (L = 3): ignored
    values = count_values(hits, torch.tensor([3]), 2, tail, 0.5)
    assert values.tolist() == [[0.125, 0.375, 0.5, 0.0]]


def test_monte_carlo_value_of_a_certain_return_is_exact():
    """Counting's last token once the count is reached: every continuation succeeds, the standard error is 0."""
    task = TASKS["counting"][0]()
    batch = task.sample(64, torch.Generator().manual_seed(0))
    targets, lengths = task.read_prompt(batch)
    hits = (batch["responses"] == targets[:, None]) & batch["response_mask"].bool()
    row = int(torch.nonzero(hits.sum(-1) - hits[torch.arange(64), lengths - 1].long() >= 2)[0])
    t = int(lengths[row]) - 1
    assert monte_carlo_value(task, batch, row, t, 0.9, 100, torch.Generator().manual_seed(1)) == (1.0, 0.0)


@dataclasses.dataclass
class _Lengths:
    min_x_len: int = 1
    max_x_len: int = 3
    probs: tuple = (0.5,)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"min_x_len": 1.5}, "_Lengths.min_x_len must be an int, got 1.5"),
        ({"min_x_len": 0}, "_Lengths.min_x_len must be >= 1, got 0"),
        ({"max_x_len": 0}, "_Lengths.max_x_len (0) must be >= min_x_len (1)"),
    ],
)
def test_checks_name_the_class_and_field(change, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_lengths(_Lengths(**change), "x", shortest=1)


def test_check_order_blames_the_named_field_and_probabilities_need_a_list():
    with pytest.raises(ValueError, match=r"_Lengths.min_x_len \(5\) must be <= max_x_len \(3\)"):
        check_order(_Lengths(min_x_len=5), "min_x_len", "max_x_len", blame="min_x_len")
    for bad in [(), (0.5, 1.0), (0.0,), 0.5, ("a",), (float("nan"),)]:
        with pytest.raises(ValueError, match=r"_Lengths\.probs must be a non-empty list of probabilities"):
            check_probabilities(_Lengths(probs=bad), "probs")


@pytest.mark.parametrize("name", list(TASKS))
def test_a_group_is_one_prompt_with_independent_responses_in_consecutive_rows(name):
    task = TASKS[name][0]()
    batch = task.sample(12, torch.Generator().manual_seed(0), group=4)
    prompts = batch["input_ids"][:, : task.prompt_width]
    assert torch.equal(prompts, prompts[::4].repeat_interleave(4, dim=0))
    assert len({tuple(r.tolist()) for r in prompts[::4]}) == 3
    responses = batch["responses"].view(3, 4, -1)
    assert any(not torch.equal(g[0], g[i]) for g in responses for i in range(1, 4))
    torch.testing.assert_close(batch["true_values"], task.true_values(batch), rtol=0, atol=0)


def test_a_group_of_one_is_the_plain_sample():
    task = TASKS["counting"][0]()
    one, plain = (task.sample(8, torch.Generator().manual_seed(3), *g) for g in ((1,), ()))
    assert all(torch.equal(one[k], plain[k]) for k in plain)
    with pytest.raises(ValueError, match="group=3 must be a positive integer dividing batch_size=8"):
        task.sample(8, torch.Generator(), group=3)


@pytest.mark.parametrize("name", ["counting", "dense", "long", "recall", "lengths", "scale"])
def test_rewards_of_a_batch_are_the_rewards_sample_gave_it_and_prompts_are_samples_prompts(name):
    """`rewards` (what scores an actor's responses) is the task's own reward definition; `prompts` draws what
    `sample` draws before its responses (the same generator state, the same rows)."""
    task = TASKS[name][0]()
    batch = task.sample(12, torch.Generator().manual_seed(3), group=3)
    assert torch.equal(task.rewards(batch), batch["token_level_rewards"])
    prompts, prompt_mask, _ = task.prompts(12, torch.Generator().manual_seed(3), group=3)
    width = prompts.shape[1]
    assert torch.equal(prompts, batch["input_ids"][:, :width])
    assert torch.equal(prompt_mask, batch["attention_mask"][:, :width])
    flipped = {**batch, "responses": batch["responses"].clone()}
    flipped["responses"][batch["response_mask"].bool()] = 0  # other responses, other rewards (where 0 is ordinary)
    flipped["input_ids"] = torch.cat([prompts, flipped["responses"]], dim=1)
    if name in ("counting", "dense"):
        assert not torch.equal(task.rewards(flipped), batch["token_level_rewards"])
