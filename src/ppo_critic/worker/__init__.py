"""`CriticWorker` (`critic_worker`): the critic with what a trainer needs around it, on a data-parallel
(`data_parallel`) or a megatron-core (`megatron`) backend; what both build alike (`build`)."""

from ppo_critic.worker.build import lr_schedule, model_from_config, worker_config
from ppo_critic.worker.critic_worker import CriticWorker

__all__ = ["CriticWorker", "lr_schedule", "model_from_config", "worker_config"]
