"""Ulysses sequence parallelism: each rank of an sp group holds 1/sp of the packed row; attention swaps sequence
sharding for head sharding with an all-to-all (and back), so it sees whole sequences for its heads.

The critic enters `sequence_parallel(group)` around the model call, which puts the swaps around the registered
varlen attention's kernel (`models.attention.around_kernel`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from ppo_critic.models.attention import around_kernel
from ppo_critic.parallel.collectives import all_gather, all_to_all


@contextlib.contextmanager
def sequence_parallel(group: object) -> Iterator[None]:
    """Within this block, varlen attention runs Ulysses over `group`."""
    with around_kernel(functools.partial(_ulysses_attend, group=group)):
        yield


def _ulysses_attend(
    attend: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor, group: object
) -> Tensor:
    """My tokens × all heads → all tokens × my heads, attend, and back. K/V heads are replicated when sp does not
    divide them."""
    sp = dist.get_world_size(group)
    if k.shape[1] % sp:
        k = k.repeat_interleave(sp // k.shape[1], dim=1)
        v = v.repeat_interleave(sp // v.shape[1], dim=1)
    out = attend(seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group))
    return heads_to_seq(out, group)


class _AllToAll(torch.autograd.Function):
    """Split `x` along `scatter_dim` over the group and concatenate what arrives along `gather_dim`."""

    @staticmethod
    def forward(ctx, x: Tensor, group: object, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return torch.cat(all_to_all(list(x.chunk(dist.get_world_size(group), dim=scatter_dim)), group), dim=gather_dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _AllToAll.apply(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_to_heads(x: Tensor, group: object) -> Tensor:
    """[1, H, L/sp, D] (all heads, my tokens) → [1, H/sp, L, D] (my heads, all tokens)."""
    return _AllToAll.apply(x, group, 1, 2)


def heads_to_seq(x: Tensor, group: object) -> Tensor:
    """[1, L, H/sp, D] (all tokens, my heads) → [1, L/sp, H, D] (my tokens, all heads)."""
    return _AllToAll.apply(x, group, 1, 2)


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 1 in the forward; the backward keeps this rank's slice (every rank holds the same
    loss, so summing the slices' gradients would count it sp times)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: object) -> Tensor:
        ctx.group, ctx.local = group, x.shape[1]
        return torch.cat(all_gather(x, group), dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rank = dist.get_rank(ctx.group)
        return grad[:, rank * ctx.local : (rank + 1) * ctx.local].contiguous(), None


def gather_sequence(x: Tensor, group: object) -> Tensor:
    """[1, L/sp, ...] per rank → [1, L, ...] on every rank, differentiable."""
    return _GatherSeq.apply(x, group)


def check_heads_of(model: torch.nn.Module, sp: int) -> None:
    """Fail early when the model's attention heads cannot be split over `sp` ranks."""
    config = getattr(getattr(model, "module", model), "config", None)
    if config is None:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if heads is not None:
        check_heads(heads, getattr(text, "num_key_value_heads", None) or heads, sp)


def check_heads(num_heads: int, num_kv_heads: int, sp: int) -> None:
    if num_heads % sp:
        raise ValueError(f"ulysses_sequence_parallel_size={sp} must divide the number of attention heads ({num_heads})")
    if num_kv_heads % sp and sp % num_kv_heads:
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp} and the {num_kv_heads} key/value heads must divide one another"
        )
