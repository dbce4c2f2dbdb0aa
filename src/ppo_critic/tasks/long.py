"""Long task: a majority vote over a long response (hundreds of tokens) with one reward at its very end.

Vocabulary (ids in this order): an up token (0) and a down token (1); one drift token per entry of `up_probs`;
one length token per response length in [min_response_len, max_response_len]; one pad token (the last id).

A prompt is random steps followed by [drift token d, length token L]. The response is exactly L i.i.d. steps, each
up with probability p_d = up_probs[d]. The only reward is 1 on the last token when the ups are a strict majority
(more than L/2), else 0. With u_t the ups before token t and n = L - t tokens to come:

    V_t = gamma^(n-1) · P(u_t + Binomial(n, p_d) >= floor(L/2) + 1)

A critic must keep a running count over hundreds of tokens, read the drift and length from a prompt that ends
far behind, and learn a sharp function of the count and the tokens left; with GAE's lambda < 1 the sparse reward
reaches the first tokens only by bootstrapping through hundreds of steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ppo_critic.config.tasks import LongTaskConfig
from ppo_critic.tasks.common import (
    BuiltinTask,
    Header,
    TokenBlock,
    binomial_tail_table,
    count_rewards,
    count_values,
    iid_tokens,
    keep_prefix,
    validated,
)

UP, DOWN = 0, 1


class LongTask(BuiltinTask):
    """Samples long rollout batches (DESIGN §3 layout) with a terminal majority reward, and their exact values."""

    name = "long"

    def __init__(self, config: LongTaskConfig | None = None):
        self.config = c = validated(config, LongTaskConfig)
        self.fillers = TokenBlock(UP, UP, DOWN, "step")
        self.drift_tokens = TokenBlock(2, 0, len(c.up_probs) - 1, "drift token")
        self.length_tokens = TokenBlock(self.drift_tokens.end, c.min_response_len, c.max_response_len, "length token")
        self.header_tokens = (self.drift_tokens, self.length_tokens)
        self.pad_token_id = self.length_tokens.end
        self.prompt_width = c.max_prompt_len + 2
        self._up_probs = torch.tensor(c.up_probs, dtype=torch.float64)
        width, most = c.max_response_len, c.max_response_len // 2 + 1
        self._tails = torch.stack([binomial_tail_table(width, most, p) for p in c.up_probs])

    def true_values(self, batch: Any, gamma: float = 1.0) -> Tensor:
        """[B, R] float32 exact values `gamma^(L-1-t) · P(u_t + Bin(L-t, p_d) > L/2)`, 0 at padded positions."""
        (drifts, lengths), responses, _ = self._read_batch(batch, gamma)
        return count_values(responses == UP, lengths, lengths // 2 + 1, self._tails, gamma, table=drifts)

    def _draw_responses(self, header: Header, generator: torch.Generator, kept: Tensor | None) -> tuple[Tensor, Tensor]:
        """i.i.d. steps, up with row i's drift probability."""
        drifts, lengths = header
        prob = self._up_probs.to(drifts.device)[drifts][:, None]
        tokens = iid_tokens(torch.full_like(drifts, UP), self.response_width, prob, 2, generator)
        return keep_prefix(tokens, kept), lengths

    def _rewards(self, responses: Tensor, header: Header, lengths: Tensor) -> Tensor:
        """1.0 at the last response token when more than half the steps are up (at least L // 2 + 1), else 0."""
        return count_rewards(responses, torch.full_like(lengths, UP), lengths, lengths // 2 + 1)
