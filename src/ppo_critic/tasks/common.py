"""What the built-in tasks share: `BuiltinTask` (sampling a batch and continuing a response, the same for every
task given its generative process), blocks of special tokens, the exact value of a count-based terminal reward,
discounted sums, and a Monte-Carlo estimate of a value by a task's own process.

Value convention (DESIGN §3 alignment): the value of response token t is the expected discounted sum of the
rewards on tokens t, t+1, ... given the prompt and the response tokens before t, `V_t = E[Σ_{k>=t} γ^(k-t) r_k |
tokens < t]`; a critic predicts it at the position before token t.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from ppo_critic.data.batch import Batch
from ppo_critic.data.rows import rollout_batch

Header = tuple[Tensor, Tensor]
"""The two integers per row that a task's prompt stands for (`BuiltinTask.read_prompt`): the target and the
response length for most tasks."""
Options = TypeVar("Options")


class Task(Protocol):
    """What every built-in task offers (`ppo_critic.tasks.TASKS`): `ppo-critic train` builds one from its options
    dataclass and uses `vocab_size`, `sample` and `true_values`; `continue_responses` feeds `monte_carlo_value`."""

    vocab_size: int
    pad_token_id: int
    prompt_width: int
    response_width: int

    def sample(self, batch_size: int, generator: torch.Generator, group: int = 1) -> dict[str, Tensor]:
        """A batch of rollouts (DESIGN §3 layout) with `token_level_rewards` and `true_values` (γ = 1); `group`
        responses per prompt."""
        ...

    def true_values(self, batch: Any, gamma: float = 1.0) -> Tensor:
        """[B, R] float32 exact values under discount `gamma`, 0 at padded positions."""
        ...

    def continue_responses(self, batch: Any, row: int, t: int, n: int, generator: torch.Generator) -> dict[str, Tensor]:
        """`n` responses to `row`'s prompt sharing its tokens < t, the rest drawn by the task's process:
        `responses`, `response_mask`, `token_level_rewards`, each [n, R]."""
        ...

    def prompts(self, batch_size: int, generator: torch.Generator, group: int = 1) -> tuple[Tensor, Tensor, Header]:
        """`(prompts, prompt_mask, header)` without responses, for an actor that writes its own."""
        ...

    def rewards(self, batch: Any) -> Tensor:
        """[B, R] the rewards of the batch's responses, whoever wrote them."""
        ...

    def at(self, step: int) -> Task:
        """The fixed task of iteration `step` under the options' `drift` (itself when nothing moves)."""
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

    def draw(self, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
        """Uniform random integers of the block, `low..high` (`encode` gives their token ids)."""
        return integers(self.low, self.high, shape, generator)

    def draw_ids(self, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
        """Uniform random token ids of the block."""
        return integers(self.first_id, self.end - 1, shape, generator)

    def decode(self, ids: Tensor, where: str, high: int | None = None) -> Tensor:
        """The integers `ids` stand for; ValueError (naming `where` they were read) unless each is one of the block's,
        and at most `high` when given."""
        values = ids - self.first_id + self.low
        top = self.high if high is None else min(high, self.high)
        if not ((values >= self.low) & (values <= top)).all():
            raise ValueError(f"batch's {where} is not a valid {self.what}; was it sampled by this task?")
        return values


class BuiltinTask(ABC):
    """`Task`'s `sample` and `continue_responses`, written once from a task's generative process: a prompt whose
    header stands for two integers per row (`Header`), responses drawn given the header, and their rewards.

    A subclass sets `name` (said in layout errors), `config`, `pad_token_id` and `prompt_width`, and implements
    `true_values`, `_draw_responses` and `_rewards`; the default prompt (`_draw_prompts`, `read_prompt`) is random
    `fillers`, then one token of each block of `header_tokens`.
    """

    name: str
    config: Any
    pad_token_id: int
    prompt_width: int
    header_tokens: tuple[TokenBlock, TokenBlock]
    fillers: TokenBlock

    @property
    def vocab_size(self) -> int:
        """The number of token ids: the pad token is the last."""
        return self.pad_token_id + 1

    @property
    def response_width(self) -> int:
        """R: the longest response."""
        return self.config.max_response_len

    def sample(self, batch_size: int, generator: torch.Generator, group: int = 1) -> dict[str, Tensor]:
        """A batch of `batch_size` rollouts with rewards and true values; deterministic given the generator state.
        `group` > 1: `batch_size / group` prompts, each with `group` independent responses in consecutive rows
        (verl's `rollout.n`, what group baselines and GRPO see)."""
        prompts, prompt_mask, header = self.prompts(batch_size, generator, group)
        responses, lengths = self._responses(header, generator)
        rewards = self._rewards(responses, header, lengths)
        batch = rollout_batch(prompts, prompt_mask, responses, prefix_mask(lengths, self.response_width), rewards)
        batch["true_values"] = self.true_values(batch, gamma=1.0)
        return batch

    def continue_responses(self, batch: Any, row: int, t: int, n: int, generator: torch.Generator) -> dict[str, Tensor]:
        """`n` responses to `row`'s prompt keeping its tokens < t, the rest drawn as in `sample`."""
        header = repeat_row(self.read_prompt(batch), row, n)
        row_responses = Batch.from_any(batch)["responses"][row : row + 1]
        check_prefix(t, int(self._response_lengths(row_responses, header)[0]))
        responses, lengths = self._responses(header, generator, kept=row_responses[0, :t])
        return continuation(responses, lengths, self._rewards(responses, header, lengths))

    def prompts(self, batch_size: int, generator: torch.Generator, group: int = 1) -> tuple[Tensor, Tensor, Header]:
        """`(prompts, prompt_mask, header)` as `sample` draws them, without responses: for an actor that writes its
        own (bench/ppo_loop.py); `group` > 1 repeats each prompt in `group` consecutive rows."""
        check_batch_size(batch_size)
        check_group(batch_size, group)
        drawn = self._draw_prompts(batch_size // group, generator)
        return drawn if group == 1 else repeat_rows(drawn, group)

    def rewards(self, batch: Any) -> Tensor:
        """[B, R] float32 rewards of the batch's responses, whoever wrote them (the task's process or an actor):
        the task's reward definition applied to its prompts and responses."""
        header, responses, lengths = self._read_batch(batch, 1.0)
        return self._rewards(responses, header, lengths)

    def at(self, step: int) -> BuiltinTask:
        """The fixed task whose policy draws iteration `step`'s rollouts under `config.drift` (itself while the
        policy has not moved): its `sample` and `true_values` are those of that iteration, exactly."""
        config = self.config.at(step)
        if config is self.config:
            return self
        last = self.__dict__.get("_last_at")
        if last is None or last.config != config:  # a ramp moves every step; a step's new task is built once
            last = self._last_at = type(self)(config)
        return last

    def read_prompt(self, batch: Any) -> Header:
        """The integers that each prompt's last two tokens (`header_tokens`) stand for, in any row order."""
        return read_header(batch, self.name, self.response_width, *self.header_tokens)

    @abstractmethod
    def true_values(self, batch: Any, gamma: float = 1.0) -> Tensor:
        """[B, R] float32 exact values under discount `gamma`, 0 at padded positions."""

    def _read_batch(self, batch: Any, gamma: float) -> tuple[Header, Tensor, Tensor]:
        """`(header, responses, lengths)` of a batch to value under `gamma`; ValueError on a bad gamma or layout."""
        check_gamma(gamma)
        header = self.read_prompt(batch)
        responses = Batch.from_any(batch)["responses"]
        return header, responses, self._response_lengths(responses, header)

    def _response_lengths(self, responses: Tensor, header: Header) -> Tensor:
        """[B] the lengths of `responses`: the header's second integer, where the prompt announces them."""
        return header[1]

    def _draw_prompts(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Header]:
        """`(prompts, prompt_mask, header)`: left-padded prompts of `min..max_prompt_len` random fillers, then a token
        of each block of `header_tokens`, standing for the integers `header`."""
        (first, last), c, rows = self.header_tokens, self.config, (batch_size,)
        prompt_lens = integers(c.min_prompt_len, c.max_prompt_len, rows, generator)
        header = (first.draw(rows, generator), last.draw(rows, generator))
        fillers = self.fillers.draw_ids((batch_size, self.prompt_width), generator)
        tail = torch.stack([first.encode(header[0]), last.encode(header[1])], dim=1)
        prompts, prompt_mask = left_padded_prompts(fillers, prompt_lens + 2, self.pad_token_id, tail=tail)
        return prompts, prompt_mask, header

    def _responses(
        self, header: Header, generator: torch.Generator, kept: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """`(responses, lengths)`: [B, R] responses drawn by `_draw_responses`, right-padded, and [B] their lengths."""
        tokens, lengths = self._draw_responses(header, generator, kept)
        return tokens.masked_fill(~prefix_mask(lengths, self.response_width).bool(), self.pad_token_id), lengths

    @abstractmethod
    def _draw_responses(self, header: Header, generator: torch.Generator, kept: Tensor | None) -> tuple[Tensor, Tensor]:
        """`(tokens, lengths)`: [B, R] response tokens given each row's header (the first ones `kept` when given: a
        continuation), not yet padded, and [B] their lengths."""

    @abstractmethod
    def _rewards(self, responses: Tensor, header: Header, lengths: Tensor) -> Tensor:
        """[B, R] float32 rewards of right-padded `responses` of `lengths` tokens."""


class CountTask(BuiltinTask):
    """A task whose only reward is 1 on the last token when the target (the header's first integer) occurs at least
    `config.min_count` times, with i.i.d. response tokens: the target with probability `hit_prob`, else uniform over
    the other ids below `num_tokens`. So `V_t = γ^(L-1-t) · P(c_t + Binomial(L - t, p) >= m)` (`count_values`)."""

    def __init__(self, config: Any, hit_prob: float, num_tokens: int):
        self.config, self.hit_prob, self.num_tokens = config, hit_prob, num_tokens
        self._tail = binomial_tail_table(config.max_response_len, config.min_count, hit_prob)

    def true_values(self, batch: Any, gamma: float = 1.0) -> Tensor:
        """[B, R] float32 exact values `gamma^(L-1-t) * P(c_t + Bin(L-t, p) >= m)`, 0 at padded positions."""
        (targets, lengths), responses, _ = self._read_batch(batch, gamma)
        return count_values(responses == targets[:, None], lengths, self.config.min_count, self._tail, gamma)

    def _draw_responses(self, header: Header, generator: torch.Generator, kept: Tensor | None) -> tuple[Tensor, Tensor]:
        """i.i.d. tokens: the row's target w.p. `hit_prob`, else another of the `num_tokens` ids."""
        tokens = iid_tokens(header[0], self.response_width, self.hit_prob, self.num_tokens, generator)
        return keep_prefix(tokens, kept), header[1]

    def _rewards(self, responses: Tensor, header: Header, lengths: Tensor) -> Tensor:
        """1.0 at the last response token when the target occurs >= min_count times, else 0."""
        return count_rewards(responses, header[0], lengths, self.config.min_count)


def validated(config: Options | None, default: type[Options]) -> Options:
    """`config`, or `default()` when None, after its `validate()`: a bad field raises ValueError naming it."""
    options: Any = config if config is not None else default()
    options.validate()
    return options


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


def repeat_rows(values: Any, n: int) -> Any:
    """Each row of every tensor in `values` (nested tuples) `n` times in consecutive rows."""
    if isinstance(values, Tensor):
        return values.repeat_interleave(n, dim=0)
    return tuple(repeat_rows(v, n) for v in values)


def check_group(batch_size: int, group: int) -> None:
    """A group size is a positive integer that divides the batch."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 or batch_size % group:
        raise ValueError(f"group={group!r} must be a positive integer dividing batch_size={batch_size}")


def check_prefix(t: int, length: int) -> None:
    """A continuation keeps tokens < t of a response of `length` tokens: 0 <= t < length."""
    if not 0 <= t < length:
        raise ValueError(f"t={t} must be a response token of the row, in [0, {length})")


def keep_prefix(tokens: Tensor, kept: Tensor | None) -> Tensor:
    """`tokens` [B, R] with each row's first tokens set to `kept` when given (what a continuation keeps)."""
    if kept is not None:
        tokens[:, : len(kept)] = kept
    return tokens


def tokens_left(lengths: Tensor, width: int) -> Tensor:
    """[B, width] int64: the tokens of row i from position t on, `L - t`, 0 past its end (so `> 0` marks its tokens)."""
    t = torch.arange(width, device=lengths.device)
    return (lengths[:, None] - t[None, :]).clamp(min=0)


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


def count_rewards(responses: Tensor, targets: Tensor, lengths: Tensor, min_counts: Tensor | int) -> Tensor:
    """[B, R] float32: 1.0 on the last response token of row i when its target occurs at least `min_counts` (an int,
    or one per row) times among its tokens, else 0."""
    valid = prefix_mask(lengths, responses.shape[1]).bool()
    success = ((responses == targets[:, None]) & valid).sum(-1) >= min_counts
    return terminal_rewards(success, lengths, responses.shape[1])


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
    remaining = tokens_left(lengths, hits.shape[1])
    valid = remaining > 0
    hits = (hits & valid).long()
    seen = hits.cumsum(-1) - hits
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
