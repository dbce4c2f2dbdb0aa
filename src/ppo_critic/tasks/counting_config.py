"""The counting task's options (`task.*` of `ppo-critic train`), torch-free so configs load without torch.

The task itself, and what the options mean for its rollouts, is `ppo_critic.tasks.counting`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class CountingTaskConfig:
    """Sizes and probabilities of the counting task (see `ppo_critic.tasks.counting`)."""

    num_targets: int = 4
    """target tokens: each prompt names one of them"""
    num_fillers: int = 8
    """filler tokens: the random start of a prompt, and with the other targets the non-target response tokens"""
    min_prompt_len: int = 2
    """the fewest fillers a prompt starts with"""
    max_prompt_len: int = 6
    """the most fillers a prompt starts with"""
    min_response_len: int = 4
    """the shortest response (tokens)"""
    max_response_len: int = 16
    """the longest response (tokens)"""
    target_prob: float = 0.25
    """the probability that a response token is the prompt's target"""
    min_count: int = 2
    """reward 1 when the response holds the target at least this often, else 0"""

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field, so a bad CLI override is easy to fix."""
        for name in ("num_targets", "num_fillers", "min_prompt_len", "max_prompt_len", "min_response_len"):
            _check_int(name, getattr(self, name))
        _check_int("max_response_len", self.max_response_len)
        _check_int("min_count", self.min_count)
        _require(self.num_targets >= 1, "num_targets", f"must be >= 1, got {self.num_targets}")
        _require(self.num_fillers >= 1, "num_fillers", f"must be >= 1 (prompt fillers), got {self.num_fillers}")
        _require(self.min_prompt_len >= 0, "min_prompt_len", f"must be >= 0, got {self.min_prompt_len}")
        _require(
            self.max_prompt_len >= self.min_prompt_len,
            "max_prompt_len",
            f"({self.max_prompt_len}) must be >= min_prompt_len ({self.min_prompt_len})",
        )
        _require(self.min_response_len >= 1, "min_response_len", f"must be >= 1, got {self.min_response_len}")
        _require(
            self.min_response_len <= self.max_response_len,
            "min_response_len",
            f"({self.min_response_len}) must be <= max_response_len ({self.max_response_len})",
        )
        p = self.target_prob
        ok = isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 < p < 1.0
        _require(ok, "target_prob", f"must be a probability strictly between 0 and 1, got {p!r}")
        _require(
            1 <= self.min_count <= self.max_response_len,
            "min_count",
            f"must be in [1, max_response_len={self.max_response_len}], got {self.min_count}",
        )


def _check_int(name: str, value: Any) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool), name, f"must be an int, got {value!r}")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"CountingTaskConfig.{name} {message}")
