"""`critic.ema_decay`: an exponential moving average (Polyak average) of the critic's trainable parameters.

`update_critic` trains the live parameters and, after every optimizer step it takes, moves the average toward
them: `avg ← decay·avg + (1 − decay)·param`. `compute_values` (and so the returns a trainer bootstraps from, the
old values of the clipped loss and the HF export) uses the average: a critic whose outputs do not carry the noise
of the last few steps. The average is kept per local shard (plain, DDP or FSDP2 DTensor parameters), so it costs
one copy of the trainable parameters and no communication. Under `critic.param_dtype` it is a float32 average of the
float32 master weights (a bf16 average could not move by less than bf16's resolution), and swaps with them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor, nn


def _local(t: Tensor) -> Tensor:
    """The tensor a rank holds: a DTensor's local shard (an alias, so in-place edits reach the parameter)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class ParameterEMA:
    """The moving average of `module`'s trainable parameters (named as in `module.named_parameters()`)."""

    def __init__(
        self, module: nn.Module, decay: float, warmup: bool = False, masters: Mapping[Tensor, Tensor] | None = None
    ):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"critic.ema_decay={decay!r} must be in (0, 1) (0 turns the average off)")
        self.decay, self.warmup = decay, warmup
        self.updates = torch.zeros((), dtype=torch.int64)  # updates so far (checkpointed under warmup)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        masters = masters or {}  # parameter -> its float32 master copy (`critic.param_dtype`): the live weight
        self.params = [masters.get(p, p) for _, p in named]
        self.rounded = [p for _, p in named if p in masters]  # set from their masters after each swap
        self.masters = [masters[p] for p in self.rounded]
        with torch.no_grad():
            self.average = [p.detach().clone() for p in self.params]  # DTensors stay DTensors (for checkpoints)

    def current_decay(self) -> float:
        """The decay of the next update: `decay`, or under warmup min(decay, (1 + k) / (10 + k)) after k updates."""
        k = int(self.updates)
        return min(self.decay, (1 + k) / (10 + k)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self) -> None:
        """One step of the average toward the live parameters."""
        average, live = self._locals()
        torch._foreach_lerp_(average, live, 1.0 - self.current_decay())
        self.updates += 1

    @torch.no_grad()
    def restart(self) -> None:
        """Start the average over from the live parameters (and, under warmup, its short early memory): what a
        critic does when the policy it values has changed and the average would remember the old one."""
        average, live = self._locals()
        torch._foreach_copy_(average, live)
        self.updates.zero_()

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the live parameters and the average in place (twice restores both, bit for bit)."""
        average, live = self._locals()
        held = [t.clone() for t in live]
        torch._foreach_copy_(live, average)
        torch._foreach_copy_(average, held)
        if self.rounded:  # low-precision parameters: their masters rounded
            torch._foreach_copy_(self.rounded, self.masters)

    def _locals(self) -> tuple[list[Tensor], list[Tensor]]:
        """The average's and the live parameters' local tensors, for multi-tensor (one kernel per group) updates."""
        return [_local(a) for a in self.average], [_local(p.detach()) for p in self.params]

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The average in place of the live parameters inside the context."""
        self.swap()
        try:
            yield
        finally:
            self.swap()

    def state_dict(self) -> dict[str, Tensor]:
        """The average by parameter name, for checkpoints (the tensors themselves: a load fills them in place), and
        under warmup the count of updates that sets its decay."""
        counter = {"ema/_updates": self.updates} if self.warmup else {}
        return {**{f"ema/{n}": avg for n, avg in zip(self.names, self.average, strict=True)}, **counter}
