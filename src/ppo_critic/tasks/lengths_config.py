"""The lengths task's options (`task.*` of `ppo-critic train` with `task.name=lengths`), torch-free so configs
load without torch. The task itself, and what the options mean for its rollouts, is `ppo_critic.tasks.lengths`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppo_critic.tasks.checks import (
    check_at_least,
    check_ints,
    check_lengths,
    check_min_count,
    check_probabilities,
    check_probability,
)


@dataclass
class LengthsTaskConfig:
    """Sizes and probabilities of the lengths task (see `ppo_critic.tasks.lengths`)."""

    num_targets: int = 4
    """target tokens: each prompt names one of them"""
    num_fillers: int = 8
    """filler tokens: the random start of a prompt, and with the other targets the non-target response tokens"""
    min_prompt_len: int = 2
    """the fewest fillers a prompt starts with"""
    max_prompt_len: int = 6
    """the most fillers a prompt starts with"""
    min_response_len: int = 8
    """the shortest response (tokens, its closing EOS included): no EOS comes earlier"""
    max_response_len: int = 96
    """the longest response: if no EOS came earlier, its last token is EOS"""
    stop_probs: tuple[float, ...] = (0.2, 0.03)
    """the probability that a response token (the min_response_len-th or a later one) is EOS, one per pace token a
    prompt may name"""
    target_prob: float = 0.15
    """the probability that a response token other than EOS is the prompt's target"""
    min_count: int = 4
    """reward 1 on the EOS when the response holds the target at least this often, else 0"""

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field, so a bad CLI override is easy to fix."""
        check_ints(self, "num_targets", "num_fillers")
        check_at_least(self, "num_targets", 1)
        check_at_least(self, "num_fillers", 1, why="prompt fillers")
        check_lengths(self, "prompt", shortest=0)
        check_lengths(self, "response", shortest=1)
        check_probabilities(self, "stop_probs")
        check_probability(self, "target_prob")
        check_min_count(self)
