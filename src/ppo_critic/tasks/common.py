"""What the built-in tasks share: the DESIGN §3 batch layout, blocks of special tokens, the exact value of a
count-based terminal reward, discounted sums, and a Monte-Carlo estimate of a value by a task's own process.

Value convention (DESIGN §3 alignment): the value of response token t is the expected discounted sum of the
rewards on tokens t, t+1, ... given the prompt and the response tokens before t, `V_t = E[Σ_{k>=t} γ^(k-t) r_k |
tokens < t]`; a critic predicts it at the position before token t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ppo_critic.batch import Batch


class Task(Protocol):
    """What every built-in task offers (`ppo_critic.tasks.TASKS`): `ppo-critic train` builds one from its options
    dataclass and uses `vocab_size`, `sample` and `true_values`; `continue_responses` feeds `monte_carlo_value`."""

    vocab_size: int
    pad_token_id: int
    prompt_width: int
    response_width: int

    def sample(self, batch_size: int, generator: torch.Generator) -> dict[str, Tensor]:
        """A batch of rollouts (DESIGN §3 layout) with `token_level_rewards` and `true_values` (γ = 1)."""
        ...

    def true_values(self, batch: Any, gamma: float = 1.0) -> Tensor:
        """[B, R] float32 exact values under discount `gamma`, 0 at padded positions."""
        ...

    def continue_responses(self, batch: Any, row: int, t: int, n: int, generator: torch.Generator) -> dict[str, Tensor]:
        """`n` responses to `row`'s prompt sharing its tokens < t, the rest drawn by the task's process:
        `responses`, `response_mask`, `token_level_rewards`, each [n, R]."""
        ...


@dataclass(frozen=True)
class TokenBlock:
    """Consecutive token ids from `first_id` standing for the integers `low..high` (lengths, indices of a list)."""

    first_id: int
    low: int
    high: int
    what: str
    """what a token of the block is, for errors: "length token", "drift token", ..."""

    @property
    def end(self) -> int:
        """The first id after the block."""
        return self.first_id + self.high - self.low + 1

    def encode(self, values: Tensor) -> Tensor:
        """The token ids standing for `values`."""
        return values - self.low + self.first_id

    def decode(self, ids: Tensor, where: str, high: int | None = None) -> Tensor:
        """The integers `ids` stand for; ValueError (naming `where` they were read) unless each is one of the block's,
        and at most `high` when given."""
        values = ids - self.first_id + self.low
        top = self.high if high is None else min(high, self.high)
        if not ((values >= self.low) & (values <= top)).all():
            raise ValueError(f"batch's {where} is not a valid {self.what}; was it sampled by this task?")
        return values


def prefix_mask(lengths: Tensor, width: int) -> Tensor:
    """[B, width] int64 mask with ones on the first `lengths[i]` positions of row i."""
    return (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]).long()


def check_batch_size(batch_size: int) -> None:
    """A task samples at least one rollout."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


def check_gamma(gamma: float) -> None:
    """A discount factor is in [0, 1]."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")


def integers(low: int, high: int, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Uniform random integers in [low, high], both included, on the generator's device."""
    return torch.randint(low, high + 1, shape, generator=generator, device=generator.device)


def repeat_row(values: tuple[Tensor, ...], row: int, n: int) -> tuple[Tensor, ...]:
    """Each of `values` (per-row tensors [B]) reduced to row `row`, repeated `n` times."""
    return tuple(v[row : row + 1].expand(n) for v in values)


def check_prefix(t: int, length: int) -> None:
    """A continuation keeps tokens < t of a response of `length` tokens: 0 <= t < length."""
    if not 0 <= t < length:
        raise ValueError(f"t={t} must be a response token of the row, in [0, {length})")


def left_padded_prompts(
    tokens: Tensor, lengths: Tensor, pad_token_id: int, head: Tensor | None = None, tail: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Left-padded prompts [B, P] and their mask from random fillers `tokens` [B, P]: row i keeps its last
    `lengths[i]` positions, the first of them replaced by the columns of `head` [B, h], the last by `tail` [B, k]."""
    width = tokens.shape[1]
    tokens = tokens.clone()
    if tail is not None:
        tokens[:, width - tail.shape[1] :] = tail
    if head is not None:
        columns = (width - lengths)[:, None] + torch.arange(head.shape[1], device=tokens.device)
        tokens.scatter_(1, columns, head)
    mask = prefix_mask(lengths, width).flip(-1)
    return tokens.masked_fill(~mask.bool(), pad_token_id), mask


def rollout_batch(
    prompts: Tensor, prompt_mask: Tensor, responses: Tensor, response_mask: Tensor, rewards: Tensor
) -> dict[str, Tensor]:
    """The DESIGN §3 batch of left-padded prompts and right-padded responses (position ids restart per row)."""
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask,
        "token_level_rewards": rewards,
    }


def split_layout(batch: Any, task: str, response_width: int, prompt_tokens: int) -> tuple[Tensor, Tensor, int]:
    """`(input_ids, responses, P)` of a batch in a task's layout: at most `response_width` response columns after
    a prompt of at least `prompt_tokens` columns; ValueError otherwise."""
    b = Batch.from_any(batch)
    input_ids, responses = b["input_ids"], b["responses"]
    prompt_end = input_ids.shape[1] - responses.shape[1]
    if responses.shape[1] > response_width or prompt_end < prompt_tokens:
        raise ValueError(
            f"batch does not have the {task} task's layout: input_ids {list(input_ids.shape)}, "
            f"responses {list(responses.shape)} (need R <= {response_width} and a prompt of >= {prompt_tokens} "
            "tokens)"
        )
    return input_ids, responses, prompt_end


def read_header(
    batch: Any, task: str, response_width: int, first: TokenBlock, last: TokenBlock, last_is_length: bool = True
) -> tuple[Tensor, Tensor]:
    """The integers that the last two prompt tokens stand for, in a task whose prompts end with a `first` token
    and a `last` token; unless `last_is_length` is false, the last is a response length that must fit the batch."""
    input_ids, responses, prompt_end = split_layout(batch, task, response_width, 2)
    high = responses.shape[1] if last_is_length else None
    lasts = last.decode(input_ids[:, prompt_end - 1], "last prompt token", high)
    firsts = first.decode(input_ids[:, prompt_end - 2], f"token before the {last.what}")
    return firsts, lasts


def continuation(responses: Tensor, lengths: Tensor, rewards: Tensor) -> dict[str, Tensor]:
    """What `continue_responses` returns: the responses, their mask and their rewards."""
    return {
        "responses": responses,
        "response_mask": prefix_mask(lengths, responses.shape[1]),
        "token_level_rewards": rewards,
    }


def iid_tokens(
    targets: Tensor, width: int, prob: float | Tensor, num_tokens: int, generator: torch.Generator
) -> Tensor:
    """[B, width] i.i.d. tokens of ids [0, num_tokens): row i's target with probability `prob` (a float, or one per
    row as [B, 1]), else uniform over the other ids."""
    shape, dev = (targets.shape[0], width), generator.device
    hit = torch.rand(shape, generator=generator, device=dev) < prob
    other = torch.randint(0, num_tokens - 1, shape, generator=generator, device=dev)
    other = other + (other >= targets[:, None]).long()  # skip the target id: uniform over the rest
    return torch.where(hit, targets[:, None].expand(shape), other)


def terminal_rewards(amounts: Tensor, lengths: Tensor, width: int) -> Tensor:
    """[B, width] float32 rewards: `amounts[i]` on the last response token of row i, 0 elsewhere."""
    rewards = torch.zeros((lengths.shape[0], width), dtype=torch.float32, device=lengths.device)
    rewards[torch.arange(lengths.shape[0], device=lengths.device), lengths - 1] = amounts.float()
    return rewards


def binomial_tail_table(max_n: int, max_k: int, p: float) -> Tensor:
    """`table[n, k] = P(Binomial(n, p) >= k)` for n <= max_n, k <= max_k, exact in float64 (n <= ~1000)."""
    table = torch.zeros(max_n + 1, max_k + 1, dtype=torch.float64)
    for n in range(max_n + 1):
        pmf = [math.comb(n, j) * p**j * (1.0 - p) ** (n - j) for j in range(n + 1)]
        for k in range(min(n, max_k) + 1):
            table[n, k] = math.fsum(pmf[k:])
        table[n, 0] = 1.0
    return table


def count_values(
    hits: Tensor, lengths: Tensor, min_counts: Tensor | int, tail: Tensor, gamma: float, table: Tensor | None = None
) -> Tensor:
    """[B, R] float32 values of a reward 1 on the last token when the response has at least `min_counts` hits, i.i.d.
    tokens: `γ^(L-1-t) · P(c_t + Binomial(L - t, p) >= m)`, `c_t` the hits before t, 0 at padded positions.

    `tail` is `binomial_tail_table(..., p)`, or a stack of such tables with `table` [B] choosing row i's.
    """
    t = torch.arange(hits.shape[1], device=hits.device)
    valid = t[None, :] < lengths[:, None]
    hits = (hits & valid).long()
    seen = hits.cumsum(-1) - hits
    remaining = (lengths[:, None] - t[None, :]).clamp(min=0)
    needed = (torch.as_tensor(min_counts, device=hits.device).reshape(-1, 1) - seen).clamp(min=0)
    tail = tail.to(hits.device)
    prob = tail[remaining, needed] if table is None else tail[table[:, None], remaining, needed]
    return (prob * discount_to_last(gamma, remaining) * valid).float()


def discount_to_last(gamma: float, remaining: Tensor) -> Tensor:
    """float64 `gamma^(n-1)`: the discount of a reward on the last token seen `n = remaining` tokens before it."""
    return torch.tensor(gamma, dtype=torch.float64, device=remaining.device) ** (remaining - 1).clamp(min=0)


def geometric_sums(q: float, max_n: int) -> Tensor:
    """[max_n + 1] float64: entry n is Σ_{j<n} q^j (a running sum, so q = 1 needs no special case)."""
    powers = torch.tensor(q, dtype=torch.float64) ** torch.arange(max_n, dtype=torch.float64)
    return torch.cat([torch.zeros(1, dtype=torch.float64), powers.cumsum(0)])


def discounted_return(rewards: Tensor, t: int, gamma: float) -> Tensor:
    """[B] float64 discounted sum of the rewards from token t on, `Σ_{k>=t} γ^(k-t) r_k`."""
    discounts = torch.tensor(gamma, dtype=torch.float64) ** torch.arange(rewards.shape[1] - t, dtype=torch.float64)
    return rewards[:, t:].double() @ discounts.to(rewards.device)


def monte_carlo_value(
    task: Task, batch: Any, row: int, t: int, gamma: float, n: int, generator: torch.Generator
) -> tuple[float, float]:
    """Mean and standard error (from the sample variance) of the discounted return from response token t of `row`
    over `n` continuations of its tokens < t drawn by the task's own process: an estimate of `V_t`."""
    rollouts = task.continue_responses(batch, row, t, n, generator)
    returns = discounted_return(rollouts["token_level_rewards"], t, gamma)
    return returns.mean().item(), returns.std().item() / math.sqrt(n)
