"""Counting task: reward 1 when a response contains the prompt's target token at least `min_count` times.

Vocabulary (ids in this order):
  - `num_targets` target tokens, then `num_fillers` filler tokens (together the ordinary tokens);
  - one length token per response length in [min_response_len, max_response_len];
  - one pad token (the last id).

A prompt is random fillers followed by [target, length token L]; the response is exactly L i.i.d. tokens, each
the target with probability p and otherwise uniform over the other ordinary tokens. The only reward is on the
last response token. So the value before response token t (c_t targets seen so far) is known exactly:
`gamma^(L-1-t) * P(c_t + Binomial(L - t, p) >= min_count)`, which is what a perfect critic should predict.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ppo_critic.batch import Batch
from ppo_critic.tasks.common import (
    TokenBlock,
    binomial_tail_table,
    check_batch_size,
    check_gamma,
    check_prefix,
    continuation,
    count_values,
    iid_tokens,
    integers,
    left_padded_prompts,
    prefix_mask,
    read_header,
    repeat_row,
    rollout_batch,
    split_layout,
    terminal_rewards,
)
from ppo_critic.tasks.counting_config import CountingTaskConfig


class CountingTask:
    """Samples rollout batches (DESIGN §3 layout) and computes their exact value function."""

    def __init__(self, config: CountingTaskConfig | None = None):
        self.config = config if config is not None else CountingTaskConfig()
        self.config.validate()
        c = self.config
        self.num_ordinary = c.num_targets + c.num_fillers
        self.target_tokens = TokenBlock(0, 0, c.num_targets - 1, "target token")
        self.length_tokens = TokenBlock(self.num_ordinary, c.min_response_len, c.max_response_len, "length token")
        self.pad_token_id = self.length_tokens.end
        self.vocab_size = self.pad_token_id + 1
        self.prompt_width = c.max_prompt_len + 2
        self.response_width = c.max_response_len
        self._tail = binomial_tail_table(c.max_response_len, c.min_count, c.target_prob)

    def length_token_id(self, lengths: Tensor) -> Tensor:
        """The dedicated token id announcing each response length."""
        return self.length_tokens.encode(lengths)

    def sample(self, batch_size: int, generator: torch.Generator) -> dict[str, Tensor]:
        """A batch of `batch_size` rollouts with rewards and true values; deterministic given the generator state."""
        check_batch_size(batch_size)
        c = self.config
        prompt_lens = integers(c.min_prompt_len, c.max_prompt_len, (batch_size,), generator)
        targets = integers(0, c.num_targets - 1, (batch_size,), generator)
        lengths = integers(c.min_response_len, c.max_response_len, (batch_size,), generator)
        fillers = integers(c.num_targets, self.num_ordinary - 1, (batch_size, self.prompt_width), generator)
        header = torch.stack([targets, self.length_token_id(lengths)], dim=1)
        prompts, prompt_mask = left_padded_prompts(fillers, prompt_lens + 2, self.pad_token_id, tail=header)
        responses = self.sample_responses(targets, lengths, generator)
        rewards = self._rewards(responses, targets, lengths)
        batch = rollout_batch(prompts, prompt_mask, responses, prefix_mask(lengths, self.response_width), rewards)
        batch["true_values"] = self.true_values(batch, gamma=1.0)
        return batch

    def sample_responses(self, targets: Tensor, lengths: Tensor, generator: torch.Generator) -> Tensor:
        """[B, R] i.i.d. response tokens (target w.p. target_prob, else another ordinary token), right-padded."""
        tokens = iid_tokens(targets, self.response_width, self.config.target_prob, self.num_ordinary, generator)
        return tokens.masked_fill(~prefix_mask(lengths, self.response_width).bool(), self.pad_token_id)

    def continue_responses(self, batch: Any, row: int, t: int, n: int, generator: torch.Generator) -> dict[str, Tensor]:
        """`n` responses to `row`'s prompt keeping its tokens < t, the rest i.i.d. as in `sample_responses`."""
        targets, lengths = repeat_row(self.read_prompt(batch), row, n)
        check_prefix(t, int(lengths[0]))
        responses = self.sample_responses(targets, lengths, generator)
        responses[:, :t] = Batch.from_any(batch)["responses"][row, :t]
        return continuation(responses, lengths, self._rewards(responses, targets, lengths))

    def true_values(self, batch: Any, gamma: float = 1.0) -> Tensor:
        """[B, R] float32 exact values `gamma^(L-1-t) * P(c_t + Bin(L-t, p) >= m)`, 0 at padded positions."""
        check_gamma(gamma)
        targets, lengths = self.read_prompt(batch)
        responses = split_layout(batch, "counting", self.response_width, 2)[1]
        return count_values(responses == targets[:, None], lengths, self.config.min_count, self._tail, gamma)

    def read_prompt(self, batch: Any) -> tuple[Tensor, Tensor]:
        """(targets, response lengths) read from the last two prompt tokens of `input_ids` (any row order)."""
        return read_header(batch, "counting", self.response_width, self.target_tokens, self.length_tokens)

    def _rewards(self, responses: Tensor, targets: Tensor, lengths: Tensor) -> Tensor:
        """[B, R] float32: 1.0 at the last response token when the target occurs >= min_count times, else 0."""
        valid = prefix_mask(lengths, responses.shape[1]).bool()
        success = ((responses == targets[:, None]) & valid).sum(-1) >= self.config.min_count
        return terminal_rewards(success, lengths, responses.shape[1])
