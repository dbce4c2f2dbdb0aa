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

import math
from typing import Any

import torch
from torch import Tensor

from ppo_critic.batch import Batch
from ppo_critic.tasks.counting_config import CountingTaskConfig


def binomial_tail_table(max_n: int, max_k: int, p: float) -> Tensor:
    """`table[n, k] = P(Binomial(n, p) >= k)` for n <= max_n, k <= max_k, exact in float64 (small n only)."""
    table = torch.zeros(max_n + 1, max_k + 1, dtype=torch.float64)
    for n in range(max_n + 1):
        pmf = [math.comb(n, j) * p**j * (1.0 - p) ** (n - j) for j in range(n + 1)]
        for k in range(min(n, max_k) + 1):
            table[n, k] = math.fsum(pmf[k:])
        table[n, 0] = 1.0
    return table


class CountingTask:
    """Samples rollout batches (DESIGN §3 layout) and computes their exact value function."""

    def __init__(self, config: CountingTaskConfig | None = None):
        self.config = config if config is not None else CountingTaskConfig()
        self.config.validate()
        c = self.config
        self.num_ordinary = c.num_targets + c.num_fillers
        self.first_length_token_id = self.num_ordinary
        self.pad_token_id = self.num_ordinary + (c.max_response_len - c.min_response_len + 1)
        self.vocab_size = self.pad_token_id + 1
        self.prompt_width = c.max_prompt_len + 2
        self.response_width = c.max_response_len
        self._tail = binomial_tail_table(c.max_response_len, c.min_count, c.target_prob)

    def length_token_id(self, lengths: Tensor) -> Tensor:
        """The dedicated token id announcing each response length."""
        return lengths - self.config.min_response_len + self.first_length_token_id

    def sample(self, batch_size: int, generator: torch.Generator) -> dict[str, Tensor]:
        """A batch of `batch_size` rollouts with rewards and true values; deterministic given the generator state."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        c, dev = self.config, generator.device
        prompt_lens = torch.randint(
            c.min_prompt_len, c.max_prompt_len + 1, (batch_size,), generator=generator, device=dev
        )
        targets = torch.randint(0, c.num_targets, (batch_size,), generator=generator, device=dev)
        lengths = torch.randint(
            c.min_response_len, c.max_response_len + 1, (batch_size,), generator=generator, device=dev
        )
        prompts, prompt_mask = self._prompts(prompt_lens, targets, lengths, generator)
        responses = self.sample_responses(targets, lengths, generator)
        response_mask = _prefix_mask(lengths, self.response_width)
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        batch = {
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": response_mask,
            "token_level_rewards": self._rewards(responses, targets, lengths),
        }
        batch["true_values"] = self.true_values(batch, gamma=1.0)
        return batch

    def sample_responses(self, targets: Tensor, lengths: Tensor, generator: torch.Generator) -> Tensor:
        """[B, R] i.i.d. response tokens (target w.p. target_prob, else another ordinary token), right-padded."""
        c, dev = self.config, generator.device
        shape = (targets.shape[0], self.response_width)
        hit = torch.rand(shape, generator=generator, device=dev) < c.target_prob
        other = torch.randint(0, self.num_ordinary - 1, shape, generator=generator, device=dev)
        other = other + (other >= targets[:, None]).long()  # skip the target id: uniform over the rest
        tokens = torch.where(hit, targets[:, None].expand(shape), other)
        return tokens.masked_fill(~_prefix_mask(lengths, self.response_width).bool(), self.pad_token_id)

    def true_values(self, batch: Any, gamma: float = 1.0) -> Tensor:
        """[B, R] float32 exact values `gamma^(L-1-t) * P(c_t + Bin(L-t, p) >= m)`, 0 at padded positions."""
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {gamma}")
        targets, lengths = self.read_prompt(batch)
        responses = Batch.from_any(batch)["responses"]
        t = torch.arange(responses.shape[1], device=responses.device)
        valid = t[None, :] < lengths[:, None]
        hits = ((responses == targets[:, None]) & valid).long()
        seen = hits.cumsum(-1) - hits  # c_t: targets among tokens 0..t-1
        remaining = (lengths[:, None] - t[None, :]).clamp(min=0)
        needed = (self.config.min_count - seen).clamp(min=0)
        prob = self._tail.to(responses.device)[remaining, needed]
        discount = torch.tensor(gamma, dtype=torch.float64, device=responses.device) ** (remaining - 1).clamp(min=0)
        return (prob * discount * valid).float()

    def read_prompt(self, batch: Any) -> tuple[Tensor, Tensor]:
        """(targets, response lengths) read from the last two prompt tokens of `input_ids` (any row order)."""
        b = Batch.from_any(batch)
        input_ids, width = b["input_ids"], b["responses"].shape[1]
        prompt_end = input_ids.shape[1] - width
        if width > self.response_width or prompt_end < 2:
            raise ValueError(
                f"batch does not have the counting task's layout: input_ids {list(input_ids.shape)}, "
                f"responses {list(b['responses'].shape)} (need R <= {self.response_width} and a prompt of >= 2 tokens)"
            )
        targets = input_ids[:, prompt_end - 2]
        lengths = input_ids[:, prompt_end - 1] - self.first_length_token_id + self.config.min_response_len
        if not ((targets >= 0) & (targets < self.config.num_targets)).all():
            raise ValueError("batch has a non-target token before the length token; was it sampled by this task?")
        if not (
            (lengths >= self.config.min_response_len) & (lengths <= min(width, self.config.max_response_len))
        ).all():
            raise ValueError("batch's last prompt token is not a valid length token; was it sampled by this task?")
        return targets, lengths

    def _prompts(
        self, prompt_lens: Tensor, targets: Tensor, lengths: Tensor, generator: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        """Left-padded prompts [B, P] (fillers, target, length token) and their attention mask."""
        batch_size, width = prompt_lens.shape[0], self.prompt_width
        fillers = torch.randint(
            self.config.num_targets,
            self.num_ordinary,
            (batch_size, width),
            generator=generator,
            device=generator.device,
        )
        fillers[:, -2] = targets
        fillers[:, -1] = self.length_token_id(lengths)
        mask = _prefix_mask(prompt_lens + 2, width).flip(-1)
        return fillers.masked_fill(~mask.bool(), self.pad_token_id), mask

    def _rewards(self, responses: Tensor, targets: Tensor, lengths: Tensor) -> Tensor:
        """[B, R] float32: 1.0 at the last response token when the target occurs >= min_count times, else 0."""
        valid = _prefix_mask(lengths, responses.shape[1]).bool()
        success = ((responses == targets[:, None]) & valid).sum(-1) >= self.config.min_count
        rewards = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
        rewards[torch.arange(responses.shape[0], device=responses.device), lengths - 1] = success.float()
        return rewards


def _prefix_mask(lengths: Tensor, width: int) -> Tensor:
    """[B, width] int64 mask with ones on the first `lengths[i]` positions of row i."""
    return (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]).long()
