"""Return normalisation for the critic (`critic.value_norm`): running statistics of the returns, and PopArt.

- `off`: the model predicts returns directly.
- `running`: the model predicts `(return − μ) / σ`, where μ, σ are the mean and standard deviation of every valid
  return seen so far (all `update_critic` calls, all data-parallel ranks). `compute_values` de-normalises; the loss
  is computed in normalised space against returns normalised by the current μ, σ, and the old values clipped around
  are the outputs the model gave them with (normalised by the μ, σ that served them), so `cliprange_value` bounds how
  far the model's output moves, in units of σ. When μ, σ move, the model's de-normalised outputs move with them.
- `popart` (van Hasselt et al., 2016, "Learning values across many orders of magnitude"): as `running`, and
  whenever μ, σ change the value head's weight and bias are rescaled so that the de-normalised predictions stay
  the same: `w' = w·σ/σ'`, `b' = (σ·b + μ − μ')/σ'` (so the old values' outputs are those of the current μ, σ).
  Under `ema_decay` the average's head is rescaled alike: the map is affine in (w, b), so it commutes with averaging.
  **Unless they are far off at the start:** where the old values' mean (over the DP ranks) lies more than
  `FAR_STD` σ from the first returns' mean, the first merge keeps the outputs' deviations and moves their mean to
  μ, which can only lower their squared error: a fresh head's ~0 against Monte-Carlo returns around 11 starts at 11
  instead of spending tens of updates there. Nearer, the outputs are kept (moving them was slower on the task
  suite's dense rewards, docs/QUALITY.md).

The statistics are updated once per `update_critic` call, before its first step, from the call's valid returns;
they are sums (count, sum, sum of squares) reduced over the data-parallel ranks, merged into the running values
(Chan et al.'s parallel variance), so every rank holds the same μ, σ. With `value_norm_decay` below 1 the statistics
held are weighted by it before each merge (an exponentially weighted mean and variance), so they follow a policy
whose returns move instead of averaging over its whole history.

**No spread, no statistics.** They start at the first batch whose returns *vary*: σ of at least
`MIN_STD · max(1, |mean|)`. Until then μ = 0, σ = 1 (the identity), and a batch without spread — the all-zero first
batch of a sparse-reward run, a constant reward, a single valid token, returns equal up to the rounding of fp32 GAE
(~1e-7 relative) — is not merged: its σ of ~0 would put the old values thousands of σ away (every token clipped, the
update wasted; under PopArt a head scaled ×1e4). Once started, every batch is merged and σ never goes below
`MIN_STD`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ppo_critic.config.critic import CriticConfig
from ppo_critic.config.modes import VALUE_NORM_MODES

MIN_STD = 1e-4  # σ's floor once the statistics have started, and the spread (× max(1, |mean|)) that starts them
FAR_STD = 2.0  # PopArt's first merge moves outputs whose mean is further than this many σ from the returns'
STATE_KEYS = ("value_norm/count", "value_norm/mean", "value_norm/var")


class ValueNormalizer:
    """Running mean/variance of the returns (float64) and the maps between raw and normalised values."""

    def __init__(self, mode: str = "off", device: torch.device | str = "cpu", decay: float = 1.0):
        if mode not in VALUE_NORM_MODES:
            raise ValueError(f"value_norm={mode!r} is unknown; expected one of {VALUE_NORM_MODES}")
        self.mode, self.decay = mode, decay
        self.start_shift = torch.zeros((), dtype=torch.float64, device=device)  # PopArt's first move (raw units)
        self.count = torch.zeros((), dtype=torch.float64, device=device)
        self.mean = torch.zeros((), dtype=torch.float64, device=device)
        self.var = torch.ones((), dtype=torch.float64, device=device)

    @classmethod
    def of(cls, config: CriticConfig, device: torch.device | str) -> ValueNormalizer:
        """The normaliser a critic's config asks for (`value_norm`, `value_norm_decay`)."""
        return cls(config.value_norm, device, config.value_norm_decay)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def std(self) -> Tensor:
        return self.var.sqrt().clamp(min=MIN_STD)

    def normalise(self, x: Tensor) -> Tensor:
        """Raw values/returns → the model's output space (`x` itself when off)."""
        if not self.enabled:
            return x
        return ((x.double() - self.mean) / self.std).to(x.dtype)

    def denormalise(self, y: Tensor) -> Tensor:
        """Model outputs → raw values (`y` itself when off)."""
        if not self.enabled:
            return y
        return (self.mean + self.std * y.double()).to(y.dtype)

    def update(
        self,
        returns: Tensor,
        mask: Tensor,
        all_reduce: Callable[[Tensor], Tensor] = lambda x: x,
        head: nn.Linear | None = None,
        values: Tensor | None = None,
    ) -> bool:
        """Merge the valid `returns` (summed over ranks by `all_reduce`) into the statistics; with PopArt, rescale
        `head` so that its de-normalised outputs are unchanged (None: this rank holds no head, e.g. a pipeline
        stage before the last), at the first merge moved by `start_shift` (from a far-off old `values`' mean to μ). A
        no-op when off, when nothing is valid, and before the statistics have started when these returns do not
        vary (module docstring). Returns whether they merged (and so moved)."""
        if not self.enabled:
            return False
        valid = mask.bool()
        r = torch.where(valid, returns.double(), 0.0)
        n, total, total_sq = all_reduce(torch.stack([valid.sum().double(), r.sum(), (r * r).sum()])).unbind()
        if n.item() == 0:
            return False
        batch_mean = total / n
        batch_var = (total_sq / n - batch_mean**2).clamp(min=0.0)
        first = self.count.item() == 0
        if first and not has_spread(batch_mean, batch_var):
            return False
        before = self.snapshot()
        self._merge(n, batch_mean, batch_var)
        if self.mode == "popart":
            if first:  # kept until values are served again: values served before it were the unmoved outputs
                self.start_shift = self._first_shift(values, valid, all_reduce)
            self.carry(head, before)
        return True

    def _merge(self, n: Tensor, batch_mean: Tensor, batch_var: Tensor) -> None:
        """Chan et al.'s merge of a batch's count, mean and variance into the (decayed) ones held."""
        held = self.count * self.decay
        merged = held + n
        delta = batch_mean - self.mean
        new_var = (held * self.var + n * batch_var + delta**2 * held * n / merged) / merged
        self.count, self.mean, self.var = merged, self.mean + delta * n / merged, new_var

    def _first_shift(self, values: Tensor | None, valid: Tensor, all_reduce: Callable[[Tensor], Tensor]) -> Tensor:
        """μ minus the mean of the valid old `values` over the ranks, where it exceeds `FAR_STD` σ: how far PopArt's
        first merge moves the outputs (0 nearer, without values, or with values that are not finite)."""
        if values is None:
            return self.start_shift * 0
        v = torch.where(valid, values.double(), 0.0)
        n, total = all_reduce(torch.stack([valid.sum().double(), v.sum()])).unbind()
        shift = self.mean - total / n
        far = torch.isfinite(shift) and shift.abs() > FAR_STD * self.std
        return shift if far else shift * 0

    def carry(self, head: nn.Linear | None, before: ValueNormalizer) -> None:
        """PopArt's edit of a value `head` (None: nothing to edit) for the statistics' move from `before` to now:
        its de-normalised outputs kept, at the first merge as if they had been `start_shift` higher (so moved by it)."""
        if head is None:
            return
        moved = self.start_shift if before.count.item() == 0 else 0.0
        preserve_outputs(head, before.mean + moved, before.std, self.mean, self.std)

    def values_served(self) -> None:
        """The critic served values again: they come from the moved outputs, so old values need no `start_shift`."""
        self.start_shift = self.start_shift * 0

    def snapshot(self) -> ValueNormalizer:
        """A copy of the statistics as they are now (e.g. those that gave the old values, before an update)."""
        copy = ValueNormalizer(self.mode, self.mean.device, self.decay)
        copy.count, copy.mean, copy.var = self.count.clone(), self.mean.clone(), self.var.clone()
        return copy

    def normalise_old_values(self, values: Tensor, served: ValueNormalizer) -> Tensor:
        """Old raw `values`, given under the statistics `served`, as the outputs the model gave them with: what value
        clipping must measure the new outputs against. PopArt kept those outputs through the update (the current
        statistics map them back, once moved by PopArt's first `start_shift`); `running` did not move them, only their
        meaning, so `served` maps them back.
        (Mapped by the current statistics instead, a move of μ by more than `cliprange_value`·σ would clip every
        token: the first update of a run, whose μ jumps from 0, lost a third of its tokens' gradient that way.)"""
        if self.mode != "popart":
            return served.normalise(values)
        return self.normalise(values.double() + self.start_shift).to(values.dtype)

    def fold_into(self, head: nn.Linear) -> None:
        """Make a copy's `head` predict raw values (`w ← σ·w`, `b ← σ·b + μ`): an export needs no statistics."""
        zero, one = torch.zeros_like(self.mean), torch.ones_like(self.var)
        preserve_outputs(head, self.mean, self.std, zero, one)

    def state_dict(self) -> dict[str, Tensor]:
        """The statistics under checkpoint names (`STATE_KEYS`)."""
        return dict(zip(STATE_KEYS, (self.count, self.mean, self.var), strict=True))

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        device = self.mean.device
        self.count, self.mean, self.var = (state[k].to(device, torch.float64) for k in STATE_KEYS)


def has_spread(mean: Tensor, var: Tensor) -> bool:
    """Whether returns of this mean and variance vary beyond no signal and rounding: σ ≥ MIN_STD · max(1, |mean|)
    (float64 sums of squares lose ~1e-14 of mean², σ ~1e-7·|mean|; fp32 GAE's rounding is of the same size)."""
    return bool(var >= (MIN_STD * mean.abs().clamp(min=1.0)) ** 2)


@torch.no_grad()
def preserve_outputs(head: nn.Linear, old_mean: Tensor, old_std: Tensor, new_mean: Tensor, new_std: Tensor) -> None:
    """PopArt's output-preserving update of a `Linear(hidden, 1)`: after it, `new_mean + new_std·head(h)` equals
    `old_mean + old_std·head(h)` for every `h` (computed in float64, then stored in the parameters' dtype).

    Works in place on plain, DDP and sharded (FSDP2 DTensor, FSDP1 flat-parameter views) parameters alike:
    every operation is elementwise.
    """
    if head.out_features != 1:
        raise ValueError(
            f"value_norm: PopArt and the export's fold rescale a head of one output, this one has {head.out_features} "
            "(its objective's values are not the output); use value_norm=running, or off"
        )
    scale = (old_std / new_std).item()
    head.weight.copy_((head.weight.double() * scale).to(head.weight.dtype))
    if head.bias is None:
        if (old_mean - new_mean).abs().item() > 0:
            raise ValueError("value_norm=popart needs a value head with a bias (the mean shift goes there)")
        return
    shift = ((old_mean - new_mean) / new_std).item()
    head.bias.copy_((head.bias.double() * scale + shift).to(head.bias.dtype))
