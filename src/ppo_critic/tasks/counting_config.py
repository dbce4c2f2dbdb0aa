"""The counting task's options (`task.*` of `ppo-critic train`), torch-free so configs load without torch.

The task itself, and what the options mean for its rollouts, is `ppo_critic.tasks.counting`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppo_critic.tasks.checks import (
    check_at_least,
    check_ints,
    check_lengths,
    check_min_count,
    check_order,
    check_probability,
)


@dataclass
class CountingTaskConfig:
    """Sizes and probabilities of the counting task (see `ppo_critic.tasks.counting`)."""

    num_targets: int = 2
    """target tokens: each prompt names one of them"""
    num_fillers: int = 8
    """filler tokens: the random start of a prompt, and with the other targets the non-target response tokens"""
    min_prompt_len: int = 2
    """the fewest fillers a prompt starts with"""
    max_prompt_len: int = 6
    """the most fillers a prompt starts with"""
    min_response_len: int = 4
    """the shortest response (tokens)"""
    max_response_len: int = 12
    """the longest response (tokens)"""
    target_prob: float = 0.25
    """the probability that a response token is the prompt's target"""
    min_count: int = 2
    """reward 1 when the response holds the target at least this often, else 0"""

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field, so a bad CLI override is easy to fix."""
        check_ints(self, "num_targets", "num_fillers", "min_response_len", "max_response_len")
        check_at_least(self, "num_targets", 1)
        check_at_least(self, "num_fillers", 1, why="prompt fillers")
        check_lengths(self, "prompt", shortest=0)
        check_at_least(self, "min_response_len", 1)
        check_order(self, "min_response_len", "max_response_len", blame="min_response_len")
        check_probability(self, "target_prob")
        check_min_count(self)
