"""Varlen attention for packed rows, registered with transformers' `AttentionInterface` as `ppo_critic_varlen`.

The packed row holds several sequences one after another; `cu_seq_lens_q` (from `PackedBatch.model_kwargs`)
says where each starts. Attention is computed within each sequence only:
- CUDA in float16 / bfloat16: `flash_attn_varlen_func` when flash-attn is importable, else PyTorch's own
  `torch.nn.attention.varlen.varlen_attn` (causal through `window_size=(-1, 0)`, native GQA when available), chosen
  once at registration (`KERNELS`); q/k/v reach it in one half dtype (`kernel_dtype`);
- anything else (the CPU, other devices, float32 on CUDA, which the kernels do not take): `scaled_dot_product_attention`
  on buckets of sequences of similar length, each right-padded to its longest (short sequences share a call, whose
  fixed cost dominates them), or one call per sequence where a cost model fitted on measurements says so — linear in
  the pack, unlike a dense block-diagonal mask. It plans from the sequence bounds on the host (`host_bounds`), so a
  device reads nothing back.
No attention mask is built for this implementation (transformers skips mask creation for unknown names).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import itertools
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppo_critic.data.batch import to_device
from ppo_critic.data.packing import host_bounds

VARLEN = "ppo_critic_varlen"
PACKED_IMPLEMENTATIONS = (VARLEN, "flash_attention_2", "flash_attention_3")
# what a parallelism wraps around the kernel (`around_kernel`; a stack, so nesting is harmless)
_AROUND: list[Callable[..., Tensor]] = []


@contextlib.contextmanager
def around_kernel(wrap: Callable[..., Tensor]) -> Iterator[None]:
    """Within this block, packed attention computes `wrap(attend, q, k, v)` instead of `attend(q, k, v)` (both give
    [1, nnz, H, D]): a parallelism reshards q/k/v and the output around the kernel (`parallel.ulysses`)."""
    _AROUND.append(wrap)
    try:
        yield
    finally:
        _AROUND.pop()


def varlen_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """q [1, Hq, nnz, D], k/v [1, Hkv, nnz, D] → ([1, nnz, Hq, D], None), attending within each packed sequence."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        raise ValueError(
            f"attention {VARLEN!r} needs packed inputs (cu_seq_lens_q); run the model through the critic with "
            "model.use_remove_padding=true, or choose another attn_implementation"
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"attention {VARLEN!r} does not support sliding-window layers (sliding_window is set)")
    if query.shape[0] != 1:
        raise ValueError(f"attention {VARLEN!r} expects one packed row, got a batch of {query.shape[0]}")
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    dropout = dropout if module.training else 0.0
    if _AROUND:

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return _attend(q, k, v, cu_seqlens, scaling, dropout, causal, kwargs)[0]

        return _AROUND[-1](attend, query, key, value), None
    return _attend(query, key, value, cu_seqlens, scaling, dropout, causal, kwargs)


def _attend(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scaling, dropout: float, causal: bool, kwargs: dict
) -> tuple[Tensor, None]:
    kernel = KERNELS.get(query.device.type)
    dtype = None if kernel is None else kernel_dtype(query, key, value)
    if dtype is None:  # no kernel here, or none for this dtype
        return bucketed_sdpa(query, key, value, cu_seqlens, scaling, dropout, causal), None
    max_len = int(kwargs.get("max_length_q") or int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # [nnz, H, D] in one half dtype
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return kernel(q, k, v, cu, max_len, scaling, dropout, causal).unsqueeze(0), None


def kernel_dtype(query: Tensor, key: Tensor, value: Tensor) -> torch.dtype | None:
    """The one dtype the varlen kernels (fp16 / bf16 only) get: autocast's when it is on, since transformers' RoPE
    hands q and k back in float32 beside a v in the autocast dtype; else the inputs' half dtype. None where that is
    no half dtype (float32 compute): `bucketed_sdpa` takes those."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return dtype if dtype in HALF else None
    return next((t.dtype for t in (value, query, key) if t.dtype in HALF), None)


@torch.compiler.disable  # eager inside compiled layers: the plan is Python from the data, cached across layers
def bucketed_sdpa(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float | None, dropout: float, causal: bool
) -> Tensor:
    """q [1, Hq, nnz, D], k/v [1, Hkv, nnz, D] → [1, nnz, Hq, D] through `scaled_dot_product_attention`, on any device
    and dtype: per bucket of sequences of similar length (`Buckets`), or per sequence when the cost model says that
    is faster."""
    if q.shape[2] == 0:  # no tokens at all
        return q.transpose(1, 2)
    plan = Buckets.of(cu_seqlens, q.shape[1] * q.shape[-1], q.device)
    sdpa = functools.partial(
        F.scaled_dot_product_attention, dropout_p=dropout, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    if plan.per_sequence:  # one split per tensor, not a slice per sequence: a slice's backward fills a whole row
        pieces = zip(*(t.split(plan.lengths, dim=2) for t in (q, k, v)), strict=True)
        outs = [sdpa(qs, ks, vs, is_causal=causal) for qs, ks, vs in pieces if qs.shape[2]]
        return torch.cat(outs, dim=2).transpose(1, 2)
    sizes = [n * length for n, length in plan.shapes]
    slots = [t[0].transpose(0, 1).index_select(0, plan.gather).split(sizes) for t in (q, k, v)]  # [slots, H, D]
    masks = [None] * len(sizes) if causal else plan.valid.split(sizes)
    outs = []
    for (n, length), qs, ks, vs, mask in zip(plan.shapes, *slots, masks, strict=True):
        qs, ks, vs = (t.unflatten(0, (n, length)).transpose(1, 2) for t in (qs, ks, vs))
        # non-causal: each query sees its sequence's keys only; causal: padding keys come after every valid query
        mask = None if mask is None else mask.view(n, 1, 1, length)
        outs.append(sdpa(qs, ks, vs, mask, is_causal=causal).transpose(1, 2).flatten(0, 1))
    return torch.cat(outs).index_select(0, plan.scatter).unsqueeze(0)


# The cost model that picks the buckets: forward + backward of causal `scaled_dot_product_attention` on one CPU core,
# in µs, fitted with torch 2.13 (OMP_NUM_THREADS=1) on 4 heads of 64 and of 16. A row padded to length L costs
# heads × head_dim × (LINEAR_US × L + QUADRATIC_US × L²) (measured 30 / 175 / 1477 / 17673 µs at L = 8 / 32 / 128 /
# 512 with 4 × 64; 15 / 59 / 585 / 6727 µs with 4 × 16). A call costs SEQUENCE_CALL_US on a view of the packed row
# (measured 20-50 µs) and BUCKET_CALL_US on a gathered bucket (80-100 µs); gathering the buckets and their outputs
# back costs GATHER_US per element of the packed queries (9-16 ns). Checked against measurements of the two paths
# (per sequence / buckets, ms): 96 rows of ~12 tokens, 4 × 16 heads: 6.2 / 3.0; 64 rows of 2-32 tokens, 4 × 64:
# 7.8 / 8.8; 64 rows of 24-32: 13.0 / 14.8; 8 rows of 2-384: 37 / 45. So many short sequences share a few calls,
# padding and all, and long ones (or few, or wide heads) run one call per sequence.
SEQUENCE_CALL_US = 50.0
BUCKET_CALL_US = 90.0
LINEAR_US = 0.02
QUADRATIC_US = 3e-4
GATHER_US = 0.015


@dataclass(frozen=True)
class Buckets:
    """The sequences of a packed row as padded sub-batches ("buckets") of similar lengths: bucket i holds `shapes[i]`
    = (sequences, length) right-padded slots, the buckets' slots laid out one after another."""

    lengths: tuple[int, ...]  # of the sequences, in the packed row's order
    shapes: tuple[tuple[int, int], ...]
    gather: Tensor  # [slots]: the packed token in each slot (a padding slot repeats its sequence's last token)
    valid: Tensor  # [slots] bool: the slot holds a token of its sequence, not padding
    scatter: Tensor  # [nnz]: the slot of each packed token

    @classmethod
    def of(cls, cu_seqlens: Tensor, width: int, device: torch.device) -> Buckets:
        """The buckets of `cu_seqlens` for attention of `width` = heads × head_dim; cached for the last tensor seen,
        since every layer of a forward (and of its recomputation) passes the same one (`pack` makes a new one per
        micro-batch; its version is not checked, as inference-mode tensors have none)."""
        key = (width, device)
        if _LAST_BUCKETS and _LAST_BUCKETS[0]() is cu_seqlens and _LAST_BUCKETS[1] == key:
            return _LAST_BUCKETS[2]
        buckets = cls.build(host_bounds(cu_seqlens), width).to(device)
        _LAST_BUCKETS[:] = [weakref.ref(cu_seqlens), key, buckets]
        return buckets

    @classmethod
    def build(cls, bounds: list[int], width: int) -> Buckets:
        """Sequences sorted longest first (empty ones dropped), cut into the buckets the cost model prefers."""
        lengths = [e - s for s, e in itertools.pairwise(bounds)]
        order = sorted((i for i, n in enumerate(lengths) if n), key=lambda i: -lengths[i])
        shapes = bucket_shapes([lengths[i] for i in order], width)
        lens = torch.tensor([lengths[i] for i in order], dtype=torch.long)
        starts = torch.tensor([bounds[i] for i in order], dtype=torch.long)
        rows = torch.tensor([n for n, _ in shapes], dtype=torch.long)
        padded = torch.tensor([length for _, length in shapes], dtype=torch.long).repeat_interleave(rows)
        seq = torch.arange(len(order)).repeat_interleave(padded)  # the sequence of each slot
        offset = torch.arange(len(seq)) - (padded.cumsum(0) - padded)[seq]
        valid = offset < lens[seq]
        gather = starts[seq] + torch.minimum(offset, lens[seq] - 1)
        scatter = torch.empty(bounds[-1] if bounds else 0, dtype=torch.long)
        scatter[gather[valid]] = valid.nonzero().squeeze(1)
        return cls(tuple(lengths), tuple(shapes), gather, valid, scatter)

    @property
    def per_sequence(self) -> bool:
        """One sequence per bucket: the calls then run on views of the packed row, with nothing to gather."""
        return all(n == 1 for n, _ in self.shapes)

    def to(self, device: torch.device) -> Buckets:
        """The plan's index tensors on `device`, copied from the host without a host sync."""
        return dataclasses.replace(
            self,
            gather=to_device(self.gather, device),
            valid=to_device(self.valid, device),
            scatter=to_device(self.scatter, device),
        )


_LAST_BUCKETS: list = []  # [weakref to the cu_seqlens tensor, (width, device), its Buckets]


def bucket_shapes(lengths: list[int], width: int) -> list[tuple[int, int]]:
    """Cut `lengths` (sorted longest first) into consecutive buckets of the least modelled cost, Σ over buckets of
    BUCKET_CALL_US + rows × row cost at the bucket's longest length, or one per sequence when that costs less than the
    buckets and their gathering; returns (rows, length) per bucket. Dynamic programming over the distinct lengths; a
    candidate bucket stops growing once its own cost exceeds the best total so far."""
    distinct = sorted(set(lengths), reverse=True)
    counts = collections.Counter(lengths)
    rows = [0, *itertools.accumulate(counts[n] for n in distinct)]
    row_cost = [width * (LINEAR_US * n + QUADRATIC_US * n * n) for n in distinct]
    best, cut = [0.0] + [math.inf] * len(distinct), [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        for i in range(j - 1, -1, -1):
            cost = BUCKET_CALL_US + (rows[j] - rows[i]) * row_cost[i]
            if cost >= best[j]:
                break
            if best[i] + cost < best[j]:
                best[j], cut[j] = best[i] + cost, i
    separate = SEQUENCE_CALL_US * len(lengths) + sum(counts[n] * c for n, c in zip(distinct, row_cost, strict=True))
    if separate <= best[-1] + GATHER_US * sum(lengths) * width:
        return [(1, n) for n in lengths]
    shapes, j = [], len(distinct)
    while j:
        shapes.append((rows[j] - rows[cut[j]], distinct[cut[j]]))
        j = cut[j]
    return shapes[::-1]


# One kernel per device type that has one ([nnz, H, D] q/k/v of one half dtype, int32 cu_seqlens on their device →
# [nnz, Hq, D]), resolved once by `register()`: never inside traced code, where an import or a signature lookup would
# break the graph at every attention call. A device type without a kernel, or a dtype without one, runs `bucketed_sdpa`.
Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, int, "float | None", float, bool], Tensor]
KERNELS: dict[str, Kernel] = {}
HALF = (torch.float16, torch.bfloat16)


def flash_kernel(flash_attn_varlen_func: Callable) -> Kernel:
    """flash-attn's `flash_attn_varlen_func` (GQA and dropout native)."""

    def call(q, k, v, cu, max_len, scale, dropout, causal):
        return flash_attn_varlen_func(
            q, k, v, cu, cu, max_len, max_len, dropout_p=dropout, softmax_scale=scale, causal=causal
        )

    return call


def torch_varlen_kernel(varlen_attn: Callable) -> Kernel:
    """torch's `varlen_attn`, whichever signature this torch has: causal through `window_size=(-1, 0)` or
    `is_causal`. GQA without copying K/V where the signature allows: the flash kernel underneath
    (`aten::_flash_attention_forward` / `_backward`) takes any K/V head count dividing Q's; torch 2.13 asks for
    `enable_gqa=True`, torch 2.11 (`window_size`, no `enable_gqa`) hands K/V to it unchecked, and only the older
    `is_causal` signature (whose backend choice is not pinned here) gets K/V heads repeated."""
    params = frozenset(inspect.signature(varlen_attn).parameters)
    repeat_kv = not params & {"enable_gqa", "window_size"}

    def call(q, k, v, cu, max_len, scale, dropout, causal):
        if dropout:
            raise ValueError("torch varlen_attn has no attention dropout; set the model's attention_dropout to 0")
        kwargs: dict[str, Any] = {"scale": scale}
        if q.shape[1] != k.shape[1] and "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        elif q.shape[1] != k.shape[1] and repeat_kv:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        if "window_size" in params:
            kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
        elif "is_causal" in params:
            kwargs["is_causal"] = causal
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)

    return call


def cuda_kernel() -> Kernel | None:
    """flash-attn's varlen kernel when it is installed, else torch's `varlen_attn` where this torch has it."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        pass
    else:
        return flash_kernel(flash_attn_varlen_func)
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return None
    from torch.nn.attention.varlen import varlen_attn

    return torch_varlen_kernel(varlen_attn)


@functools.cache
def register() -> str:
    """Register `ppo_critic_varlen` with transformers and resolve the CUDA kernel (once); returns its name."""
    from transformers import AttentionInterface

    kernel = cuda_kernel()
    if kernel is not None:
        KERNELS.setdefault("cuda", kernel)
    AttentionInterface.register(VARLEN, varlen_attention)
    return VARLEN


def use_packed_attention(model: nn.Module, name: str | None = None) -> str:
    """Switch `model` to a varlen attention for packed rows: `name` if given, else ours (registered here).

    Models whose attention cannot be switched (no `set_attn_implementation` / config) get a clear error.
    """
    register()
    name = name or VARLEN
    target = _switch_target(model, name)
    sub_configs = getattr(target.config, "sub_configs", {}) or {}
    if "text_config" in sub_configs:  # multimodal: only the language model runs on the packed row
        keep = {k: getattr(target.config, k)._attn_implementation or "sdpa" for k in sub_configs if k != "text_config"}
        target.set_attn_implementation({**keep, "text_config": name})
    else:
        target.set_attn_implementation(name)
    return name


def packed_blocker(model: nn.Module, name: str | None, device: torch.device) -> str | None:
    """Why `model` cannot run packed rows with attention `name` (None: ours) on `device`, or None when it can: what
    `use_remove_padding=auto` checks before it packs. Every compute dtype can (the kernels take the half ones,
    `bucketed_sdpa` the others)."""
    try:
        target = _switch_target(model, name or VARLEN)
    except ValueError as e:
        return str(e)
    if not getattr(type(target), "_supports_attention_backend", False):
        return f"{type(target).__name__} does not pass keyword arguments (the sequence bounds) to its attention"
    forward = inspect.signature(getattr(model, "module", model).forward).parameters.values()  # DDP / FSDP1: inner
    if not any(p.kind is p.VAR_KEYWORD for p in forward):
        return f"{type(model).__name__}.forward takes no **kwargs for the sequence bounds"
    if name not in (None, VARLEN):  # transformers' own varlen attention
        return None
    text = target.config.get_text_config()
    if getattr(text, "sliding_window", None) is not None and "sliding_attention" in (
        getattr(text, "layer_types", None) or ["sliding_attention"]
    ):
        return f"{VARLEN!r} has no sliding-window attention"
    register()
    if device.type == "cuda" and device.type not in KERNELS:
        return "neither flash-attn nor torch.nn.attention.varlen is available"
    return None


def _switch_target(model: nn.Module, name: str) -> nn.Module:
    """The transformers model inside `model` whose attention becomes `name`; a ValueError says why there is none."""
    if name not in PACKED_IMPLEMENTATIONS:
        raise ValueError(
            f"model.attn_implementation={name!r} cannot run packed rows; use one of {PACKED_IMPLEMENTATIONS} "
            "or model.use_remove_padding=false"
        )
    # the class's own method: FSDP1 / DDP wrappers forward attribute lookups to the model inside
    targets = [m for m in model.modules() if hasattr(type(m), "set_attn_implementation") and hasattr(m, "config")]
    if not targets:
        raise ValueError(
            f"{type(model).__name__} has no transformers model inside whose attention can be switched to {name!r}; "
            "set model.use_remove_padding=false"
        )
    return targets[0]
