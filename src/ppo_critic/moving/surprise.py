"""`trainer.surprise_z`: react when the policy the critic values has changed. Each fresh batch is scored before the
critic trains on it (held out, so honestly): the mean over its rows of their mean residual (targets − values). When
that mean jumps more than `z` standard errors (the rows' spread over √rows, or the running mean of those where
larger) from its running mean, the weight average starts over from the live weights (it remembers the old policy)
and the next `steps` updates run at `lr_scale` times the scheduled rate (under `trainer.surprise_mc_targets` also on
Monte-Carlo returns, not ones bootstrapped from the old policy's values). Until the reaction ends the running mean
follows the residual as the critic learns the new policy, so the next surprise is a jump from where it got to.

Why the residual's mean and not the loss: on 0/1 rewards the squared error is mostly the returns' own noise, so a
change of the values moves it little (recall's step raised it less than 2×, within its batch-to-batch spread),
while a shift of the values shows in the residual's mean many standard errors wide.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ppo_critic.algos import masked_mean

MEMORY = 0.9  # the running mean's decay per iteration: about the last ten batches


def row_residuals(targets: Tensor, values: Tensor, mask: Tensor) -> tuple[float, float]:
    """(mean, standard error) over the rows of each row's mean residual `targets − values` on its valid tokens."""
    rows = masked_mean(targets - values, mask, axis=-1)
    spread = rows.std().item() if len(rows) > 1 else 0.0
    return rows.mean().item(), spread / len(rows) ** 0.5


class SurpriseSchedule:
    """The running mean of the fresh batches' residual and the updates left at the raised rate."""

    def __init__(self, z: float, steps: int, lr_scale: float):
        self.z, self.steps, self.lr_scale = z, steps, lr_scale
        self.mean: float | None = None  # the running mean of the residual (None before the first batch)
        self.error: float | None = None  # the running mean of the batches' standard errors
        self.seen = 0  # batches scored
        self.left = 0  # updates still to run at the raised rate

    def score(self, residual: float, standard_error: float) -> float:
        """How many standard errors `residual` lies from the running mean (0 before the first batch): the batch's
        own, or the running mean of them where that is larger (a batch whose rows happen to agree, e.g. all without
        reward, does not make a small move look large)."""
        if self.mean is None:
            return 0.0
        error = max(standard_error, self.error or 0.0, torch.finfo(torch.float32).tiny)
        return abs(residual - self.mean) / error

    def observe(self, residual: float, standard_error: float) -> bool:
        """Score one fresh batch; True when it is a surprise (not during the first `steps` batches, the critic's
        own early learning, nor while reacting to the last one)."""
        surprise = self.seen >= self.steps and not self.left and self.score(residual, standard_error) > self.z
        if surprise or self.left or self.mean is None:  # from a surprise to the end of the reaction the mean follows
            self.mean = residual  # the residual: the new policy's level, moving as the critic learns it
        else:
            self.mean = MEMORY * self.mean + (1 - MEMORY) * residual
        self.error = standard_error if self.error is None else MEMORY * self.error + (1 - MEMORY) * standard_error
        self.seen += 1
        self.left = self.steps if surprise else self.left
        return surprise

    def reacting(self) -> bool:
        """Whether the next update is one of the `steps` after a surprise (it spends one of them)."""
        if not self.left:
            return False
        self.left -= 1
        return True

    def state(self) -> dict[str, Any]:
        return {"surprise": {"mean": self.mean, "error": self.error, "seen": self.seen, "left": self.left}}

    def load_state(self, state: dict[str, Any]) -> None:
        saved = state.get("surprise") or {}
        self.mean, self.error = saved.get("mean"), saved.get("error")
        self.seen, self.left = int(saved.get("seen", 0)), int(saved.get("left", 0))
