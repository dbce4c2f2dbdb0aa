"""Varlen attention for packed rows, registered with transformers' `AttentionInterface` as `ppo_critic_varlen`.

The packed row holds several sequences one after another; `cu_seq_lens_q` (from `PackedBatch.model_kwargs`)
says where each starts. Attention is computed within each sequence only:
- CUDA: `flash_attn_varlen_func` when flash-attn is importable, else PyTorch's own
  `torch.nn.attention.varlen.varlen_attn` (causal through `window_size=(-1, 0)`, native GQA when available);
- CPU (and other devices): `scaled_dot_product_attention` per sequence — linear in the pack, unlike a dense
  block-diagonal mask.
No attention mask is built for this implementation (transformers skips mask creation for unknown names).
"""

from __future__ import annotations

import functools
import inspect
import itertools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppo_critic.parallel import ulysses

VARLEN = "ppo_critic_varlen"
PACKED_IMPLEMENTATIONS = (VARLEN, "flash_attention_2", "flash_attention_3")


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
    group = ulysses.active_group()
    if group is not None:  # Ulysses: my tokens × all heads → all tokens × my heads, attend, and back
        query, key, value = _ulysses_split(query, key, value, group)
        out, _ = _attend(query, key, value, cu_seqlens, scaling, dropout, causal, kwargs)
        return ulysses.heads_to_seq(out, group), None
    return _attend(query, key, value, cu_seqlens, scaling, dropout, causal, kwargs)


def _ulysses_split(q: Tensor, k: Tensor, v: Tensor, group: object) -> tuple[Tensor, Tensor, Tensor]:
    """All-to-all q/k/v from sequence shards to head shards; K/V heads are replicated when sp does not divide them."""
    import torch.distributed as dist

    sp = dist.get_world_size(group)
    if k.shape[1] % sp:
        k = k.repeat_interleave(sp // k.shape[1], dim=1)
        v = v.repeat_interleave(sp // v.shape[1], dim=1)
    return ulysses.seq_to_heads(q, group), ulysses.seq_to_heads(k, group), ulysses.seq_to_heads(v, group)


def _attend(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scaling, dropout: float, causal: bool, kwargs: dict
) -> tuple[Tensor, None]:
    if query.device.type == "cuda":
        max_len = int(kwargs.get("max_length_q") or int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))
        out = _cuda_varlen(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            cu_seqlens,
            max_len,
            scaling,
            dropout,
            causal,
        )
        return out.unsqueeze(0), None
    return _per_sequence(query, key, value, cu_seqlens, scaling, dropout, causal), None


def _per_sequence(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float | None, dropout: float, causal: bool
) -> Tensor:
    bounds = cu_seqlens.tolist()
    gqa = q.shape[1] != k.shape[1]
    outs = [
        F.scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], dropout_p=dropout, is_causal=causal, scale=scale, enable_gqa=gqa
        )
        for s, e in itertools.pairwise(bounds)
        if e > s
    ]
    return torch.cat(outs, dim=2).transpose(1, 2)


def _cuda_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float | None, dropout: float, causal: bool
) -> Tensor:
    """[nnz, H, D] tensors through flash-attn if installed, else torch's varlen_attn."""
    flash = _flash_attn_varlen()
    cu = cu.to(torch.int32)
    if flash is not None:
        return flash(q, k, v, cu, cu, max_len, max_len, dropout_p=dropout, softmax_scale=scale, causal=causal)
    from torch.nn.attention.varlen import varlen_attn

    if dropout:
        raise ValueError("torch varlen_attn has no attention dropout; set the model's attention_dropout to 0")
    params = _varlen_params()
    kwargs = {"scale": scale}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in params:
        kwargs["is_causal"] = causal
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


@functools.cache
def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@functools.cache
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


@functools.cache
def register() -> str:
    """Register `ppo_critic_varlen` with transformers (once); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    return VARLEN


def use_packed_attention(model: nn.Module, name: str | None = None) -> str:
    """Switch `model` to a varlen attention for packed rows: `name` if given, else ours (registered here).

    Models whose attention cannot be switched (no `set_attn_implementation` / config) get a clear error.
    """
    register()
    name = name or VARLEN
    if name not in PACKED_IMPLEMENTATIONS:
        raise ValueError(
            f"model.attn_implementation={name!r} cannot run packed rows; use one of {PACKED_IMPLEMENTATIONS} "
            "or model.use_remove_padding=false"
        )
    targets = [m for m in model.modules() if hasattr(m, "set_attn_implementation") and hasattr(m, "config")]
    if not targets:
        raise ValueError(
            f"{type(model).__name__} has no transformers model inside whose attention can be switched to {name!r}; "
            "set model.use_remove_padding=false"
        )
    model = targets[0]
    sub_configs = getattr(model.config, "sub_configs", {}) or {}
    if "text_config" in sub_configs:  # multimodal: only the language model runs on the packed row
        keep = {k: getattr(model.config, k)._attn_implementation or "sdpa" for k in sub_configs if k != "text_config"}
        model.set_attn_implementation({**keep, "text_config": name})
    else:
        model.set_attn_implementation(name)
    return name
