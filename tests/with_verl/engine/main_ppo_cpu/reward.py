"""The test's reward (verl's `reward.custom_reward_function`): the fraction of response tokens `w<id>` with an even
id, so rewards vary from rollout to rollout and the same response always earns the same."""

from __future__ import annotations

import re


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    ids = [int(i) for i in re.findall(r"w(\d+)", solution_str)]
    return sum(i % 2 == 0 for i in ids) / max(len(ids), 1)
