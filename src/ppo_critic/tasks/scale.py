"""Scale task: one large, shifted reward at the end, so returns are far from unit scale (rewards in [-30, 50] with
mean 10 by default): the case that value normalisation is for.

Vocabulary (ids in this order): `num_levels` score tokens, token j worth w_j = -1 + 2j / (num_levels - 1);
`num_offsets` offset tokens, offset token i standing for o_i = center + spread·(2i / (num_offsets - 1) - 1) (just
the center when there is one); one length token per response length in [min_response_len, max_response_len]; one
pad token (the last id).

A prompt is random score tokens followed by [offset token i, length token L]. The response is exactly L i.i.d.
uniform score tokens. The only reward, on the last token, is o_i + scale · (1/L) Σ_k w(x_k). With S_t the worth of
the tokens before t and mu = E[w] (0 for these evenly spaced worths):

    V_t = gamma^(L-1-t) · (o_i + scale · (S_t + (L - t)·mu) / L)

By default most of the values' variance is the offset's, read from the prompt (-20, 10 or 40), and a few units are
the running mean of the response: a critic regressing raw returns must fit targets tens of units from its start.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ppo_critic.batch import Batch
from ppo_critic.tasks.common import (
    TokenBlock,
    check_batch_size,
    check_gamma,
    check_prefix,
    continuation,
    discount_to_last,
    integers,
    left_padded_prompts,
    prefix_mask,
    read_header,
    repeat_row,
    rollout_batch,
    split_layout,
    terminal_rewards,
)
from ppo_critic.tasks.scale_config import ScaleTaskConfig


class ScaleTask:
    """Samples rollout batches (DESIGN §3 layout) with a large shifted terminal reward, and their exact values."""

    def __init__(self, config: ScaleTaskConfig | None = None):
        self.config = config if config is not None else ScaleTaskConfig()
        self.config.validate()
        c = self.config
        self.score_tokens = TokenBlock(0, 0, c.num_levels - 1, "score token")
        self.offset_tokens = TokenBlock(self.score_tokens.end, 0, c.num_offsets - 1, "offset token")
        self.length_tokens = TokenBlock(self.offset_tokens.end, c.min_response_len, c.max_response_len, "length token")
        self.pad_token_id = self.length_tokens.end
        self.vocab_size = self.pad_token_id + 1
        self.prompt_width = c.max_prompt_len + 2
        self.response_width = c.max_response_len
        self.worths = -1.0 + 2.0 * torch.arange(c.num_levels, dtype=torch.float64) / (c.num_levels - 1)
        steps = torch.arange(c.num_offsets, dtype=torch.float64) * 2.0 / max(c.num_offsets - 1, 1) - 1.0
        self.offsets = c.reward_center + c.reward_spread * (steps if c.num_offsets > 1 else torch.zeros(1))

    def sample(self, batch_size: int, generator: torch.Generator) -> dict[str, Tensor]:
        """A batch of `batch_size` rollouts with rewards and true values; deterministic given the generator state."""
        check_batch_size(batch_size)
        c = self.config
        prompt_lens = integers(c.min_prompt_len, c.max_prompt_len, (batch_size,), generator)
        offsets = integers(0, c.num_offsets - 1, (batch_size,), generator)
        lengths = integers(c.min_response_len, c.max_response_len, (batch_size,), generator)
        fillers = integers(0, c.num_levels - 1, (batch_size, self.prompt_width), generator)
        header = torch.stack([self.offset_tokens.encode(offsets), self.length_tokens.encode(lengths)], dim=1)
        prompts, prompt_mask = left_padded_prompts(fillers, prompt_lens + 2, self.pad_token_id, tail=header)
        responses = self._responses(lengths, generator)
        rewards = self._rewards(responses, offsets, lengths)
        batch = rollout_batch(prompts, prompt_mask, responses, prefix_mask(lengths, self.response_width), rewards)
        batch["true_values"] = self.true_values(batch, gamma=1.0)
        return batch

    def continue_responses(self, batch: Any, row: int, t: int, n: int, generator: torch.Generator) -> dict[str, Tensor]:
        """`n` responses to `row`'s prompt keeping its tokens < t, the rest i.i.d. uniform score tokens."""
        offsets, lengths = repeat_row(self.read_prompt(batch), row, n)
        check_prefix(t, int(lengths[0]))
        responses = self._responses(lengths, generator)
        responses[:, :t] = Batch.from_any(batch)["responses"][row, :t]
        return continuation(responses, lengths, self._rewards(responses, offsets, lengths))

    def true_values(self, batch: Any, gamma: float = 1.0) -> Tensor:
        """[B, R] float32 exact values `gamma^(L-1-t) · (o + scale · (S_t + (L-t)·mu) / L)`, 0 at padded positions."""
        check_gamma(gamma)
        offsets, lengths = self.read_prompt(batch)
        responses = split_layout(batch, "scale", self.response_width, 2)[1]
        t = torch.arange(responses.shape[1], device=responses.device)
        valid = t[None, :] < lengths[:, None]
        worth = self._worth(responses, valid)
        seen = worth.cumsum(-1) - worth
        remaining = (lengths[:, None] - t[None, :]).clamp(min=0)
        mean_worth = self.worths.mean().item()
        final = (
            self.offsets.to(responses.device)[offsets][:, None]
            + self.config.reward_scale * (seen + remaining * mean_worth) / lengths[:, None]
        )
        return (final * discount_to_last(gamma, remaining) * valid).float()

    def read_prompt(self, batch: Any) -> tuple[Tensor, Tensor]:
        """(offset indices, response lengths) read from the last two prompt tokens of `input_ids` (any row order)."""
        return read_header(batch, "scale", self.response_width, self.offset_tokens, self.length_tokens)

    def _worth(self, responses: Tensor, valid: Tensor) -> Tensor:
        """[B, R] float64 worth of each response token, 0 at padded positions."""
        levels = responses.clamp(0, self.config.num_levels - 1)
        return torch.where(valid, self.worths.to(responses.device)[levels], 0.0)

    def _responses(self, lengths: Tensor, generator: torch.Generator) -> Tensor:
        """[B, R] right-padded i.i.d. uniform score tokens."""
        tokens = integers(0, self.config.num_levels - 1, (lengths.shape[0], self.response_width), generator)
        return tokens.masked_fill(~prefix_mask(lengths, self.response_width).bool(), self.pad_token_id)

    def _rewards(self, responses: Tensor, offsets: Tensor, lengths: Tensor) -> Tensor:
        """[B, R] float32: offset + reward_scale × the mean worth of the response, on its last token."""
        worth = self._worth(responses, prefix_mask(lengths, responses.shape[1]).bool())
        amounts = self.offsets.to(responses.device)[offsets] + self.config.reward_scale * worth.sum(-1) / lengths
        return terminal_rewards(amounts, lengths, responses.shape[1])
