"""Dense task: a reward on every response token that is the prompt's liked symbol; the tokens form a sticky chain.

Vocabulary (ids in this order): `num_symbols` symbols; one length token per response length in
[min_response_len, max_response_len]; one pad token (the last id).

A prompt is random symbols followed by [liked symbol l, length token L]. The response is exactly L symbols: x_0 is
drawn afresh, and each later x_k repeats x_(k-1) with probability s (`stay_prob`), else it is drawn afresh (maybe the
same symbol again). A fresh draw is the liked symbol with probability π (`liked_prob`; by default 1/S, S =
num_symbols: uniform), else one of the others uniformly. Every response token earns r_k = 1 if x_k = l, else 0:
rewards on many tokens, so the value is a discounted series and depends on gamma in its shape, not by one factor.

The transition matrix is P = s·I + (1 - s)·F (F: every row the fresh draw's law), so P^j = s^j·I + (1 - s^j)·F and
P(x_(t+j) = l | x_(t-1) = a) = π + s^(j+1)·(1[a = l] - π). Summed over the n = L - t tokens from t on, with
G(q, n) = Σ_(j<n) q^j = (1 - q^n) / (1 - q):

    V_0 = G(gamma, L)·π                                              (x_0 is a fresh draw)
    V_t = G(gamma, n)·π + s·(1[x_(t-1) = l] - π)·G(gamma·s, n)        for 1 <= t < L
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ppo_critic.config.tasks import DenseTaskConfig
from ppo_critic.tasks.common import (
    BuiltinTask,
    Header,
    TokenBlock,
    geometric_sums,
    iid_tokens,
    integers,
    prefix_mask,
    tokens_left,
    validated,
)


class DenseTask(BuiltinTask):
    """Samples rollout batches (DESIGN §3 layout) with a reward per liked token, and their exact values."""

    name = "dense"

    def __init__(self, config: DenseTaskConfig | None = None):
        self.config = c = validated(config, DenseTaskConfig)
        self.symbols = self.fillers = TokenBlock(0, 0, c.num_symbols - 1, "symbol")
        self.length_tokens = TokenBlock(self.symbols.end, c.min_response_len, c.max_response_len, "length token")
        self.header_tokens = (self.symbols, self.length_tokens)
        self.pad_token_id = self.length_tokens.end
        self.prompt_width = c.max_prompt_len + 2
        self.liked_prob = c.drift_origin()  # π: 1/num_symbols unless liked_prob is set

    def true_values(self, batch: Any, gamma: float = 1.0) -> Tensor:
        """[B, R] float32 exact values (the module docstring's closed form), 0 at padded positions."""
        c = self.config
        (liked, lengths), responses, _ = self._read_batch(batch, gamma)
        width = responses.shape[1]
        remaining = tokens_left(lengths, width)
        after_liked = (responses[:, :-1] == liked[:, None]).double() - self.liked_prob
        memory = torch.cat([torch.zeros_like(after_liked[:, :1]), after_liked], dim=1)  # 0 at t = 0: x_0 a fresh draw
        mean_part = self._liked_share(geometric_sums(gamma, width).to(responses.device)[remaining])
        chain_part = c.stay_prob * memory * geometric_sums(gamma * c.stay_prob, width).to(responses.device)[remaining]
        return ((mean_part + chain_part) * (remaining > 0)).float()

    def _draw_responses(self, header: Header, generator: torch.Generator, kept: Tensor | None) -> tuple[Tensor, Tensor]:
        """The sticky chain, continuing `kept` (its first tokens) when given."""
        c, dev = self.config, generator.device
        shape = (header[1].shape[0], self.response_width)
        fresh = torch.rand(shape, generator=generator, device=dev) >= c.stay_prob
        symbols = self._fresh_symbols(header[0], shape, generator)
        fresh[:, 0] = True
        if kept is not None:
            fresh[:, : len(kept)] = True
            symbols[:, : len(kept)] = kept
        positions = torch.arange(shape[1], device=dev).expand(shape)
        source = torch.where(fresh, positions, 0).cummax(-1).values  # the last fresh draw at or before each token
        return symbols.gather(1, source), header[1]

    def _liked_share(self, sums: Tensor) -> Tensor:
        """`sums` · π: divided by num_symbols when liked_prob is null (as before it existed, to the last bit)."""
        c = self.config
        return sums / c.num_symbols if c.liked_prob is None else sums * c.liked_prob

    def _fresh_symbols(self, liked: Tensor, shape: tuple[int, int], generator: torch.Generator) -> Tensor:
        """[B, R] fresh draws: uniform symbols, or the liked one with probability liked_prob when it is set."""
        c = self.config
        if c.liked_prob is None:
            return integers(0, c.num_symbols - 1, shape, generator)
        return iid_tokens(liked, shape[1], c.liked_prob, c.num_symbols, generator)

    def _rewards(self, responses: Tensor, header: Header, lengths: Tensor) -> Tensor:
        """1.0 on every response token that is the liked symbol."""
        valid = prefix_mask(lengths, responses.shape[1]).bool()
        return ((responses == header[0][:, None]) & valid).float()
