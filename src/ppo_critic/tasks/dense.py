"""Dense task: a reward on every response token that is the prompt's liked symbol; the tokens form a sticky chain.

Vocabulary (ids in this order): `num_symbols` symbols; one length token per response length in
[min_response_len, max_response_len]; one pad token (the last id).

A prompt is random symbols followed by [liked symbol l, length token L]. The response is exactly L symbols: x_0 is
uniform, and each later x_k repeats x_(k-1) with probability s (`stay_prob`), else it is drawn uniformly (maybe the
same symbol again). Every response token earns r_k = 1 if x_k = l, else 0: rewards on many tokens, so the value is
a discounted series and depends on gamma in its shape, not by one factor.

The transition matrix is P = s·I + (1 - s)·U (U: every row uniform), so P^j = s^j·I + (1 - s^j)·U and
P(x_(t+j) = l | x_(t-1) = a) = 1/S + s^(j+1)·(1[a = l] - 1/S), S = num_symbols. Summed over the n = L - t tokens
from t on, with G(q, n) = Σ_(j<n) q^j = (1 - q^n) / (1 - q):

    V_0 = G(gamma, L) / S                                            (x_0 is uniform)
    V_t = G(gamma, n) / S + s·(1[x_(t-1) = l] - 1/S)·G(gamma·s, n)    for 1 <= t < L
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
    geometric_sums,
    integers,
    left_padded_prompts,
    prefix_mask,
    read_header,
    repeat_row,
    rollout_batch,
    split_layout,
)
from ppo_critic.tasks.dense_config import DenseTaskConfig


class DenseTask:
    """Samples rollout batches (DESIGN §3 layout) with a reward per liked token, and their exact values."""

    def __init__(self, config: DenseTaskConfig | None = None):
        self.config = config if config is not None else DenseTaskConfig()
        self.config.validate()
        c = self.config
        self.symbols = TokenBlock(0, 0, c.num_symbols - 1, "symbol")
        self.length_tokens = TokenBlock(self.symbols.end, c.min_response_len, c.max_response_len, "length token")
        self.pad_token_id = self.length_tokens.end
        self.vocab_size = self.pad_token_id + 1
        self.prompt_width = c.max_prompt_len + 2
        self.response_width = c.max_response_len

    def sample(self, batch_size: int, generator: torch.Generator) -> dict[str, Tensor]:
        """A batch of `batch_size` rollouts with rewards and true values; deterministic given the generator state."""
        check_batch_size(batch_size)
        c, dev = self.config, generator.device
        prompt_lens = torch.randint(
            c.min_prompt_len, c.max_prompt_len + 1, (batch_size,), generator=generator, device=dev
        )
        liked = torch.randint(0, c.num_symbols, (batch_size,), generator=generator, device=dev)
        lengths = torch.randint(
            c.min_response_len, c.max_response_len + 1, (batch_size,), generator=generator, device=dev
        )
        fillers = torch.randint(0, c.num_symbols, (batch_size, self.prompt_width), generator=generator, device=dev)
        header = torch.stack([liked, self.length_tokens.encode(lengths)], dim=1)
        prompts, prompt_mask = left_padded_prompts(fillers, prompt_lens + 2, self.pad_token_id, tail=header)
        responses = self._chain(lengths, generator)
        rewards = self._rewards(responses, liked, lengths)
        batch = rollout_batch(prompts, prompt_mask, responses, prefix_mask(lengths, self.response_width), rewards)
        batch["true_values"] = self.true_values(batch, gamma=1.0)
        return batch

    def continue_responses(self, batch: Any, row: int, t: int, n: int, generator: torch.Generator) -> dict[str, Tensor]:
        """`n` responses to `row`'s prompt keeping its tokens < t, the chain continuing from token t - 1."""
        liked, lengths = repeat_row(self.read_prompt(batch), row, n)
        check_prefix(t, int(lengths[0]))
        responses = self._chain(lengths, generator, prefix=Batch.from_any(batch)["responses"][row, :t])
        return continuation(responses, lengths, self._rewards(responses, liked, lengths))

    def true_values(self, batch: Any, gamma: float = 1.0) -> Tensor:
        """[B, R] float32 exact values (the module docstring's closed form), 0 at padded positions."""
        check_gamma(gamma)
        c = self.config
        liked, lengths = self.read_prompt(batch)
        responses = split_layout(batch, "dense", self.response_width, 2)[1]
        width = responses.shape[1]
        t = torch.arange(width, device=responses.device)
        valid = t[None, :] < lengths[:, None]
        remaining = (lengths[:, None] - t[None, :]).clamp(min=0)
        after_liked = (responses[:, :-1] == liked[:, None]).double() - 1.0 / c.num_symbols
        memory = torch.cat([torch.zeros_like(after_liked[:, :1]), after_liked], dim=1)  # 0 at t = 0: x_0 uniform
        mean_part = geometric_sums(gamma, width).to(responses.device)[remaining] / c.num_symbols
        chain_part = c.stay_prob * memory * geometric_sums(gamma * c.stay_prob, width).to(responses.device)[remaining]
        return ((mean_part + chain_part) * valid).float()

    def read_prompt(self, batch: Any) -> tuple[Tensor, Tensor]:
        """(liked symbols, response lengths) read from the last two prompt tokens of `input_ids` (any row order)."""
        return read_header(batch, "dense", self.response_width, self.symbols, self.length_tokens)

    def _chain(self, lengths: Tensor, generator: torch.Generator, prefix: Tensor | None = None) -> Tensor:
        """[B, R] right-padded responses of the sticky chain, continuing `prefix` (its first tokens) when given."""
        c, dev = self.config, generator.device
        shape = (lengths.shape[0], self.response_width)
        fresh = torch.rand(shape, generator=generator, device=dev) >= c.stay_prob
        symbols = integers(0, c.num_symbols - 1, shape, generator)
        fresh[:, 0] = True
        if prefix is not None:
            fresh[:, : len(prefix)] = True
            symbols[:, : len(prefix)] = prefix
        positions = torch.arange(shape[1], device=dev).expand(shape)
        source = torch.where(fresh, positions, 0).cummax(-1).values  # the last fresh draw at or before each token
        tokens = symbols.gather(1, source)
        return tokens.masked_fill(~prefix_mask(lengths, self.response_width).bool(), self.pad_token_id)

    def _rewards(self, responses: Tensor, liked: Tensor, lengths: Tensor) -> Tensor:
        """[B, R] float32: 1.0 on every response token that is the liked symbol."""
        valid = prefix_mask(lengths, responses.shape[1]).bool()
        return ((responses == liked[:, None]) & valid).float()
