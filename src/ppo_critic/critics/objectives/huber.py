"""`vf_loss_type=huber`: the clipped squared error within `huber_delta` of the return, linear beyond."""

from __future__ import annotations

from ppo_critic.config.critic import CriticConfig
from ppo_critic.critics.objectives.mse import SquaredError


def build(config: CriticConfig) -> SquaredError:
    return SquaredError("huber", config.huber_delta)
