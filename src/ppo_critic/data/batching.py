"""Which samples go together: mini-batches, fixed and dynamic (token-budget) micro-batches, order restore."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ppo_critic.data.batch import to_device


def mini_batch_rows(
    batch_size: int, mini_batch_size: int, *, shuffle: bool = False, seed: int | None = None, epoch: int = 0
) -> list[list[int]]:
    """Row indices of each mini-batch, as host ints: in order, or a permutation seeded by `seed + epoch` (same on
    all ranks), read from the host once per epoch.

    A batch that is not a multiple of `mini_batch_size` ends with a shorter mini-batch (verl's rule): it is one
    optimizer step like the others, normalised over its own rows.
    """
    _check_positive("ppo_mini_batch_size", mini_batch_size)
    if shuffle:
        if seed is None:
            raise ValueError("shuffle=True needs data_loader_seed")
        order = torch.randperm(batch_size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        order = list(range(batch_size))
    return [order[i : i + mini_batch_size] for i in range(0, batch_size, mini_batch_size)]


def mini_batch_indices(
    batch_size: int, mini_batch_size: int, *, shuffle: bool = False, seed: int | None = None, epoch: int = 0
) -> list[Tensor]:
    """`mini_batch_rows` as index tensors."""
    rows = mini_batch_rows(batch_size, mini_batch_size, shuffle=shuffle, seed=seed, epoch=epoch)
    return [torch.tensor(r, dtype=torch.long) for r in rows]


def fixed_micro_batches(batch_size: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of `micro_batch_size` rows (the last may be shorter)."""
    _check_positive(
        "the micro-batch size (ppo_micro_batch_size_per_gpu, forward_micro_batch_size_per_gpu or "
        "meta_info['micro_batch_size'])",
        micro_batch_size,
    )
    return [list(range(i, min(i + micro_batch_size, batch_size))) for i in range(0, batch_size, micro_batch_size)]


# Karmarkar–Karp costs O(n·k·log k) (every item starts as a k-way solution); past this many item×group pairs the
# greedy longest-first rule (O(n log n)) takes over: with many items per group both balance to within a fraction of
# one item, and the greedy one stays fast at verl-scale batches (tens of thousands of rows per call).
KK_LIMIT = 4096


def balanced_partitions(weights: Sequence[int], k: int) -> list[list[int]]:
    """Split item indices into `k` groups of near-equal total weight: largest differencing (Karmarkar–Karp) for
    small inputs, longest-first greedy (each item, heaviest first, to the lightest group) beyond `KK_LIMIT`
    item×group pairs. Deterministic; items inside a group in index order."""
    if len(weights) * k <= KK_LIMIT:
        return _largest_differencing(weights, k)
    return _longest_first(weights, k)


def _largest_differencing(weights: Sequence[int], k: int) -> list[list[int]]:
    """Each item starts as a k-way partial solution; the two with the largest spread are merged by pairing the
    heaviest group of one with the lightest of the other, until one solution remains."""
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for i, w in enumerate(weights):
        groups = [(int(w), [i])] + [(0, []) for _ in range(k - 1)]
        heap.append((-int(w), i, groups))
    heapq.heapify(heap)
    tiebreak = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(
            ((la + lb, ia + ib) for (la, ia), (lb, ib) in zip(a, reversed(b), strict=True)),
            key=lambda g: -g[0],
        )
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tiebreak, merged))
        tiebreak += 1
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(items) for _, items in heap[0][2]]


def _longest_first(weights: Sequence[int], k: int) -> list[list[int]]:
    """Items from the heaviest (ties: the lower index first) each go to the currently lightest group."""
    loads = [(0, j) for j in range(k)]  # a heap of (load, group)
    groups: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        load, j = loads[0]
        groups[j].append(i)
        heapq.heapreplace(loads, (load + int(weights[i]), j))
    return [sorted(g) for g in groups]


BUDGET_KEYS = (
    "ppo_max_token_len_per_gpu, or forward_max_token_len_per_gpu / meta_info['max_token_len'] for compute_values"
)


def check_token_budget(seq_lens: Sequence[int] | Tensor, max_token_len: int, keys: str = BUDGET_KEYS) -> None:
    """Raise if one sequence alone exceeds the dynamic micro-batch budget (no split could fit it); the error names
    `keys`, the settings that govern the budget where the caller reads it."""
    lens = seq_lens.tolist() if isinstance(seq_lens, Tensor) else seq_lens
    if any(n < 0 for n in lens):
        raise ValueError(f"sequence lengths must be >= 0, got {min(lens)}")
    _check_positive(f"the dynamic micro-batch budget ({keys})", max_token_len)
    longest = int(max(lens, default=0))
    if longest > max_token_len:
        raise ValueError(
            f"a sequence has {longest} tokens but the dynamic micro-batch budget is {max_token_len} tokens "
            f"({keys}, × ulysses_sequence_parallel_size); raise it to at least {longest}"
        )


def dynamic_micro_batches(
    seq_lens: Sequence[int] | Tensor, max_token_len: int, min_num_micro_batches: int = 1
) -> list[list[int]]:
    """Group rows into the fewest balanced micro-batches whose token totals never exceed `max_token_len`.

    Starts from the lower bound ceil(total / budget) and adds a micro-batch until the balanced partition
    fits. Groups are ordered by their first row; rows inside a group keep their order.
    """
    lens = [int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, Tensor) else seq_lens)]
    check_token_budget(lens, max_token_len)
    k = max(math.ceil(sum(lens) / max_token_len), min_num_micro_batches, 1)
    while True:
        groups = balanced_partitions(lens, k)
        if all(sum(lens[i] for i in g) <= max_token_len for g in groups):
            nonempty = sorted((g for g in groups if g), key=lambda g: g[0])
            return nonempty + [g for g in groups if not g]
        k += 1


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def restore_order(outputs: Sequence[Tensor], groups: Sequence[Sequence[int]]) -> Tensor:
    """Concatenate per-group outputs and put row i of the original batch back at position i."""
    order = torch.tensor([i for g in groups for i in g], dtype=torch.long)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return torch.cat(list(outputs), dim=0)[to_device(inverse, outputs[0].device)]
