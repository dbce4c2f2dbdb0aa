"""Rollout rows (token ids and per-token rewards, however they were read) → the DESIGN §3 batch: `collate` pads
them, `rollout_batch` is the one place the layout is built (recorded rollouts and the built-in tasks alike)."""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Rollout:
    """One prompt, its response and one reward per response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    token_level_rewards: list[float]


def row_key(rollout: Rollout) -> bytes:
    """The bytes that identify a row (its token ids and rewards), for fingerprints and overlap checks."""
    return repr((rollout.prompt_ids, rollout.response_ids, rollout.token_level_rewards)).encode()


def fingerprint(rollouts: Sequence[Rollout]) -> str:
    """A SHA-256 of the rows in order: equal exactly when the rows are (whatever file format held them)."""
    digest = hashlib.sha256()
    for rollout in rollouts:
        digest.update(row_key(rollout) + b"\n")
    return digest.hexdigest()


def collate(rollouts: Sequence[Rollout], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Pad rollouts into the DESIGN §3 layout: prompts left-padded, responses right-padded, rows in input order."""
    if len(rollouts) == 0:
        raise ValueError("collate needs at least one rollout, got none")
    if not isinstance(pad_token_id, numbers.Integral) or isinstance(pad_token_id, bool):
        raise TypeError(f"pad_token_id must be an integer, got {pad_token_id!r}")
    for i, rollout in enumerate(rollouts):
        _check_rollout(i, rollout)
    p = max(len(r.prompt_ids) for r in rollouts)
    r = max(len(r.response_ids) for r in rollouts)
    prompts, prompt_mask = _pad([x.prompt_ids for x in rollouts], p, pad_token_id, torch.int64, left=True)
    responses, response_mask = _pad([x.response_ids for x in rollouts], r, pad_token_id, torch.int64, left=False)
    rewards, _ = _pad([x.token_level_rewards for x in rollouts], r, 0.0, torch.float32, left=False)
    return rollout_batch(prompts, prompt_mask, responses, response_mask, rewards)


def rollout_batch(
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The DESIGN §3 batch of left-padded prompts and right-padded responses (position ids restart per row): the
    one place the layout is built, for recorded rollouts (`collate`) and the built-in tasks alike."""
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask,
        "token_level_rewards": rewards,
    }


def _check_rollout(index: int, rollout: Rollout) -> None:
    if not rollout.prompt_ids or not rollout.response_ids:
        raise ValueError(f"rollouts[{index}]: prompt_ids and response_ids must be non-empty")
    if len(rollout.token_level_rewards) != len(rollout.response_ids):
        raise ValueError(
            f"rollouts[{index}]: token_level_rewards has {len(rollout.token_level_rewards)} value(s) but "
            f"response_ids has {len(rollout.response_ids)} token(s)"
        )


def _pad(
    rows: list[list[Any]], width: int, fill: float, dtype: torch.dtype, left: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded to `width` with `fill` (on the left or the right) and the 0/1 long mask of real entries."""
    out = torch.full((len(rows), width), fill, dtype=dtype)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        out[i, span] = torch.tensor(row, dtype=dtype)
        mask[i, span] = 1
    return out, mask


# ---------------------------------------------------------------------------------------------------------------
# Writing values
