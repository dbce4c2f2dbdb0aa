"""Built-in rollout tasks whose true value function is known in closed form (to train and judge a critic)."""

from ppo_critic.tasks.counting import CountingTask, CountingTaskConfig

TASKS = {"counting": (CountingTask, CountingTaskConfig)}

__all__ = ["TASKS", "CountingTask", "CountingTaskConfig"]
