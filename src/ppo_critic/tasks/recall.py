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

from ppo_critic.config.tasks import RecallTaskConfig
from ppo_critic.data.batch import Batch
from ppo_critic.tasks.common import (
    CountTask,
    Header,
    TokenBlock,
    integers,
    left_padded_prompts,
    split_layout,
    validated,
)


class RecallTask(CountTask):
    """Samples rollout batches (DESIGN §3 layout) whose reward depends on a far prompt token, and their values."""

    name = "recall"

    def __init__(self, config: RecallTaskConfig | None = None):
        c = validated(config, RecallTaskConfig)
        super().__init__(c, hit_prob=c.key_prob, num_tokens=c.num_symbols)
        self.symbols = TokenBlock(0, 0, c.num_symbols - 1, "symbol")
        self.keys = TokenBlock(self.symbols.end, 0, c.num_symbols - 1, "key token")
        self.fillers = TokenBlock(self.keys.end, 0, c.num_fillers - 1, "filler")
        self.marker = TokenBlock(self.fillers.end, 0, 0, "marker token")
        self.length_tokens = TokenBlock(self.marker.end, c.min_response_len, c.max_response_len, "length token")
        self.pad_token_id = self.length_tokens.end
        self.prompt_width = c.max_distractors + 3

    def read_prompt(self, batch: Any) -> Header:
        """(keys, response lengths): the token after each prompt's first (the marker), and its last token."""
        input_ids, responses, prompt_end = split_layout(batch, self.name, self.response_width, 3)
        first = Batch.from_any(batch)["attention_mask"][:, :prompt_end].argmax(-1)  # the first valid prompt token
        self.marker.decode(input_ids.gather(1, first[:, None]), "first prompt token")
        keys = self.keys.decode(input_ids.gather(1, (first + 1).clamp(max=prompt_end - 1)[:, None])[:, 0], "key")
        lengths = self.length_tokens.decode(input_ids[:, prompt_end - 1], "last prompt token", responses.shape[1])
        return keys, lengths

    def _draw_prompts(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Header]:
        """[marker, key token, random fillers, length token], left-padded."""
        c, rows = self.config, (batch_size,)
        distractors = integers(c.min_distractors, c.max_distractors, rows, generator)
        keys, lengths = self.keys.draw(rows, generator), self.length_tokens.draw(rows, generator)
        fillers = self.fillers.draw_ids((batch_size, self.prompt_width), generator)
        head = torch.stack([torch.full_like(keys, self.marker.first_id), self.keys.encode(keys)], dim=1)
        tail = self.length_tokens.encode(lengths)[:, None]
        prompts, prompt_mask = left_padded_prompts(fillers, distractors + 3, self.pad_token_id, head=head, tail=tail)
        return prompts, prompt_mask, (keys, lengths)
