"""`trainer.surprise_ratio`: react when the policy the critic values has changed. Each fresh batch is scored before
the critic trains on it (held out, so its loss is an honest one): the mean squared error of its values against its
targets. When that error exceeds `ratio` times its running mean, the weight average starts over from the live
weights (it remembers the old policy), the next `steps` updates run at `lr_scale` times the scheduled rate, and the
running mean starts over at the surprising error (the new policy's level).
"""

from __future__ import annotations

from typing import Any

MEMORY = 0.9  # the running mean's decay per iteration: about the last ten batches


class SurpriseSchedule:
    """The running mean of the fresh batches' error and the iterations left at the raised rate."""

    def __init__(self, ratio: float, steps: int, lr_scale: float):
        self.ratio, self.steps, self.lr_scale = ratio, steps, lr_scale
        self.mean: float | None = None  # the running mean of the error (None before the first batch)
        self.seen = 0  # batches scored
        self.left = 0  # updates still to run at the raised rate

    def observe(self, error: float) -> bool:
        """Score one fresh batch; True when it is a surprise (not during the first `steps` batches, the critic's
        own early fall of its error, nor while reacting to the last one)."""
        surprise = (
            self.mean is not None and self.seen >= self.steps and not self.left and error > self.ratio * self.mean
        )
        if surprise or self.mean is None:  # a surprise starts the mean over at the new error: the new regime's level
            self.mean = error
        else:
            self.mean = MEMORY * self.mean + (1 - MEMORY) * error
        self.seen += 1
        self.left = self.steps if surprise else self.left
        return surprise

    def next_lr_scale(self) -> float:
        """The factor of the next update's rate (one update of the `steps` spent)."""
        if not self.left:
            return 1.0
        self.left -= 1
        return self.lr_scale

    def state(self) -> dict[str, Any]:
        return {"surprise": {"mean": self.mean, "seen": self.seen, "left": self.left}}

    def load_state(self, state: dict[str, Any]) -> None:
        saved = state.get("surprise") or {}
        self.mean, self.seen, self.left = saved.get("mean"), int(saved.get("seen", 0)), int(saved.get("left", 0))
