"""The recall task's options (`task.*` of `ppo-critic train` with `task.name=recall`), torch-free so configs load
without torch. The task itself, and what the options mean for its rollouts, is `ppo_critic.tasks.recall`.
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
class RecallTaskConfig:
    """Sizes and probabilities of the recall task (see `ppo_critic.tasks.recall`)."""

    num_symbols: int = 4
    """symbols: every response token; the key token names one of them"""
    num_fillers: int = 8
    """filler tokens: the distractors between the key and the length token"""
    min_distractors: int = 32
    """the fewest random fillers between the key (the prompt's second token) and the length token ending it"""
    max_distractors: int = 40
    """the most random fillers between the key and the length token"""
    min_response_len: int = 4
    """the shortest response (tokens)"""
    max_response_len: int = 12
    """the longest response (tokens)"""
    key_prob: float = 0.25
    """the probability that a response token is the key (1/num_symbols: the response alone does not reveal it)"""
    min_count: int = 2
    """reward 1 when the response holds the key at least this often, else 0"""

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field, so a bad CLI override is easy to fix."""
        check_ints(self, "num_symbols", "num_fillers", "min_distractors", "max_distractors")
        check_at_least(self, "num_symbols", 2)
        check_at_least(self, "num_fillers", 1)
        check_at_least(self, "min_distractors", 0)
        check_order(self, "min_distractors", "max_distractors", blame="max_distractors")
        check_lengths(self, "response", shortest=1)
        check_probability(self, "key_prob")
        check_min_count(self)
