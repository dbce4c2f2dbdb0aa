"""Speed of dynamic micro-batch partitioning (`ppo_critic.data.batching.dynamic_micro_batches`), and the two rules of
`balanced_partitions` side by side on the same rows: largest differencing (Karmarkar–Karp, O(n·k·log k)) and
longest-first greedy (O(n log n)), with their micro-batch counts and max/min token loads.

    python bench/partition_speed.py            # rows 1024 / 4096 / 65536, lengths uniform in [16, 2048]
"""

from __future__ import annotations

import math
import random
import time

from ppo_critic.data.batching import _largest_differencing, _longest_first, dynamic_micro_batches

CASES = ((1024, 4096), (4096, 16384), (65536, 262144))  # rows, token budget
KK_MAX_ROWS = 4096  # largest differencing past this takes minutes


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def spread(lens: list[int], groups: list[list[int]]) -> float:
    loads = [sum(lens[i] for i in g) for g in groups if g]
    return max(loads) / min(loads)


def main() -> None:
    rng = random.Random(0)
    print(
        "  rows  budget  micro-batches (bound)  dynamic_micro_batches  |  same k: KK ms (max/min)  greedy ms (max/min)"
    )
    for rows, budget in CASES:
        lens = [rng.randint(16, 2048) for _ in range(rows)]
        groups, seconds = timed(dynamic_micro_batches, lens, budget)
        k = len(groups)
        kk = "       —         "
        if rows <= KK_MAX_ROWS:
            parts, kk_s = timed(_largest_differencing, lens, k)
            kk = f"{kk_s * 1000:8.1f} ({spread(lens, parts):.4f})"
        parts, greedy_s = timed(_longest_first, lens, k)
        lower = math.ceil(sum(lens) / budget)
        print(
            f"{rows:6d} {budget:7d}  {k:5d} ({lower:5d})  {seconds * 1000:10.1f} ms  |  {kk}  "
            f"{greedy_s * 1000:8.1f} ({spread(lens, parts):.4f})"
        )


if __name__ == "__main__":
    main()
