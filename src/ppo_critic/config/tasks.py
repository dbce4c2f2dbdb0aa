"""The built-in tasks' options (`task.*` of `ppo-critic train`, chosen by `task.name`), torch-free so configs load
and `--help` runs without torch. What each option means for its task's rollouts is in `ppo_critic.tasks.<name>`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from ppo_critic.config.task_checks import (
    check_at_least,
    check_drift,
    check_ints,
    check_lengths,
    check_min_count,
    check_numbers,
    check_order,
    check_probabilities,
    check_probability,
    require,
)

MAX_LONG_RESPONSE = 1000  # binomial_tail_table's float64 products overflow past n ~ 1030


@dataclass
class DriftOptions:
    """The policy schedule every built-in task takes (`task.drift*`): one parameter of its generative process
    (`drift_field`) moves over the iterations, as an actor that PPO trains moves; the truth stays exact at each."""

    drift_field: ClassVar[str]  # the task's option that drifts; `drift_to` is its value at the end of the drift

    drift: str = "none"
    """how the rollout policy moves over the iterations: none (fixed), ramp (the option drift_to names moves linearly
    from its configured value to drift_to over drift_steps iterations from drift_start), step (it jumps to drift_to at
    iteration drift_start)"""
    drift_start: int = 100
    """the first iteration (counted from 0) whose rollouts come from a moved policy (drift=ramp or step)"""
    drift_steps: int = 300
    """the iterations a ramp takes to reach drift_to (drift=ramp)"""
    drift_to: Any = None
    """the drifting option's value at the end of the drift (each task says which option)"""

    def drift_weight(self, step: int) -> float:
        """How far the policy of iteration `step` has moved toward `drift_to`: 0 (the configured one) .. 1."""
        if self.drift == "none" or step < self.drift_start:
            return 0.0
        if self.drift == "step":
            return 1.0
        return min(1.0, (step - self.drift_start + 1) / self.drift_steps)

    def drift_origin(self) -> Any:
        """The drifting option's configured value (where a drift starts)."""
        return getattr(self, self.drift_field)

    def at(self, step: int) -> Any:
        """These options with the drifting one at its value of iteration `step` and no drift: the fixed task that
        draws that iteration's rollouts (the same object while the policy has not moved)."""
        weight = self.drift_weight(step)
        if weight == 0.0:
            return self
        value = interpolate(self.drift_origin(), self.drift_to, weight)
        return replace(self, drift="none", **{self.drift_field: value})

    def check_drift_end(self) -> None:
        """`drift_to` is a valid value of the drifting option: the options at the drift's end validate."""
        if self.drift == "none":
            return
        try:
            replace(self, drift="none", **{self.drift_field: self.drift_to}).validate()
        except ValueError as error:
            message = str(error).removeprefix(f"{type(self).__name__}.{self.drift_field} ")
            raise ValueError(
                f"{type(self).__name__}.drift_to is {self.drift_field} at the drift's end: {message}"
            ) from None


def interpolate(start: Any, end: Any, weight: float) -> Any:
    """`start + weight * (end - start)`, elementwise for tuples; exactly `end` at weight 1."""
    if weight == 1.0:
        return end
    if isinstance(start, tuple):
        return tuple(a + weight * (b - a) for a, b in zip(start, end, strict=True))
    return start + weight * (end - start)


@dataclass
class CountingTaskConfig(DriftOptions):
    """Sizes and probabilities of the counting task (see `ppo_critic.tasks.counting`)."""

    drift_field: ClassVar[str] = "target_prob"

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
    drift_to: float = 0.5
    """target_prob at the end of a drift (task.drift): the policy emitting the target more, as an actor learns to"""

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
        check_drift(self)


@dataclass
class DenseTaskConfig(DriftOptions):
    """Sizes and stickiness of the dense task (see `ppo_critic.tasks.dense`)."""

    drift_field: ClassVar[str] = "liked_prob"

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
    """the probability that a response token repeats the one before it (else it is drawn afresh)"""
    liked_prob: float | None = None
    """the probability that a fresh draw (the first response token, and each that does not repeat the one before)
    is the liked symbol, else one of the others uniformly; null: 1/num_symbols, every symbol alike"""
    drift_to: float = 0.5
    """liked_prob at the end of a drift (task.drift; it starts from 1/num_symbols when liked_prob is null): the policy
    emitting the rewarded symbol more, as an actor learns to"""

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field, so a bad CLI override is easy to fix."""
        check_ints(self, "num_symbols")
        check_at_least(self, "num_symbols", 2)
        check_lengths(self, "prompt", shortest=0)
        check_lengths(self, "response", shortest=1)
        check_probability(self, "stay_prob", closed_low=True)
        if self.liked_prob is not None:
            check_probability(self, "liked_prob")
        check_drift(self)

    def drift_origin(self) -> float:
        """liked_prob, or 1/num_symbols when it is null (where a drift starts)."""
        return 1.0 / self.num_symbols if self.liked_prob is None else self.liked_prob


@dataclass
class LongTaskConfig(DriftOptions):
    """Drifts and lengths of the long task (see `ppo_critic.tasks.long`)."""

    drift_field: ClassVar[str] = "up_probs"

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
    drift_to: tuple[float, ...] = (0.55, 0.6, 0.65)
    """up_probs at the end of a drift (task.drift; one per drift token): the policy winning the vote more often"""

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field, so a bad CLI override is easy to fix."""
        check_probabilities(self, "up_probs")
        check_lengths(self, "prompt", shortest=0)
        check_lengths(self, "response", shortest=1)
        high = self.max_response_len
        require(self, high <= MAX_LONG_RESPONSE, "max_response_len", f"must be <= {MAX_LONG_RESPONSE}, got {high}")
        check_drift(self)


@dataclass
class RecallTaskConfig(DriftOptions):
    """Sizes and probabilities of the recall task (see `ppo_critic.tasks.recall`)."""

    drift_field: ClassVar[str] = "key_prob"

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
    drift_to: float = 0.5
    """key_prob at the end of a drift (task.drift): the policy emitting the key more, as an actor learns to"""

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
        check_drift(self)


@dataclass
class LengthsTaskConfig(DriftOptions):
    """Sizes and probabilities of the lengths task (see `ppo_critic.tasks.lengths`)."""

    drift_field: ClassVar[str] = "stop_probs"

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
    drift_to: tuple[float, ...] = (0.1, 0.015)
    """stop_probs at the end of a drift (task.drift; one per pace token): responses growing longer, as they often do
    while an actor trains"""

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
        check_drift(self)


@dataclass
class ScaleTaskConfig(DriftOptions):
    """Sizes and the reward's scale of the scale task (see `ppo_critic.tasks.scale`)."""

    drift_field: ClassVar[str] = "reward_scale"

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
    drift_to: float = 30.0
    """reward_scale at the end of a drift (task.drift): the rewards' spread within a prompt growing 3×"""

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field, so a bad CLI override is easy to fix."""
        check_ints(self, "num_levels", "num_offsets")
        check_at_least(self, "num_levels", 2)
        check_at_least(self, "num_offsets", 1)
        check_numbers(self, "reward_center", "reward_spread", "reward_scale")
        require(self, self.reward_spread >= 0, "reward_spread", f"must be >= 0, got {self.reward_spread}")
        check_lengths(self, "prompt", shortest=0)
        check_lengths(self, "response", shortest=1)
        check_drift(self)


TASK_CONFIGS = {
    "counting": CountingTaskConfig,
    "dense": DenseTaskConfig,
    "long": LongTaskConfig,
    "recall": RecallTaskConfig,
    "lengths": LengthsTaskConfig,
    "scale": ScaleTaskConfig,
}
