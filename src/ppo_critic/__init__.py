"""ppo-critic: train the value model (critic) of PPO for LLMs; a drop-in for verl's critics."""

from ppo_critic.config import CriticConfig
from ppo_critic.critics import DataParallelPPOCritic, MegatronPPOCritic
from ppo_critic.models import build_value_model

__all__ = ["CriticConfig", "DataParallelPPOCritic", "MegatronPPOCritic", "build_value_model"]
__version__ = "0.1.0"
