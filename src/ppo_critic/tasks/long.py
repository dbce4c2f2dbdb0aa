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
from ppo_critic.tasks.long_config import LongTaskConfig

UP, DOWN = 0, 1


class LongTask:
    """Samples long rollout batches (DESIGN §3 layout) with a terminal majority reward, and their exact values."""

    def __init__(self, config: LongTaskConfig | None = None):
        self.config = config if config is not None else LongTaskConfig()
        self.config.validate()
        c = self.config
        self.drift_tokens = TokenBlock(2, 0, len(c.up_probs) - 1, "drift token")
        self.length_tokens = TokenBlock(self.drift_tokens.end, c.min_response_len, c.max_response_len, "length token")
        self.pad_token_id = self.length_tokens.end
        self.vocab_size = self.pad_token_id + 1
        self.prompt_width = c.max_prompt_len + 2
        self.response_width = c.max_response_len
        self._up_probs = torch.tensor(c.up_probs, dtype=torch.float64)
        width, most = c.max_response_len, c.max_response_len // 2 + 1
        self._tails = torch.stack([binomial_tail_table(width, most, p) for p in c.up_probs])

    def sample(self, batch_size: int, generator: torch.Generator) -> dict[str, Tensor]:
        """A batch of `batch_size` rollouts with rewards and true values; deterministic given the generator state."""
        check_batch_size(batch_size)
        c = self.config
        prompt_lens = integers(c.min_prompt_len, c.max_prompt_len, (batch_size,), generator)
        drifts = integers(0, len(c.up_probs) - 1, (batch_size,), generator)
        lengths = integers(c.min_response_len, c.max_response_len, (batch_size,), generator)
        fillers = integers(UP, DOWN, (batch_size, self.prompt_width), generator)
        header = torch.stack([self.drift_tokens.encode(drifts), self.length_tokens.encode(lengths)], dim=1)
        prompts, prompt_mask = left_padded_prompts(fillers, prompt_lens + 2, self.pad_token_id, tail=header)
        responses = self._steps(drifts, lengths, generator)
        rewards = self._rewards(responses, lengths)
        batch = rollout_batch(prompts, prompt_mask, responses, prefix_mask(lengths, self.response_width), rewards)
        batch["true_values"] = self.true_values(batch, gamma=1.0)
        return batch

    def continue_responses(self, batch: Any, row: int, t: int, n: int, generator: torch.Generator) -> dict[str, Tensor]:
        """`n` responses to `row`'s prompt keeping its tokens < t, the rest i.i.d. steps of the row's drift."""
        drifts, lengths = repeat_row(self.read_prompt(batch), row, n)
        check_prefix(t, int(lengths[0]))
        responses = self._steps(drifts, lengths, generator)
        responses[:, :t] = Batch.from_any(batch)["responses"][row, :t]
        return continuation(responses, lengths, self._rewards(responses, lengths))

    def true_values(self, batch: Any, gamma: float = 1.0) -> Tensor:
        """[B, R] float32 exact values `gamma^(L-1-t) · P(u_t + Bin(L-t, p_d) > L/2)`, 0 at padded positions."""
        check_gamma(gamma)
        drifts, lengths = self.read_prompt(batch)
        responses = split_layout(batch, "long", self.response_width, 2)[1]
        return count_values(responses == UP, lengths, lengths // 2 + 1, self._tails, gamma, table=drifts)

    def read_prompt(self, batch: Any) -> tuple[Tensor, Tensor]:
        """(drifts, response lengths) read from the last two prompt tokens of `input_ids` (any row order)."""
        return read_header(batch, "long", self.response_width, self.drift_tokens, self.length_tokens)

    def _steps(self, drifts: Tensor, lengths: Tensor, generator: torch.Generator) -> Tensor:
        """[B, R] right-padded i.i.d. steps, up with row i's drift probability."""
        ups = torch.full_like(drifts, UP)
        prob = self._up_probs.to(drifts.device)[drifts][:, None]
        tokens = iid_tokens(ups, self.response_width, prob, 2, generator)
        return tokens.masked_fill(~prefix_mask(lengths, self.response_width).bool(), self.pad_token_id)

    def _rewards(self, responses: Tensor, lengths: Tensor) -> Tensor:
        """[B, R] float32: 1.0 at the last response token when more than half the steps are up, else 0."""
        ups = ((responses == UP) & prefix_mask(lengths, responses.shape[1]).bool()).sum(-1)
        return terminal_rewards(2 * ups > lengths, lengths, responses.shape[1])
