"""Critic backends sharing one API: `compute_values(batch)` and `update_critic(batch)`."""

from ppo_critic.critics.dp import DataParallelPPOCritic
from ppo_critic.critics.megatron import MegatronPPOCritic

__all__ = ["DataParallelPPOCritic", "MegatronPPOCritic"]
