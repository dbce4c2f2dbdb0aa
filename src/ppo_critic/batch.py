"""Rollout batches: accept a TensorDict, a dict of tensors or a verl DataProto; validate; select, index, split.

A `Batch` is a thin, explicit view: per-sample tensors, per-sample non-tensor data (e.g.
`multi_modal_inputs`) and `meta_info`. Layout and semantics are those of DESIGN §3.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
TARGET_KEYS = ("values", "returns")
MULTI_MODAL = "multi_modal_inputs"  # per-sample dicts of model inputs (e.g. pixel_values, image_grid_thw)
_LAYOUT = (
    "a rollout batch needs input_ids [B, T] (integer), attention_mask [B, T], position_ids [B, T] or "
    "[B, 3, T], responses [B, R]; update_critic also needs values and returns [B, R]"
)
_ID_DTYPES = (torch.int64, torch.int32)  # what an embedding lookup accepts


@dataclass
class Batch:
    tensors: dict[str, Tensor]
    non_tensors: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_any(cls, data: Any) -> Batch:
        """Accept a Batch, a verl DataProto (duck-typed), a TensorDict or a mapping of tensors."""
        if isinstance(data, Batch):
            return data
        if all(hasattr(data, a) for a in ("batch", "non_tensor_batch", "meta_info")):
            tensors, non_tensors = _split_items(data.batch if data.batch is not None else {})
            non_tensors.update(data.non_tensor_batch or {})
            return cls(tensors, non_tensors, dict(data.meta_info or {}))
        if isinstance(data, Mapping) or _is_tensordict(data):
            return cls(*_split_items(data))
        raise TypeError(f"batch must be a TensorDict, a dict of tensors or a verl DataProto, got {type(data).__name__}")

    def __len__(self) -> int:
        return self.tensors["input_ids"].shape[0] if "input_ids" in self.tensors else 0

    def __getitem__(self, key: str) -> Tensor:
        return self.tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    @property
    def response_length(self) -> int:
        return self.tensors["responses"].shape[-1]

    @property
    def response_mask(self) -> Tensor:
        """`response_mask` if given, else the response part of `attention_mask` (verl's default)."""
        if "response_mask" in self.tensors:
            return self.tensors["response_mask"]
        return self.tensors["attention_mask"][:, -self.response_length :]

    def select(self, keys: Iterable[str]) -> Batch:
        """The named tensors and non-tensors that exist (missing names are skipped)."""
        keys = set(keys)
        return Batch(
            {k: v for k, v in self.tensors.items() if k in keys},
            {k: v for k, v in self.non_tensors.items() if k in keys},
            dict(self.meta_info),
        )

    def index(self, idx: Tensor | Sequence[int]) -> Batch:
        """Rows `idx` (in that order) of every per-sample entry; anything else (a scalar extra) is carried as is."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        n = len(self)
        rows = idx.tolist() if self.non_tensors else []
        return Batch(
            {k: v[idx.to(v.device)] if _per_sample(v, n) else v for k, v in self.tensors.items()},
            {k: _take(v, rows) if _per_sample(v, n) else v for k, v in self.non_tensors.items()},
            dict(self.meta_info),
        )

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of `size` rows (the last may be shorter)."""
        return [self.index(range(i, min(i + size, len(self)))) for i in range(0, len(self), size)]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        tensors = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()}
        return Batch(tensors, dict(self.non_tensors), dict(self.meta_info))

    def validate(self, require_targets: bool = False) -> None:
        """Check keys, shapes, dtypes and (for training) finite targets; raise ValueError/TypeError naming the key."""
        required = MODEL_KEYS + (TARGET_KEYS if require_targets else ())
        missing = [k for k in required if k not in self.tensors]
        if len(self) == 0 and "input_ids" in self.tensors:
            raise ValueError("batch is empty (input_ids has 0 rows); pass at least one sample")
        if missing:
            raise ValueError(f"batch is missing key(s) {missing}; {_LAYOUT}")
        ids = self.tensors["input_ids"]
        if ids.dtype not in _ID_DTYPES:
            raise TypeError(f"batch['input_ids'] must be a torch.long (or torch.int32) tensor, got {ids.dtype}")
        if ids.dim() != 2:
            raise ValueError(f"batch['input_ids'] must be [B, T], got shape {tuple(ids.shape)}")
        if (ids < 0).any():
            row, col = (int(i) for i in (ids < 0).nonzero()[0])
            raise ValueError(
                f"batch['input_ids'] holds {int((ids < 0).sum())} negative token id(s) (first at sample {row}, "
                f"position {col}: {int(ids[row, col])}); token ids (padding included) must be in [0, vocab_size)"
            )
        b, t = ids.shape
        self._check_shape("attention_mask", [(b, t)])
        self._check_shape("position_ids", [(b, t), (b, 3, t)])
        responses = self.tensors["responses"]
        if responses.dim() != 2 or responses.shape[0] != b:
            raise ValueError(f"batch['responses'] must be [B={b}, R], got shape {tuple(responses.shape)}")
        r = responses.shape[1]
        if r == 0:
            raise ValueError("batch['responses'] is empty (R = 0); a rollout needs at least one response token")
        if r >= t:
            raise ValueError(
                f"batch['responses'] has R={r} tokens but input_ids has only T={t}; the sequence must hold a "
                "prompt of at least one token before the response (values are read at the position before)"
            )
        for key in ("response_mask", *TARGET_KEYS):
            if key in self.tensors:
                self._check_shape(key, [(b, r)])
        if MULTI_MODAL in self.non_tensors:  # other non-tensor extras are carried, never read
            samples = self.non_tensors[MULTI_MODAL]
            if not _per_sample(samples, b):
                sized = isinstance(samples, Sequence | np.ndarray)
                got = f"{len(samples)} entries" if sized else type(samples).__name__
                raise ValueError(f"batch[{MULTI_MODAL!r}] must hold one dict per sample ({b}), got {got}")
        self._check_masks()
        self._check_positions()
        if require_targets:
            for key in TARGET_KEYS:
                self._check_finite(key)
                if self.tensors[key].requires_grad:
                    raise ValueError(
                        f"batch[{key!r}] requires grad (it is attached to an autograd graph); pass {key}.detach()"
                    )

    def _check_shape(self, key: str, allowed: list[tuple[int, ...]]) -> None:
        shape = tuple(self.tensors[key].shape)
        if shape not in allowed:
            want = " or ".join(str(list(a)) for a in allowed)
            raise ValueError(f"batch[{key!r}] has shape {list(shape)}; expected {want} (input_ids is [B, T])")

    def _check_masks(self) -> None:
        attention = self.tensors["attention_mask"]
        if not ((attention == 0) | (attention == 1)).all():
            raise ValueError("batch['attention_mask'] must hold only 0 and 1")
        mask = self.response_mask
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError("batch['response_mask'] must hold only 0 and 1")
        r = self.response_length
        outside = (mask.bool() & ~attention[:, -r:].bool().to(mask.device)).sum().item()
        if outside:
            raise ValueError(
                f"batch['response_mask'] marks {outside} token(s) as valid where attention_mask marks padding; "
                "a response token must be attended to"
            )
        t = attention.shape[1]
        unread = mask.bool() & ~attention[:, t - r - 1 : t - 1].bool().to(mask.device)
        if unread.any():
            row, col = (int(i) for i in unread.nonzero()[0])
            raise ValueError(
                f"batch['attention_mask'] is 0 at position {t - r - 1 + col} of sample {row}, just before its valid "
                f"response token {col}; a value is read at the position before each response token, so that position "
                "must be attended to (every sample needs a non-empty prompt)"
            )

    def _check_positions(self) -> None:
        """Position ids count each sequence's valid tokens from 0 (`attention_mask.cumsum(-1) - 1`: verl's, TRL's,
        what the model was trained with; packing restarts them per sequence, so anything else would also make the
        packed and padded paths disagree). mrope ids [B, 3, T] start at 0, are not negative, and their temporal
        component does not decrease."""
        positions, mask = self.tensors["position_ids"], self.tensors["attention_mask"].bool()
        fix = "use attention_mask.cumsum(-1) - 1 (verl: compute_position_id_with_mask)"
        if positions.dim() == 2:
            expected = mask.long().cumsum(-1) - 1
            wrong = mask & (positions != expected)
            if wrong.any():
                row, col = (int(i) for i in wrong.nonzero()[0])
                raise ValueError(
                    f"batch['position_ids'] does not count the valid tokens of sample {row} from 0: position {col} "
                    f"holds {int(positions[row, col])}, expected {int(expected[row, col])}; {fix}"
                )
            return
        first = mask.long().argmax(-1)  # the first valid token of each row
        starts = positions.gather(2, first[:, None, None].expand(-1, 3, 1)).squeeze(-1)
        temporal = positions[:, 0].masked_fill(~mask, torch.iinfo(positions.dtype).min)
        bad = (
            ((positions < 0) & mask[:, None]).flatten(1).any(-1)
            | (starts != 0).any(-1)
            | (mask & (temporal != temporal.cummax(-1).values)).any(-1)
        )
        if bad.any():
            raise ValueError(
                f"batch['position_ids'] (mrope, [B, 3, T]) of sample {int(bad.nonzero()[0])} does not start at 0, is "
                "negative, or has a decreasing temporal component at valid tokens; compute them with the model's "
                "own rope index (e.g. Qwen2-VL's get_rope_index)"
            )

    def _check_finite(self, key: str) -> None:
        x = self.tensors[key]
        if not x.dtype.is_floating_point:
            raise TypeError(f"batch[{key!r}] must be a floating-point tensor, got {x.dtype}")
        bad = ~torch.isfinite(x) & self.response_mask.bool().to(x.device)
        if bad.any():
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"batch[{key!r}] has {int(bad.sum())} NaN/Inf value(s) at valid response positions "
                f"(first at sample {row}, response token {col}); fix the rollout or mask those tokens"
            )


def _is_tensordict(data: Any) -> bool:
    try:
        from tensordict import TensorDictBase
    except ImportError:  # pragma: no cover - tensordict is a runtime dependency
        return False
    return isinstance(data, TensorDictBase)


def _split_items(data: Any) -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors, non_tensors = {}, {}
    for key in data.keys():  # noqa: SIM118 - TensorDict iteration differs from dict's
        value = data[key]
        (tensors if isinstance(value, Tensor) else non_tensors)[key] = value
    return tensors, non_tensors


def _per_sample(value: Any, n: int) -> bool:
    """Whether `value` holds one entry per sample (a tensor, array or list of length n), not a scalar extra."""
    if isinstance(value, Tensor | np.ndarray):
        return value.ndim >= 1 and value.shape[0] == n
    return isinstance(value, list | tuple) and len(value) == n


def _take(value: Any, rows: list[int]) -> Any:
    if isinstance(value, np.ndarray):
        return value[rows]
    return [value[i] for i in rows]
