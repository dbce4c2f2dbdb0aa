"""The scale task's options (`task.*` of `ppo-critic train` with `task.name=scale`), torch-free so configs load
without torch. The task itself, and what the options mean for its rollouts, is `ppo_critic.tasks.scale`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppo_critic.tasks.checks import check_at_least, check_ints, check_lengths, check_numbers, require


@dataclass
class ScaleTaskConfig:
    """Sizes and the reward's scale of the scale task (see `ppo_critic.tasks.scale`)."""

    num_levels: int = 5
    """score tokens, worth evenly spaced amounts from -1 to 1"""
    num_offsets: int = 3
    """offset tokens: each prompt names one, which sets the reward's offset"""
    reward_center: float = 10.0
    """the middle of the offsets (the rewards' mean)"""
    reward_spread: float = 30.0
    """the offsets are evenly spaced from reward_center - reward_spread to reward_center + reward_spread"""
    reward_scale: float = 10.0
    """the reward adds reward_scale times the mean worth of the response's score tokens to the offset"""
    min_prompt_len: int = 2
    """the fewest random score tokens a prompt starts with"""
    max_prompt_len: int = 6
    """the most random score tokens a prompt starts with"""
    min_response_len: int = 4
    """the shortest response (tokens)"""
    max_response_len: int = 16
    """the longest response (tokens)"""

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field, so a bad CLI override is easy to fix."""
        check_ints(self, "num_levels", "num_offsets")
        check_at_least(self, "num_levels", 2)
        check_at_least(self, "num_offsets", 1)
        check_numbers(self, "reward_center", "reward_spread", "reward_scale")
        require(self, self.reward_spread >= 0, "reward_spread", f"must be >= 0, got {self.reward_spread}")
        check_lengths(self, "prompt", shortest=0)
        check_lengths(self, "response", shortest=1)
