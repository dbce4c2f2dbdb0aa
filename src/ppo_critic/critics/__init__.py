"""Critic backends sharing one API, `compute_values(batch)` and `update_critic(batch)` (`base`, `dp`, `megatron`),
and what an update uses: the value objective (`objectives`), return normalisation (`value_norm`), EMA weights (`ema`),
perf metrics."""

from ppo_critic.critics.dp import DataParallelPPOCritic
from ppo_critic.critics.megatron import MegatronPPOCritic

__all__ = ["DataParallelPPOCritic", "MegatronPPOCritic"]
