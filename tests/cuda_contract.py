"""Test-only stand-ins for CUDA-only kernels that enforce their documented input contracts on the CPU, so that CPU
tests run our CUDA dispatch branch itself (DESIGN §8). Never imported by the library.

`check_collective_devices()` holds every tensor a torch.distributed collective is handed, inputs and outputs, to
the devices its group's backend takes (NCCL: CUDA only), all on one device; FSDP2's too where it would issue one,
also at one rank, where it issues none.

The varlen attention kernels (flash-attn's `flash_attn_varlen_func`, torch's `torch.nn.attention.varlen.varlen_attn`)
take q [T, Hq, D] and k/v [T, Hkv, D] of one dtype, float16 or bfloat16, with a contiguous last dimension; int32
`cu_seqlens` [N + 1] on q's device, 0 first and T last; Python-int maximum lengths that bound every sequence; GQA
only when Hkv divides Hq (torch 2.13's `varlen_attn`: only with `enable_gqa=True`; torch 2.11's has no such flag
and hands K/V to the same flash kernel as they are). They return [T, Hq, D] in q's dtype.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ppo_critic.parallel.collectives import served_device_types

HALF = (torch.float16, torch.bfloat16)


class ContractError(AssertionError):
    """An input the real kernel would refuse (or misread)."""


def check_varlen_inputs(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q, max_k, gqa: bool) -> None:
    """Raise `ContractError` for any input the CUDA varlen kernels do not accept."""
    dtypes = {t.dtype for t in (q, k, v)}
    if len(dtypes) != 1 or not dtypes <= set(HALF):
        raise ContractError(f"q/k/v must share one dtype, float16 or bfloat16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if any(t.dim() != 3 for t in (q, k, v)) or k.shape != v.shape or q.shape[::2] != k.shape[::2]:
        raise ContractError(f"layout must be [T, H, D]; got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ContractError("q/k/v need a contiguous last dimension")
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv or (hq != hkv and not gqa):
        raise ContractError(f"{hq} query heads and {hkv} key/value heads: GQA not allowed here")
    for cu, longest in ((cu_q, max_q), (cu_k, max_k)):
        _check_cu_seqlens(cu, longest, q)


def _check_cu_seqlens(cu: Tensor, longest, q: Tensor) -> None:
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device:
        raise ContractError(f"cu_seqlens must be 1-D int32 on {q.device}; got {cu.dtype} {list(cu.shape)} {cu.device}")
    if int(cu[0]) != 0 or int(cu[-1]) != q.shape[0] or bool((cu.diff() < 0).any()):
        raise ContractError(f"cu_seqlens {cu.tolist()} must rise from 0 to T={q.shape[0]}")
    if type(longest) is not int or longest < int(cu.diff().max()):
        raise ContractError(f"max length {longest!r} must be a Python int >= every sequence length")


def reference_varlen(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, scale: float | None, causal: bool) -> Tensor:
    """Attention within each sequence in float32 (sdpa per sequence), returned in q's dtype."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    bounds = cu.tolist()
    outs = [
        F.scaled_dot_product_attention(
            *(t[s:e].transpose(0, 1).float() for t in (q, k, v)), is_causal=causal, scale=scale
        ).transpose(0, 1)
        for s, e in itertools.pairwise(bounds)
        if e > s
    ]
    return torch.cat(outs).to(q.dtype) if outs else q.clone()


class Calls:
    """Records every kernel call's dtype and (query, key/value) head counts, so a test can tell that the kernel branch
    ran and whether K/V reached it repeated."""

    def __init__(self):
        self.dtypes: list[torch.dtype] = []
        self.heads: list[tuple[int, int]] = []

    def record(self, q: Tensor, k: Tensor) -> None:
        self.dtypes.append(q.dtype)
        self.heads.append((q.shape[1], k.shape[1]))


def torch_varlen_attn(calls: Calls, signature: str = "2.13"):
    """A stand-in for torch's `varlen_attn` with one of its signatures, exactly: "2.13" (causal by `window_size`, GQA
    only with `enable_gqa=True`, which its Python wrapper checks), "2.11" (causal by `window_size`, no `enable_gqa`:
    K/V go unchecked to the flash kernel, which takes any head count dividing Q's), or "older" (causal by `is_causal`,
    no GQA)."""

    def run(q, k, v, cu_q, cu_k, max_q, max_k, scale, gqa, window_size=None, causal=False):
        if window_size is not None:
            if tuple(window_size) not in ((-1, -1), (-1, 0)):
                raise ContractError(f"window_size {window_size} is a sliding window")
            causal = tuple(window_size) == (-1, 0)
        check_varlen_inputs(q, k, v, cu_q, cu_k, max_q, max_k, gqa)
        calls.record(q, k)
        return reference_varlen(q, k, v, cu_q, scale, causal)

    def varlen_attn_2_13(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, enable_gqa, window_size)

    def varlen_attn_2_11(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
    ):
        return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, True, window_size)

    def varlen_attn_older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, *, scale=None):
        return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, False, causal=is_causal)

    return {"2.13": varlen_attn_2_13, "2.11": varlen_attn_2_11, "older": varlen_attn_older}[signature]


def flash_attn_varlen_func(calls: Calls):
    """A stand-in for flash-attn's `flash_attn_varlen_func` (GQA native, dropout as a float)."""

    def flash(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False
    ):
        check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, gqa=True)
        if not isinstance(dropout_p, float):
            raise ContractError(f"dropout_p must be a float, got {dropout_p!r}")
        calls.record(q, k)
        return reference_varlen(q, k, v, cu_seqlens_q, softmax_scale, causal)

    return flash


@torch.library.custom_op("ppo_critic_test::varlen_attn", mutates_args=())
def varlen_attn_op(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, causal: bool) -> Tensor:
    """The stand-in as an opaque operator, as torch's `varlen_attn` is one: what torch.compile sees of a kernel."""
    check_varlen_inputs(q, k, v, cu, cu, max_len, max_len, gqa=True)
    return reference_varlen(q, k, v, cu, None, causal)


@varlen_attn_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, causal: bool) -> Tensor:
    return torch.empty_like(q)


def opaque_kernel(q, k, v, cu, max_len, scale, dropout, causal):
    """A kernel for `attention.KERNELS` made of the opaque operator (no scale, no dropout)."""
    return varlen_attn_op(q, k, v, cu, max_len, causal)


WATCHED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",  # FSDP's up to torch 2.12
    "all_gather_single",  # FSDP's from torch 2.13
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
)
FSDP_GATHERS = {"all_gather_into_tensor", "all_gather_single"}


def check_collective_devices(monkeypatch=None) -> collections.Counter:
    """From now on in this process (in this test, given pytest's `monkeypatch`), a torch.distributed collective
    handed a tensor on a device its group's backend does not take, or tensors on two devices, raises `ContractError`;
    returns the count of checked calls by name (so a test can tell the check ran). Collectives called through
    `torch.distributed`'s module attributes are seen: ours, FSDP's and DDP's Python side. FSDP2 is also checked where
    it chooses to communicate (`FSDP2_POINTS`), at any rank count: a one-rank run issues no collective at all (FSDP2
    skips its own, the critic its), yet what a second rank would hand the backend is checked there."""
    counts: collections.Counter = collections.Counter()
    patch = setattr if monkeypatch is None else monkeypatch.setattr
    for name in (n for n in WATCHED if hasattr(dist, n)):
        patch(dist, name, _checked(getattr(dist, name), name, counts))
    _check_fsdp2(patch, counts)
    return counts


# Where FSDP2's parameter group chooses to communicate, on its `device` (offloaded shards are copied there first).
# At one rank torch 2.11 returns from `unshard` before its all-gather and `foreach_reduce` copies the gradients
# instead of reduce-scattering them; at more ranks they issue the all-gather and reduce-scatter seen above.
FSDP2_POINTS = {"fsdp2_unshard", "fsdp2_foreach_reduce"}


def _check_fsdp2(patch, counts: collections.Counter) -> None:
    """Check the all-gather behind `FSDPParamGroup.unshard` (on the group's device) and the gradients and device
    handed to `foreach_reduce`, against the backends of the groups FSDP2 would use."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp2
    except ImportError:  # a torch without FSDP2
        return
    unshard = fsdp2.FSDPParamGroup.unshard

    @functools.wraps(unshard)
    def checked_unshard(self, *args, **kwargs):
        _check("fsdp2_unshard", {self.device}, self._all_gather_process_group, counts)
        return unshard(self, *args, **kwargs)

    patch(fsdp2.FSDPParamGroup, "unshard", checked_unshard)
    reduce = _checked(fsdp2.foreach_reduce, "fsdp2_foreach_reduce", counts, group="reduce_scatter_group")
    patch(fsdp2, "foreach_reduce", reduce)


def _checked(collective, name: str, counts: collections.Counter, group: str = "group"):
    """`collective` checking the devices of its tensor (and `torch.device`) arguments against its `group` argument."""
    signature = inspect.signature(collective)

    @functools.wraps(collective)
    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        devices = {d for value in bound.arguments.values() for d in _devices(value)}
        _check(name, devices, bound.arguments.get(group), counts)
        return collective(*args, **kwargs)

    return call


def _check(name: str, devices: set[torch.device], group, counts: collections.Counter) -> None:
    served = served_device_types(group)
    if len(devices) > 1 or any(d.type not in served for d in devices):
        raise ContractError(f"{name} was handed tensors on {sorted(map(str, devices))}; its backend takes {served}")
    counts[name] += 1


def _devices(value) -> list[torch.device]:
    if isinstance(value, Tensor):
        return [value.device]
    if isinstance(value, torch.device):
        return [value]
    if isinstance(value, list | tuple):
        return [d for item in value for d in _devices(item)]
    return []
