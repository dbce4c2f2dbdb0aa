"""Critic backends sharing one API: `compute_values(batch)` and `update_critic(batch)`."""

from ppo_critic.critics.dp import DataParallelPPOCritic

__all__ = ["DataParallelPPOCritic"]
