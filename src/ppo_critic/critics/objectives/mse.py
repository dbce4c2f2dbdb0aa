"""`vf_loss_type=mse`: the value is the head's one output, the loss verl's clipped squared error."""

from __future__ import annotations

from dataclasses import dataclass

from ppo_critic.algos import compute_value_loss
from ppo_critic.config.critic import CriticConfig
from ppo_critic.critics.objectives import ValueObjective


@dataclass(frozen=True)
class SquaredError(ValueObjective):
    """`algos.compute_value_loss` of `loss_type` (mse or huber, with `huber_delta`) on the head's one output."""

    loss_type: str = "mse"
    huber_delta: float = 1.0

    def loss(self, outputs, returns, old_values, response_mask, cliprange_value, loss_agg_mode="token-mean", **norm):
        """The clipped PPO value loss of DESIGN §3 and its clipped fraction."""
        return compute_value_loss(
            outputs,
            returns,
            old_values,
            response_mask,
            cliprange_value,
            loss_agg_mode,
            loss_type=self.loss_type,
            huber_delta=self.huber_delta,
            **norm,
        )


def build(config: CriticConfig) -> SquaredError:
    return SquaredError("mse")
