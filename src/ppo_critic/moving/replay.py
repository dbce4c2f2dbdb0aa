"""`trainer.replay_rows`: each update trains on the fresh batch and on rows of the last `replay_window` batches,
a batch `a` iterations old drawn with weight `replay_decay`^(a−1). The replayed rows come first, so the last
mini-batches are the freshest; the trainer recomputes their values and targets with the current critic (fresh
bootstraps), so what they add is old rollouts, not old targets. A checkpoint keeps the random state each held batch
was drawn from, and a resumed run draws them again: the same rows as a run that never stopped.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import Tensor

_STATE_BYTES = torch.Generator().get_state().numel()  # the size of a CPU generator's state


class ReplaySource:
    """A built-in task's rollouts (`source`: a `train.TaskSource`) with `rows` replayed rows ahead of each batch;
    every other member is the source's. Groups of `group` consecutive rows (one prompt's responses) stay whole."""

    def __init__(self, source: Any, rows: int, window: int, decay: float, group: int, seed: int):
        self.source, self.rows, self.decay, self.group, self.seed = source, rows, decay, group, seed
        self.held: deque[tuple[int, Tensor, dict[str, Tensor]]] = deque(maxlen=window)  # (step, rng state, batch)
        self.replayed = 0  # rows ahead of the fresh ones in the latest batch

    def __getattr__(self, name: str) -> Any:
        if name == "source":  # not set yet (a copy being built): no recursion through it
            raise AttributeError(name)
        return getattr(self.source, name)

    def next_batch(self) -> dict[str, Tensor]:
        """The replayed rows, then the source's next batch (its last `batch_size` rows)."""
        step, state = self.source.step, self.source.generator.get_state()
        fresh = self.source.next_batch()
        replayed = self._replay(step)
        self.held.append((step, state, dict(fresh)))  # the rollouts as drawn (the trainer adds values and targets)
        self.replayed = len(replayed["input_ids"]) if replayed else 0
        return {key: torch.cat([replayed[key], value]) for key, value in fresh.items()} if replayed else fresh

    def _replay(self, step: int) -> dict[str, Tensor]:
        """Up to `rows` rows of the held batches (a seeded choice: every rank and a resumed run draw the same)."""
        return draw_replay([batch for _, _, batch in self.held], self.rows, self.decay, self.group, self.seed, step)

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The source's state, the random state of each held batch (a fixed-size tensor: a checkpoint's template)
        and their steps."""
        tensors, state = self.source.state()
        states = torch.zeros(self.held.maxlen, _STATE_BYTES, dtype=torch.uint8)
        for i, (_, held_state, _) in enumerate(self.held):
            states[i] = held_state
        return tensors | {"replay/generator_states": states}, state | {"replay_steps": [s for s, _, _ in self.held]}

    def load_state(self, tensors: dict[str, Tensor], state: dict[str, Any]) -> None:
        """The source's state, then each held batch drawn again from its saved random state."""
        self.source.load_state(tensors, state)
        self.held.clear()
        for i, step in enumerate(state.get("replay_steps", [])):
            held_state = tensors["replay/generator_states"][i].clone()
            generator = torch.Generator()
            generator.set_state(held_state)
            self.held.append((step, held_state, self.source.draw(step, generator)))


def draw_replay(
    held: list[dict[str, Tensor]], rows: int, decay: float, group: int, seed: int, step: int
) -> dict[str, Tensor]:
    """Up to `rows` rows of the `held` batches (oldest first), whole groups of `group` rows drawn without
    replacement, a batch `a` batches old with weight `decay`^(a−1), seeded by the run's `seed` and `step` (every
    rank and a resumed run draw the same); empty when nothing is held."""
    if not held:
        return {}
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    groups = [len(batch["input_ids"]) // group for batch in held]
    ages = torch.cat([torch.full((n,), len(held) - i) for i, n in enumerate(groups)])
    chosen = torch.multinomial(decay ** (ages - 1.0), min(rows // group, len(ages)), generator=generator)
    picked = (chosen[:, None] * group + torch.arange(group)).flatten()
    return {key: torch.cat([batch[key] for batch in held])[picked] for key in held[0]}
