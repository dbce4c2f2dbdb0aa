"""`vf_loss_type=bce`: a Bernoulli value for 0/1 rewards. The head's one output is a logit z, the value σ(z) (the
chance of reward 1), the per-token loss the binary cross entropy of z against the return clipped to [0, 1].

Value clipping acts on the logit: clip(z, logit(v_old) ± cliprange_value), a trust region in the Bernoulli's natural
parameter (at v = 0.5, ±0.5 is ±0.12 in probability), where the loss stays finite and its gradient alive however
sure the critic is. Returns must lie in [0, 1] (a return outside is refused before any step, not clipped in silence),
so `value_norm` must be off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ppo_critic.algos import clipped_value_loss
from ppo_critic.config.critic import CriticConfig
from ppo_critic.critics.objectives import ValueObjective

EPS = 1e-6  # old values are clamped to [EPS, 1 − EPS] before their logit: a saturated one stays finite


class Bernoulli(ValueObjective):
    """One logit per token, the value its sigmoid, binary cross entropy with logit-space clipping."""

    value_norms = ("off",)
    identity = False

    def values(self, outputs: Tensor) -> Tensor:
        return torch.sigmoid(outputs)

    def check_returns(self, returns: Tensor, response_mask: Tensor) -> None:
        """A chance lies in [0, 1]: a return outside (rewards of another scale) is named, with the fix."""
        outside = ((returns < 0) | (returns > 1)) & response_mask.bool()
        if outside.any():
            sample, token = (int(i) for i in outside.nonzero()[0])
            raise ValueError(
                f"batch['returns'] holds {returns[sample, token].item():g} at sample {sample}, response token {token}, "
                f"outside [0, 1] ({int(outside.sum())} valid position(s) are): vf_loss_type=bce models the chance of "
                "a 0/1 reward; use vf_loss_type=mse (or huber) for rewards of another scale"
            )

    def loss(self, outputs, returns, old_values, response_mask, cliprange_value, loss_agg_mode="token-mean", **norm):
        """The clipped value loss of `algos.clipped_value_loss` in logits: mean BCE when nothing is clipped."""
        old_logits = torch.logit(old_values, eps=EPS)
        return clipped_value_loss(
            _bce, outputs, returns, old_logits, response_mask, cliprange_value, loss_agg_mode, **norm
        )


def _bce(logits: Tensor, targets: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(logits, targets, reduction="none")


def build(config: CriticConfig) -> Bernoulli:
    return Bernoulli()
