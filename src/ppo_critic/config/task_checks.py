"""Checks shared by the tasks' option dataclasses (torch-free): every error names `<Class>.<field>`, so a bad
`task.<field>=...` override on the command line is easy to find and fix."""

from __future__ import annotations

import math
from typing import Any


def require(config: Any, ok: bool, name: str, message: str) -> None:
    """Raise ValueError `"<Class>.<name> <message>"` unless `ok`."""
    if not ok:
        raise ValueError(f"{type(config).__name__}.{name} {message}")


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_ints(config: Any, *names: str) -> None:
    """Each named field holds an int."""
    for name in names:
        value = getattr(config, name)
        require(config, is_int(value), name, f"must be an int, got {value!r}")


def check_numbers(config: Any, *names: str) -> None:
    """Each named field holds a finite number."""
    for name in names:
        value = getattr(config, name)
        require(config, is_number(value), name, f"must be a finite number, got {value!r}")


def check_at_least(config: Any, name: str, low: int, why: str = "") -> None:
    """Field `name` is >= `low` (`why`, if given, is said in parentheses)."""
    value = getattr(config, name)
    require(config, value >= low, name, f"must be >= {low}{f' ({why})' if why else ''}, got {value}")


def check_order(config: Any, low: str, high: str, blame: str) -> None:
    """Field `low` <= field `high`; the error names `blame` (one of the two)."""
    lo, hi = getattr(config, low), getattr(config, high)
    if blame == low:
        require(config, lo <= hi, low, f"({lo}) must be <= {high} ({hi})")
    else:
        require(config, lo <= hi, high, f"({hi}) must be >= {low} ({lo})")


def check_lengths(config: Any, what: str, shortest: int) -> None:
    """`min_<what>_len` and `max_<what>_len` are ints with `shortest` <= min <= max."""
    low, high = f"min_{what}_len", f"max_{what}_len"
    check_ints(config, low, high)
    check_at_least(config, low, shortest)
    check_order(config, low, high, blame=high)


def check_probability(config: Any, name: str, closed_low: bool = False) -> None:
    """Field `name` is a probability strictly between 0 and 1 (0 allowed when `closed_low`)."""
    p = getattr(config, name)
    ok = is_number(p) and (p >= 0.0 if closed_low else p > 0.0) and p < 1.0
    bounds = "in [0, 1)" if closed_low else "strictly between 0 and 1"
    require(config, ok, name, f"must be a probability {bounds}, got {p!r}")


def check_probabilities(config: Any, name: str) -> None:
    """Field `name` is a non-empty tuple of probabilities, each strictly between 0 and 1."""
    probs = getattr(config, name)
    ok = isinstance(probs, tuple) and len(probs) > 0 and all(is_number(p) and 0.0 < p < 1.0 for p in probs)
    require(config, ok, name, f"must be a non-empty list of probabilities strictly between 0 and 1, got {probs!r}")


def check_min_count(config: Any) -> None:
    """`min_count` is an int in [1, max_response_len]: a count of tokens that a response can reach."""
    check_ints(config, "min_count")
    ok = 1 <= config.min_count <= config.max_response_len
    require(
        config, ok, "min_count", f"must be in [1, max_response_len={config.max_response_len}], got {config.min_count}"
    )


DRIFTS = ("none", "ramp", "step")
"""The policy schedules of `task.drift` (`ppo_critic.config.tasks.DriftOptions`)."""


def check_drift(config: Any) -> None:
    """`drift` is a known schedule, `drift_start` >= 0, `drift_steps` >= 1, and under a drift `drift_to` a value of
    the drifting option (as many entries as it has, for a tuple)."""
    known = f"must be one of {', '.join(DRIFTS)} (task.drift=...), got {config.drift!r}"
    require(config, config.drift in DRIFTS, "drift", known)
    check_ints(config, "drift_start", "drift_steps")
    check_at_least(config, "drift_start", 0)
    check_at_least(config, "drift_steps", 1)
    origin, end = config.drift_origin(), config.drift_to
    if config.drift != "none" and isinstance(origin, tuple) and isinstance(end, tuple):
        field = config.drift_field
        message = f"needs {len(origin)} entries, one per entry of {field}, got {end!r}"
        require(config, len(end) == len(origin), "drift_to", message)
    config.check_drift_end()
