"""The dense task's options (`task.*` of `ppo-critic train` with `task.name=dense`), torch-free so configs load
without torch. The task itself, and what the options mean for its rollouts, is `ppo_critic.tasks.dense`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppo_critic.tasks.checks import check_at_least, check_ints, check_lengths, check_probability


@dataclass
class DenseTaskConfig:
    """Sizes and stickiness of the dense task (see `ppo_critic.tasks.dense`)."""

    num_symbols: int = 6
    """symbol tokens: the prompt's fillers and liked symbol, and every response token"""
    min_prompt_len: int = 2
    """the fewest fillers a prompt starts with"""
    max_prompt_len: int = 6
    """the most fillers a prompt starts with"""
    min_response_len: int = 4
    """the shortest response (tokens)"""
    max_response_len: int = 16
    """the longest response (tokens)"""
    stay_prob: float = 0.5
    """the probability that a response token repeats the one before it (else it is drawn uniformly)"""

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field, so a bad CLI override is easy to fix."""
        check_ints(self, "num_symbols")
        check_at_least(self, "num_symbols", 2)
        check_lengths(self, "prompt", shortest=0)
        check_lengths(self, "response", shortest=1)
        check_probability(self, "stay_prob", closed_low=True)
