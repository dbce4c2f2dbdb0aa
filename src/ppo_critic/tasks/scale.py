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

from ppo_critic.config.tasks import ScaleTaskConfig
from ppo_critic.tasks.common import (
    BuiltinTask,
    Header,
    TokenBlock,
    discount_to_last,
    keep_prefix,
    prefix_mask,
    terminal_rewards,
    tokens_left,
    validated,
)


class ScaleTask(BuiltinTask):
    """Samples rollout batches (DESIGN §3 layout) with a large shifted terminal reward, and their exact values."""

    name = "scale"

    def __init__(self, config: ScaleTaskConfig | None = None):
        self.config = c = validated(config, ScaleTaskConfig)
        self.score_tokens = self.fillers = TokenBlock(0, 0, c.num_levels - 1, "score token")
        self.offset_tokens = TokenBlock(self.score_tokens.end, 0, c.num_offsets - 1, "offset token")
        self.length_tokens = TokenBlock(self.offset_tokens.end, c.min_response_len, c.max_response_len, "length token")
        self.header_tokens = (self.offset_tokens, self.length_tokens)
        self.pad_token_id = self.length_tokens.end
        self.prompt_width = c.max_prompt_len + 2
        self.worths = -1.0 + 2.0 * torch.arange(c.num_levels, dtype=torch.float64) / (c.num_levels - 1)
        steps = torch.arange(c.num_offsets, dtype=torch.float64) * 2.0 / max(c.num_offsets - 1, 1) - 1.0
        self.offsets = c.reward_center + c.reward_spread * (steps if c.num_offsets > 1 else torch.zeros(1))

    def true_values(self, batch: Any, gamma: float = 1.0) -> Tensor:
        """[B, R] float32 exact values `gamma^(L-1-t) · (o + scale · (S_t + (L-t)·mu) / L)`, 0 at padded positions."""
        (offsets, lengths), responses, _ = self._read_batch(batch, gamma)
        remaining = tokens_left(lengths, responses.shape[1])
        valid = remaining > 0
        worth = self._worth(responses, valid)
        seen = worth.cumsum(-1) - worth
        mean_worth = self.worths.mean().item()
        final = (
            self.offsets.to(responses.device)[offsets][:, None]
            + self.config.reward_scale * (seen + remaining * mean_worth) / lengths[:, None]
        )
        return (final * discount_to_last(gamma, remaining) * valid).float()

    def _worth(self, responses: Tensor, valid: Tensor) -> Tensor:
        """[B, R] float64 worth of each response token, 0 at padded positions."""
        levels = responses.clamp(0, self.config.num_levels - 1)
        return torch.where(valid, self.worths.to(responses.device)[levels], 0.0)

    def _draw_responses(self, header: Header, generator: torch.Generator, kept: Tensor | None) -> tuple[Tensor, Tensor]:
        """i.i.d. uniform score tokens."""
        tokens = self.score_tokens.draw((header[1].shape[0], self.response_width), generator)
        return keep_prefix(tokens, kept), header[1]

    def _rewards(self, responses: Tensor, header: Header, lengths: Tensor) -> Tensor:
        """Offset + reward_scale × the mean worth of the response, on its last token."""
        worth = self._worth(responses, prefix_mask(lengths, responses.shape[1]).bool())
        amounts = self.offsets.to(responses.device)[header[0]] + self.config.reward_scale * worth.sum(-1) / lengths
        return terminal_rewards(amounts, lengths, responses.shape[1])
