"""Remove padding: a micro-batch becomes one packed row of valid tokens, and per-token outputs go back to [B, T].

Sequences keep their order; `cu_seqlens` marks where each starts in the packed row, so a varlen attention can
keep them apart. Position ids are taken from the batch (they restart at 0 per sequence, DESIGN §3); mrope
position ids [B, 3, T] pack to [3, 1, nnz]. `compact` is the variant for models that only run padded causal
batches (megatron's local layers): each row's valid tokens move to its start, so no padding mask is needed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ppo_critic.data.batch import attended


@dataclass
class PackedBatch:
    input_ids: Tensor  # [1, nnz]
    position_ids: Tensor  # [1, nnz], or [3, 1, nnz] for mrope
    cu_seqlens: Tensor  # [B + 1] int32: start of each sequence in the packed row (empty rows repeat a value)
    max_seqlen: int
    indices: Tensor  # [nnz]: where each packed token sits in the flattened [B * T] batch
    batch_size: int
    seq_len: int
    bounds: tuple[int, ...]  # `cu_seqlens` on the host: 0, then where each sequence ends

    def model_kwargs(self, sp: int = 1, rank: int = 0) -> dict:
        """Keyword arguments for a transformers model call on the packed row: the varlen attention reads
        `cu_seq_lens_*` / `max_length_*`, and no attention mask is built. For rank `rank` of a Ulysses group of
        `sp` ranks, the row is padded to a multiple of `sp` (the padding is a sequence of its own in
        `cu_seqlens`) and the ids and positions are this rank's 1/sp slice."""
        nnz = self.input_ids.shape[1]
        pad = (-nnz) % sp
        chunk = slice(rank * (nnz + pad) // sp, (rank + 1) * (nnz + pad) // sp)
        ids = F.pad(self.input_ids, (0, pad))
        pad_pos = torch.arange(pad, device=self.position_ids.device).expand(*self.position_ids.shape[:-1], pad)
        pos = torch.cat([self.position_ids, pad_pos], dim=-1)
        cu = F.pad(self.cu_seqlens, (0, 1), value=nnz + pad) if pad else self.cu_seqlens  # no host-to-device copy
        _HOST_BOUNDS[cu] = (*self.bounds, nnz + pad) if pad else self.bounds
        longest = max(self.max_seqlen, pad)
        return {
            "input_ids": ids[:, chunk],
            "position_ids": pos[..., chunk],
            "attention_mask": None,
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": longest,
            "max_length_k": longest,
        }

    def unpack(self, packed: Tensor) -> Tensor:
        """Per-token outputs of the packed row, [1, nnz, ...], back to [B, T, ...] with zeros at padding."""
        if packed.shape[:2] != (1, len(self.indices)):
            raise ValueError(
                f"expected packed outputs of shape [1, {len(self.indices)}, ...], got {list(packed.shape)}"
            )
        out = packed.new_zeros(self.batch_size * self.seq_len, *packed.shape[2:])
        out[self.indices] = packed[0]
        return out.view(self.batch_size, self.seq_len, *packed.shape[2:])


def pack(
    input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, lengths: Sequence[int] | None = None
) -> PackedBatch:
    """Keep the tokens where `attention_mask` is 1, in row-major order, as one packed row. `lengths`, the attended
    tokens per row on the host (`Batch.lengths()`), size the packed row without a host sync; without them the mask
    is read (one sync)."""
    b, t = input_ids.shape
    lengths = attended(attention_mask).tolist() if lengths is None else lengths
    valid = attention_mask.bool()
    indices = valid_positions(valid.flatten(), sum(lengths))
    seqlens = valid.sum(-1, dtype=torch.int32)
    cu_seqlens = F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    if position_ids.dim() == 3:  # [B, 3, T] mrope
        packed_pos = position_ids.transpose(0, 1).reshape(position_ids.shape[1], b * t)[:, indices].unsqueeze(1)
    else:
        packed_pos = position_ids.flatten()[indices].unsqueeze(0)
    return PackedBatch(
        input_ids=input_ids.flatten()[indices].unsqueeze(0),
        position_ids=packed_pos,
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lengths, default=0),
        indices=indices,
        batch_size=b,
        seq_len=t,
        bounds=(0, *itertools.accumulate(lengths)),
    )


# The host copy of each `cu_seqlens` tensor `model_kwargs` hands a model (kept while the tensor lives): an attention
# that plans on the host (`models/attention.py: bucketed_sdpa`) reads it instead of the device.
_HOST_BOUNDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def host_bounds(cu_seqlens: Tensor) -> list[int]:
    """`cu_seqlens` as host ints: the copy `PackedBatch.model_kwargs` kept beside it, else read (a sync on a device)."""
    bounds = _HOST_BOUNDS.get(cu_seqlens)
    return cu_seqlens.tolist() if bounds is None else list(bounds)


def valid_positions(valid: Tensor, count: int) -> Tensor:
    """Where the `count` True entries of the 1-D `valid` are, in order: `nonzero` without its host sync (the count is
    known), as a stable sort that puts them first."""
    return torch.sort((~valid).to(torch.uint8), stable=True).indices[:count]


@dataclass
class CompactBatch:
    input_ids: Tensor  # [B, L]: each row's valid tokens first, in order; L = the longest row
    position_ids: Tensor  # [B, L]
    index: Tensor  # [B, L]: the column of [B, T] each slot came from (slots past a row's end point at its padding)
    valid: Tensor  # [B, L] bool
    seq_len: int  # T

    def expand(self, outputs: Tensor) -> Tensor:
        """Per-token outputs [B, L] back to [B, T] with zeros at padding (differentiable)."""
        out = outputs.new_zeros(outputs.shape[0], self.seq_len)
        return out.scatter(1, self.index, torch.where(self.valid, outputs, 0.0))


def compact(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> CompactBatch:
    """Move each row's valid tokens to its start (any mask, not only left/right padding): under a causal
    attention a token then sees exactly the valid tokens before it, as with the padded mask."""
    if position_ids.dim() != 2:
        raise ValueError(f"compact takes position_ids [B, T], got shape {list(position_ids.shape)}")
    valid = attention_mask.bool()
    order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices
    index = order[:, : max(int(valid.sum(-1).max()), 1)] if len(valid) else order
    return CompactBatch(
        input_ids=input_ids.gather(1, index),
        position_ids=position_ids.gather(1, index),
        index=index,
        valid=valid.gather(1, index),
        seq_len=input_ids.shape[1],
    )
