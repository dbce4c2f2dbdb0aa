"""Rollout batches: accept a TensorDict, a dict of tensors or a verl DataProto; validate; select, index, split.

A `Batch` is a thin, explicit view: per-sample tensors, per-sample non-tensor data (e.g.
`multi_modal_inputs`) and `meta_info`. Layout and semantics are those of DESIGN §3.
"""

from __future__ import annotations

import dataclasses
import functools
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
# |values|, |returns| at most 2**480 (~3.1e144): (2·x)² = 2**962 summed over up to 2**60 tokens (all micro-batches,
# steps and DP ranks) stays below float64's largest number (~2**1024) in the loss and the metrics. Only float64
# inputs can exceed it; float32 inputs whose squared error overflows a float32 loss are skipped steps (DESIGN §3).
TARGET_LIMIT = 2.0**480
DIGESTED = (*MODEL_KEYS, "response_mask", *TARGET_KEYS)  # what `Batch.digest` sums, after the rows and tokens
_MODULUS = 2**31 - 1  # a prime: checksum terms and weights below it, so their products fit int64


@dataclass
class Batch:
    tensors: dict[str, Tensor]
    non_tensors: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)
    seq_lens: list[int] | None = field(default=None, repr=False, compare=False)  # set by `with_lengths`

    @classmethod
    def from_any(cls, data: Any) -> Batch:
        """Accept a Batch, a verl DataProto (duck-typed), a TensorDict or a mapping of tensors."""
        if isinstance(data, Batch):
            return data
        if all(hasattr(data, a) for a in ("batch", "non_tensor_batch", "meta_info")):
            tensors, non_tensors = _split_items(_part(data.batch, "batch", tensors=True))
            non_tensors.update(_part(data.non_tensor_batch, "non_tensor_batch"))
            return cls(tensors, non_tensors, dict(_part(data.meta_info, "meta_info")))
        if isinstance(data, Mapping) or _is_tensordict(data):
            return cls(*_split_items(data))
        raise TypeError(f"batch must be a TensorDict, a dict of tensors or a verl DataProto, got {type(data).__name__}")

    def __len__(self) -> int:
        ids = self.tensors.get("input_ids")
        return ids.size(0) if ids is not None and ids.dim() else 0

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

    def lengths(self) -> list[int]:
        """Attended tokens per row (`attention_mask.sum(-1)`) as host ints: those `with_lengths` read, else read
        now (a host sync if the mask is on a device)."""
        return self.with_lengths().seq_lens

    def with_lengths(self) -> Batch:
        """This batch with `lengths()` read to the host once; `select`, `to` and `index` carry them, so micro-batching
        and packing read nothing more."""
        if self.seq_lens is not None:
            return self
        return dataclasses.replace(self, seq_lens=attended(self.tensors["attention_mask"]).tolist())

    def select(self, keys: Iterable[str]) -> Batch:
        """The named tensors and non-tensors that exist (missing names are skipped)."""
        keys = set(keys)
        return Batch(
            {k: v for k, v in self.tensors.items() if k in keys},
            {k: v for k, v in self.non_tensors.items() if k in keys},
            dict(self.meta_info),
            self.seq_lens,
        )

    def index(self, idx: Tensor | Sequence[int]) -> Batch:
        """Rows `idx` (in that order) of every per-sample entry; anything else (a scalar extra) is carried as is.
        Consecutive host rows are a slice (views); other rows gather through one index tensor per device, copied
        there without a host sync. A device `idx` is read on the host only for host data (non-tensors, lengths)."""
        n = len(self)
        rows = Rows(idx, n)
        return Batch(
            {k: rows.of(v) if _per_sample(v, n) else v for k, v in self.tensors.items()},
            {k: _take(v, rows.host) if _per_sample(v, n) else v for k, v in self.non_tensors.items()},
            dict(self.meta_info),
            None if self.seq_lens is None else [self.seq_lens[i] for i in rows.host],
        )

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of `size` rows (the last may be shorter)."""
        return [self.index(range(i, min(i + size, len(self)))) for i in range(0, len(self), size)]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The tensors on `device`; `non_blocking` lets copies from the host run without blocking (`copied_to`)."""
        tensors = {k: copied_to(v, torch.device(device), non_blocking) for k, v in self.tensors.items()}
        return Batch(tensors, dict(self.non_tensors), dict(self.meta_info), self.seq_lens)

    def digest(self) -> Tensor:
        """int64 [rows, tokens per row, one checksum per entry of `DIGESTED`] (-1: absent): equal on two ranks
        when, and (but for a checksum collision) only when, they hold the same batch."""
        ids = self.tensors["input_ids"]  # summed where the batch is: no host sync per tensor
        absent = torch.tensor(-1, device=ids.device)
        sums = [_checksum(self.tensors[k]).to(ids.device) if k in self.tensors else absent for k in DIGESTED]
        return torch.cat([torch.tensor([len(self), ids.shape[-1]], device=ids.device), torch.stack(sums)])

    def validate(self, require_targets: bool = False) -> None:
        """Check what is read (keys, types, shapes, dtypes, masks, positions, targets); one-line errors name the key."""
        read = MODEL_KEYS + (TARGET_KEYS if require_targets else ())
        self._check_present(read)
        for key in (*read, "response_mask"):
            if key in self.tensors:
                _check_storage(key, self.tensors[key])
        self._check_ids()
        b, t = self.tensors["input_ids"].shape
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
                self._check_target(key)

    def _check_present(self, keys: Sequence[str]) -> None:
        """Every key read is a torch tensor: missing keys are listed; a numpy array or a list is named as such."""
        for key in (*keys, "response_mask"):
            if key in self.non_tensors and key not in self.tensors:
                got = type(self.non_tensors[key])
                name = got.__qualname__ if got.__module__ == "builtins" else f"{got.__module__}.{got.__qualname__}"
                raise TypeError(
                    f"batch[{key!r}] is a {name}, not a torch.Tensor; pass torch.as_tensor({key}) (in a verl "
                    "DataProto: in .batch, not .non_tensor_batch)"
                )
        missing = [k for k in keys if k not in self.tensors]
        if missing:
            raise ValueError(f"batch is missing key(s) {missing}; {_LAYOUT}")

    def _check_ids(self) -> None:
        """input_ids is a non-empty [B, T] tensor of non-negative torch.long / int32 token ids."""
        ids = self.tensors["input_ids"]
        if ids.dim() and len(self) == 0:
            raise ValueError("batch is empty (input_ids has 0 rows); pass at least one sample")
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

    def _check_shape(self, key: str, allowed: list[tuple[int, ...]]) -> None:
        shape = tuple(self.tensors[key].shape)
        if shape not in allowed:
            want = " or ".join(str(list(a)) for a in allowed)
            raise ValueError(f"batch[{key!r}] has shape {list(shape)}; expected {want} (input_ids is [B, T])")

    def _check_masks(self) -> None:
        """Masks are 0/1; no sample is empty; valid response tokens and the positions before them are attended."""
        attention, mask = self.tensors["attention_mask"], self.response_mask
        t, r = attention.shape[1], self.response_length
        valid, response = attention.bool(), mask.bool().to(attention.device)
        outside = response & ~valid[:, -r:]
        unread = response & ~valid[:, t - r - 1 : t - 1]
        empty = ~valid.any(-1)
        flags = torch.stack(
            [
                ~((attention == 0) | (attention == 1)).all(),
                ~((mask == 0) | (mask == 1)).all().to(attention.device),
                empty.any(),
                outside.any(),
                unread.any(),
            ]
        ).tolist()
        if flags[0]:
            raise ValueError("batch['attention_mask'] must hold only 0 and 1")
        if flags[1]:
            raise ValueError("batch['response_mask'] must hold only 0 and 1")
        if flags[2]:
            raise ValueError(
                f"batch['attention_mask'] is all 0 in {int(empty.sum())} of {len(empty)} sample(s) (first: sample "
                f"{int(empty.nonzero()[0])}); an empty sequence has no position to read a value at: drop those "
                "samples (each needs at least one attended prompt token)"
            )
        if flags[3]:
            raise ValueError(
                f"batch['response_mask'] marks {int(outside.sum())} token(s) as valid where attention_mask marks "
                "padding; a response token must be attended to"
            )
        if flags[4]:
            row, col = (int(i) for i in unread.nonzero()[0])
            raise ValueError(
                f"batch['attention_mask'] is 0 at position {t - r - 1 + col} of sample {row}, just before its valid "
                f"response token {col}; a value is read at the position before each response token, so that position "
                "must be attended to (every sample needs a non-empty prompt)"
            )

    def _check_positions(self) -> None:
        """Position ids (torch.long or int32: what an embedding lookup takes) count each sequence's valid tokens
        from 0 (`attention_mask.cumsum(-1) - 1`: verl's, TRL's, what the model was trained with; packing restarts
        them per sequence, so anything else would also make the packed and padded paths disagree). mrope ids
        [B, 3, T] start at 0, are not negative, and their temporal component does not decrease."""
        mask = self.tensors["attention_mask"].bool()
        positions = self.tensors["position_ids"].to(mask.device)
        fix = "use attention_mask.cumsum(-1) - 1 (verl: compute_position_id_with_mask)"
        if positions.dtype not in _ID_DTYPES:
            raise TypeError(
                f"batch['position_ids'] must be a torch.long (or torch.int32) tensor, got {positions.dtype}; pass "
                "position_ids.long() (they are attention_mask.cumsum(-1) - 1)"
            )
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

    def _check_target(self, key: str) -> None:
        """`values` / `returns`: floating point, detached, finite and within ±TARGET_LIMIT at valid positions."""
        x = self.tensors[key]
        if not x.dtype.is_floating_point:
            raise TypeError(f"batch[{key!r}] must be a floating-point tensor, got {x.dtype}")
        if x.requires_grad:
            raise ValueError(f"batch[{key!r}] requires grad (it is attached to an autograd graph); pass {key}.detach()")
        # a NaN fails the comparison; float16/bfloat16/float32 cannot hold a finite number beyond the limit
        held = x.abs() <= TARGET_LIMIT if torch.finfo(x.dtype).max > TARGET_LIMIT else torch.isfinite(x)
        bad = ~held & self.response_mask.bool().to(x.device)
        if not bad.any():
            return
        row, col = (int(i) for i in bad.nonzero()[0])
        where = f"(first at sample {row}, response token {col}"
        if torch.isfinite(x[row, col]):
            raise ValueError(
                f"batch[{key!r}] holds {int(bad.sum())} value(s) beyond ±{TARGET_LIMIT:.3g} at valid response "
                f"positions {where}: {float(x[row, col]):.3g}), whose squared errors overflow float64 in the loss and "
                "metrics; rescale the rewards (or mask those tokens)"
            )
        raise ValueError(
            f"batch[{key!r}] has {int(bad.sum())} NaN/Inf value(s) at valid response positions {where}); fix the "
            "rollout or mask those tokens"
        )


class Rows:
    """Row indices `idx` of a batch of `n` rows, as `Batch.index` takes them from each tensor and host entry."""

    def __init__(self, idx: Tensor | Sequence[int], n: int):
        self.idx, self.n = idx, n
        self.on_device: dict[torch.device, Tensor] = {}

    @functools.cached_property
    def host(self) -> list[int]:
        """The rows as Python ints (a device `idx` is read here, once)."""
        return self.idx.tolist() if isinstance(self.idx, Tensor) else [int(i) for i in self.idx]

    @functools.cached_property
    def run(self) -> slice | None:
        """The slice of host rows that run consecutively inside the batch (None otherwise, and for a tensor)."""
        if isinstance(self.idx, Tensor) or not self.host:
            return None
        run = range(self.host[0], self.host[0] + len(self.host))
        consecutive = run.start >= 0 and run.stop <= self.n and self.host == list(run)
        return slice(run.start, run.stop) if consecutive else None

    def of(self, x: Tensor) -> Tensor:
        """The rows of `x`: a view for a run, else gathered with the index tensor on `x`'s device."""
        if self.run is not None:
            return x[self.run]
        if x.device not in self.on_device:
            self.on_device[x.device] = to_device(torch.as_tensor(self.idx, dtype=torch.long), x.device)
        return x[self.on_device[x.device]]


def _checksum(x: Tensor) -> Tensor:
    """A position-weighted sum of `x`'s bits modulo `_MODULUS` (floats by their bit patterns: exact, no rounding)."""
    bits = x.detach().contiguous()
    if bits.is_floating_point():
        bits = bits.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[bits.element_size()])
    flat = bits.flatten().long().remainder(_MODULUS)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device).remainder(_MODULUS)
    return (flat * weights).remainder(_MODULUS).sum()


def attended(attention_mask: Tensor) -> Tensor:
    """Attended tokens per row as integers, whatever the 0/1 mask's dtype (a float mask's sum would be a float)."""
    return attention_mask.bool().sum(-1)


def copied_to(x: Tensor, device: torch.device, non_blocking: bool) -> Tensor:
    """`x` on `device`. Only a copy from the host may skip waiting (the device's stream orders it before any use); a
    copy from a device blocks until it has landed, since the host or another device reads it next, unordered."""
    return x.to(device, non_blocking=non_blocking and x.device.type == "cpu")


def to_device(x: Tensor, device: torch.device) -> Tensor:
    """`x` on `device` without a host sync when it comes from the host: a blocking copy from pageable memory waits
    for the device's stream, a `non_blocking` one from pinned memory does not (device data is copied as is)."""
    if x.device == device:
        return x
    if x.device.type != "cpu":
        return x.to(device)
    return (x.pin_memory() if device.type == "cuda" else x).to(device, non_blocking=True)


def _check_storage(key: str, x: Tensor) -> None:
    """A read tensor is dense and holds data (not sparse, nested or on the meta device)."""
    if x.is_nested or x.layout != torch.strided:
        kind, fix = ("nested", "torch.nested.to_padded_tensor(x, 0)") if x.is_nested else (x.layout, "x.to_dense()")
        raise TypeError(f"batch[{key!r}] is a {kind} tensor; pass a dense (torch.strided) one: {fix}")
    if x.is_meta:
        raise ValueError(f"batch[{key!r}] is on the meta device (a shape without data); pass a tensor that holds data")


def _part(value: Any, name: str, tensors: bool = False) -> Any:
    """A part of a verl DataProto (`batch`, `non_tensor_batch`, `meta_info`): a mapping, or None (empty)."""
    if value is None:
        return {}
    if isinstance(value, Mapping) or (tensors and _is_tensordict(value)):
        return value
    want = "a TensorDict, a dict of tensors" if tensors else "a dict"
    raise TypeError(f"the DataProto's {name} must be {want} or None, got {type(value).__name__}")


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
