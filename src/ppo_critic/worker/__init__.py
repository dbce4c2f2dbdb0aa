"""`CriticWorker` (`critic_worker`): the critic with what a trainer needs around it, on the backend its config's
`strategy` picks (`ppo_critic.backends`); the build helpers both backends share are re-exported."""

from ppo_critic.backends.build import lr_schedule, model_from_config, worker_config
from ppo_critic.worker.critic_worker import CriticWorker

__all__ = ["CriticWorker", "lr_schedule", "model_from_config", "worker_config"]
