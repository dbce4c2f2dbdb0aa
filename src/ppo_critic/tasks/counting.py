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

import torch
from torch import Tensor

from ppo_critic.config.tasks import CountingTaskConfig
from ppo_critic.tasks.common import CountTask, TokenBlock, validated


class CountingTask(CountTask):
    """Samples rollout batches (DESIGN §3 layout) and computes their exact value function."""

    name = "counting"

    def __init__(self, config: CountingTaskConfig | None = None):
        c = validated(config, CountingTaskConfig)
        self.num_ordinary = c.num_targets + c.num_fillers
        super().__init__(c, hit_prob=c.target_prob, num_tokens=self.num_ordinary)
        self.target_tokens = TokenBlock(0, 0, c.num_targets - 1, "target token")
        self.fillers = TokenBlock(c.num_targets, 0, c.num_fillers - 1, "filler")
        self.length_tokens = TokenBlock(self.num_ordinary, c.min_response_len, c.max_response_len, "length token")
        self.header_tokens = (self.target_tokens, self.length_tokens)
        self.pad_token_id = self.length_tokens.end
        self.prompt_width = c.max_prompt_len + 2

    def sample_responses(self, targets: Tensor, lengths: Tensor, generator: torch.Generator) -> Tensor:
        """[B, R] i.i.d. response tokens (target w.p. target_prob, else another ordinary token), right-padded."""
        return self._responses((targets, lengths), generator)[0]
