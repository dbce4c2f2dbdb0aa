"""The long task's options (`task.*` of `ppo-critic train` with `task.name=long`), torch-free so configs load
without torch. The task itself, and what the options mean for its rollouts, is `ppo_critic.tasks.long`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppo_critic.tasks.checks import check_lengths, check_probabilities, require

MAX_LONG_RESPONSE = 1000  # binomial_tail_table's float64 products overflow past n ~ 1030


@dataclass
class LongTaskConfig:
    """Drifts and lengths of the long task (see `ppo_critic.tasks.long`)."""

    up_probs: tuple[float, ...] = (0.45, 0.5, 0.55)
    """the probability of an up step, one per drift token a prompt may name"""
    min_prompt_len: int = 2
    """the fewest random steps a prompt starts with"""
    max_prompt_len: int = 6
    """the most random steps a prompt starts with"""
    min_response_len: int = 256
    """the shortest response (tokens)"""
    max_response_len: int = 288
    """the longest response (tokens; at most 1000)"""

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field, so a bad CLI override is easy to fix."""
        check_probabilities(self, "up_probs")
        check_lengths(self, "prompt", shortest=0)
        check_lengths(self, "response", shortest=1)
        high = self.max_response_len
        require(self, high <= MAX_LONG_RESPONSE, "max_response_len", f"must be <= {MAX_LONG_RESPONSE}, got {high}")
