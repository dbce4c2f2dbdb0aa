"""Recall task: the reward counts a key that the prompt names once, dozens of tokens before the response.

Vocabulary (ids in this order): `num_symbols` symbols; one key token per symbol; `num_fillers` fillers; a marker
token; one length token per response length in [min_response_len, max_response_len]; one pad token (the last id).

A prompt is [marker, key token K_k, D random fillers (D in [min_distractors, max_distractors]), length token L]:
by default the key is D + 2 >= 34 tokens before the first response token, three times the longest response. The
response is exactly L i.i.d. symbols, each the key's symbol k with probability p (`key_prob`, by default
1/num_symbols: uniform, so the response alone says nothing about the key), else uniform over the other symbols.
The only reward is 1 on the last token when the key occurs at least m = `min_count` times. With c_t the keys among
the tokens before t:

    V_t = gamma^(L-1-t) · P(c_t + Binomial(L - t, p) >= m)

To know c_t a critic must match every response token against the key far back in the prompt.
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
    repeat_row,
    rollout_batch,
    split_layout,
    terminal_rewards,
)
from ppo_critic.tasks.recall_config import RecallTaskConfig


class RecallTask:
    """Samples rollout batches (DESIGN §3 layout) whose reward depends on a far prompt token, and their values."""

    def __init__(self, config: RecallTaskConfig | None = None):
        self.config = config if config is not None else RecallTaskConfig()
        self.config.validate()
        c = self.config
        self.symbols = TokenBlock(0, 0, c.num_symbols - 1, "symbol")
        self.keys = TokenBlock(self.symbols.end, 0, c.num_symbols - 1, "key token")
        self.fillers = TokenBlock(self.keys.end, 0, c.num_fillers - 1, "filler")
        self.marker = TokenBlock(self.fillers.end, 0, 0, "marker token")
        self.length_tokens = TokenBlock(self.marker.end, c.min_response_len, c.max_response_len, "length token")
        self.pad_token_id = self.length_tokens.end
        self.vocab_size = self.pad_token_id + 1
        self.prompt_width = c.max_distractors + 3
        self.response_width = c.max_response_len
        self._tail = binomial_tail_table(c.max_response_len, c.min_count, c.key_prob)

    def sample(self, batch_size: int, generator: torch.Generator) -> dict[str, Tensor]:
        """A batch of `batch_size` rollouts with rewards and true values; deterministic given the generator state."""
        check_batch_size(batch_size)
        c = self.config
        distractors = integers(c.min_distractors, c.max_distractors, (batch_size,), generator)
        keys = integers(0, c.num_symbols - 1, (batch_size,), generator)
        lengths = integers(c.min_response_len, c.max_response_len, (batch_size,), generator)
        fillers = integers(self.fillers.first_id, self.fillers.end - 1, (batch_size, self.prompt_width), generator)
        head = torch.stack([torch.full_like(keys, self.marker.first_id), self.keys.encode(keys)], dim=1)
        tail = self.length_tokens.encode(lengths)[:, None]
        prompts, prompt_mask = left_padded_prompts(fillers, distractors + 3, self.pad_token_id, head=head, tail=tail)
        responses = self._responses(keys, lengths, generator)
        rewards = self._rewards(responses, keys, lengths)
        batch = rollout_batch(prompts, prompt_mask, responses, prefix_mask(lengths, self.response_width), rewards)
        batch["true_values"] = self.true_values(batch, gamma=1.0)
        return batch

    def continue_responses(self, batch: Any, row: int, t: int, n: int, generator: torch.Generator) -> dict[str, Tensor]:
        """`n` responses to `row`'s prompt keeping its tokens < t, the rest i.i.d. as in `sample`."""
        keys, lengths = repeat_row(self.read_prompt(batch), row, n)
        check_prefix(t, int(lengths[0]))
        responses = self._responses(keys, lengths, generator)
        responses[:, :t] = Batch.from_any(batch)["responses"][row, :t]
        return continuation(responses, lengths, self._rewards(responses, keys, lengths))

    def true_values(self, batch: Any, gamma: float = 1.0) -> Tensor:
        """[B, R] float32 exact values `gamma^(L-1-t) · P(c_t + Bin(L-t, p) >= m)`, 0 at padded positions."""
        check_gamma(gamma)
        keys, lengths = self.read_prompt(batch)
        responses = split_layout(batch, "recall", self.response_width, 3)[1]
        return count_values(responses == keys[:, None], lengths, self.config.min_count, self._tail, gamma)

    def read_prompt(self, batch: Any) -> tuple[Tensor, Tensor]:
        """(keys, response lengths): the token after each prompt's first (the marker), and its last token."""
        input_ids, responses, prompt_end = split_layout(batch, "recall", self.response_width, 3)
        first = Batch.from_any(batch)["attention_mask"][:, :prompt_end].argmax(-1)  # the first valid prompt token
        self.marker.decode(input_ids.gather(1, first[:, None]), "first prompt token")
        keys = self.keys.decode(input_ids.gather(1, (first + 1).clamp(max=prompt_end - 1)[:, None])[:, 0], "key")
        lengths = self.length_tokens.decode(input_ids[:, prompt_end - 1], "last prompt token", responses.shape[1])
        return keys, lengths

    def _responses(self, keys: Tensor, lengths: Tensor, generator: torch.Generator) -> Tensor:
        """[B, R] right-padded i.i.d. symbols: the key with probability key_prob, else another symbol."""
        c = self.config
        tokens = iid_tokens(keys, self.response_width, c.key_prob, c.num_symbols, generator)
        return tokens.masked_fill(~prefix_mask(lengths, self.response_width).bool(), self.pad_token_id)

    def _rewards(self, responses: Tensor, keys: Tensor, lengths: Tensor) -> Tensor:
        """[B, R] float32: 1.0 at the last response token when the key occurs >= min_count times, else 0."""
        valid = prefix_mask(lengths, responses.shape[1]).bool()
        success = ((responses == keys[:, None]) & valid).sum(-1) >= self.config.min_count
        return terminal_rewards(success, lengths, responses.shape[1])
