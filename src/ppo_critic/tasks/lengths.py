"""Lengths task: responses stop at an EOS after a random, prompt-paced number of tokens (8 to 96 by default, a 12×
spread: the case VAPO's length-adaptive GAE targets); one reward on the EOS.

Vocabulary (ids in this order): `num_targets` target tokens, then `num_fillers` filler tokens (together the
ordinary tokens); one pace token per entry of `stop_probs`; an EOS token; one pad token (the last id).

A prompt is random fillers followed by [target, pace token d]. Response token k (k = 0, 1, ...) is EOS with
probability h_k: 0 for k < min_response_len - 1, h_d = stop_probs[d] up to k = max_response_len - 2, and 1 at
k = max_response_len - 1; otherwise it is an ordinary token, the target with probability p, else uniform over the
other ordinary tokens. The response ends with its EOS, so its length L is random and announced nowhere (by default
fast prompts mostly stop within 8..20 tokens, slow ones anywhere up to 96). The only reward is 1 on the EOS when
the target occurred at least m = `min_count` times, else 0.

The value before token k with c targets seen (c capped at m, beyond which nothing changes) is W_d(k, c):

    W_d(K - 1, c) = 1[c >= m]                                       K = max_response_len
    W_d(k, c) = h_k·1[c >= m] + (1 - h_k)·gamma·(p·W_d(k+1, min(c+1, m)) + (1 - p)·W_d(k+1, c))

computed backwards in float64, and V_t = W_d(t, min(c_t, m)) with c_t the targets before token t. The horizon is
random, so gamma < 1 weighs every possible length by its own gamma^(L-1-t): the value depends on gamma through the
stopping time, not by one factor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ppo_critic.config.tasks import LengthsTaskConfig
from ppo_critic.tasks.common import (
    BuiltinTask,
    Header,
    TokenBlock,
    count_rewards,
    iid_tokens,
    read_header,
    validated,
)


class LengthsTask(BuiltinTask):
    """Samples rollout batches (DESIGN §3 layout) of widely varying lengths, and their exact values."""

    name = "lengths"

    def __init__(self, config: LengthsTaskConfig | None = None):
        self.config = c = validated(config, LengthsTaskConfig)
        self.num_ordinary = c.num_targets + c.num_fillers
        self.target_tokens = TokenBlock(0, 0, c.num_targets - 1, "target token")
        self.fillers = TokenBlock(c.num_targets, 0, c.num_fillers - 1, "filler")
        self.pace_tokens = TokenBlock(self.num_ordinary, 0, len(c.stop_probs) - 1, "pace token")
        self.header_tokens = (self.target_tokens, self.pace_tokens)
        self.eos_token_id = self.pace_tokens.end
        self.pad_token_id = self.eos_token_id + 1
        self.prompt_width = c.max_prompt_len + 2
        k = torch.arange(c.max_response_len)
        stop = torch.tensor(c.stop_probs, dtype=torch.float64)[:, None].expand(-1, c.max_response_len)
        self._hazards = torch.where(k < c.min_response_len - 1, 0.0, stop).clone()  # [paces, K]: P(EOS at k)
        self._hazards[:, -1] = 1.0

    def true_values(self, batch: Any, gamma: float = 1.0) -> Tensor:
        """[B, R] float32 exact values `W_d(t, min(c_t, m))` (module docstring), 0 at padded positions."""
        (targets, paces), responses, lengths = self._read_batch(batch, gamma)
        t = torch.arange(responses.shape[1], device=responses.device)
        valid = t[None, :] < lengths[:, None]
        hits = ((responses == targets[:, None]) & valid).long()
        seen = (hits.cumsum(-1) - hits).clamp(max=self.config.min_count)
        table = self.value_table(gamma).to(responses.device)
        return (table[paces[:, None], t[None, :], seen] * valid).float()

    def value_table(self, gamma: float) -> Tensor:
        """[paces, K, m + 1] float64: `W_d(k, c)` of the module docstring, by backward induction over k."""
        c = self.config
        m, p = c.min_count, c.target_prob
        done = (torch.arange(m + 1) >= m).double()
        one_more = torch.arange(1, m + 2).clamp(max=m)  # c -> min(c + 1, m)
        table = torch.zeros(len(c.stop_probs), c.max_response_len, m + 1, dtype=torch.float64)
        table[:, -1] = done
        for k in reversed(range(c.max_response_len - 1)):
            after = table[:, k + 1]
            h = self._hazards[:, k, None]
            table[:, k] = h * done + (1 - h) * gamma * (p * after[:, one_more] + (1 - p) * after)
        return table

    def read_prompt(self, batch: Any) -> Header:
        """(targets, paces) read from the last two prompt tokens of `input_ids` (any row order)."""
        return read_header(batch, self.name, self.response_width, *self.header_tokens, last_is_length=False)

    def read_lengths(self, responses: Tensor) -> Tensor:
        """[B] response lengths: the place of each row's first EOS, plus one."""
        eos = responses == self.eos_token_id
        if not eos.any(-1).all():
            raise ValueError("a response of the batch has no EOS token; was it sampled by the lengths task?")
        return eos.long().argmax(-1) + 1

    def _response_lengths(self, responses: Tensor, header: Header) -> Tensor:
        """[B] lengths read from the responses' EOS: the prompt does not announce them."""
        return self.read_lengths(responses)

    def _draw_responses(self, header: Header, generator: torch.Generator, kept: Tensor | None) -> tuple[Tensor, Tensor]:
        """Responses ending with EOS at the first stop of the row's pace, continuing `kept` when given."""
        (targets, paces), c, dev = header, self.config, generator.device
        stop = torch.rand(targets.shape[0], self.response_width, generator=generator, device=dev)
        stop = stop < self._hazards.to(dev)[paces]
        tokens = iid_tokens(targets, self.response_width, c.target_prob, self.num_ordinary, generator)
        if kept is not None:
            stop[:, : len(kept)] = False
            tokens[:, : len(kept)] = kept
        lengths = stop.long().argmax(-1) + 1  # the first stop (there is one: the hazard of the last token is 1)
        tokens[torch.arange(len(tokens), device=dev), lengths - 1] = self.eos_token_id
        return tokens, lengths

    def _rewards(self, responses: Tensor, header: Header, lengths: Tensor) -> Tensor:
        """1.0 on the EOS when the target occurs >= min_count times, else 0."""
        return count_rewards(responses, header[0], lengths, self.config.min_count)
