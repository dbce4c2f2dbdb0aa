"""Megatron-core parallel state, DDP + (distributed) optimizer around the value-model chunks, and moving HF
weights into and out of a TP × PP sharded model.

Every function is called by every rank of the job; weights travel as HF state dicts (`backends/megatron/model.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ppo_critic.backends.megatron.model import (
    Shapes,
    from_te_names,
    global_layers,
    hf_to_megatron,
    megatron_to_hf,
    to_te_names,
)
from ppo_critic.config.critic import MegatronConfig, OptimConfig
from ppo_critic.models.hf import unwrap
from ppo_critic.parallel.layout import ParallelLayout
from ppo_critic.parallel.mesh import init_distributed


def initialize(megatron: MegatronConfig, timeout_s: float = 600.0) -> None:
    """Join torchrun's process group (or a one-process group) and build megatron's TP × PP × DP groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not init_distributed(timeout_s):
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=store, rank=0, world_size=1)
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    vpp = megatron.virtual_pipeline_model_parallel_size
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (tp, pp):
            raise ValueError(
                f"megatron is already initialised with TP={ps.get_tensor_model_parallel_world_size()}, "
                f"PP={ps.get_pipeline_model_parallel_world_size()}; this critic asks for TP={tp}, PP={pp}"
            )
        return
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(
            f"world size {world} is not divisible by megatron.tensor_model_parallel_size={tp} x "
            f"pipeline_model_parallel_size={pp}; launch a multiple of {tp * pp} processes"
        )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        create_gloo_process_groups=False,
    )
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(megatron.seed)


def layout() -> ParallelLayout:
    """megatron's TP × PP × DP groups (after `initialize`) as a `ParallelLayout`: its groups wrapped, not re-created."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    model_parallel = ps.get_model_parallel_group() if tp * pp > 1 else None  # the ranks of one replica
    return ParallelLayout(
        dp=ps.get_data_parallel_world_size(),
        tp=tp,
        pp=pp,
        vpp=vpp or 1,
        dp_rank=ps.get_data_parallel_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_group=ps.get_data_parallel_group(),
        replica_group=model_parallel,
    )


def load_hf_weights(chunks: list[nn.Module], hf: Mapping[str, Tensor], shapes: Shapes) -> None:
    """Copy this rank's TP slice of the HF value-model weights into its (unwrapped) chunks; every tensor of a
    chunk must be covered, so a mismatch fails loudly instead of leaving random weights."""
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        source = hf_to_megatron(
            hf, shapes, tp_rank, tp_size, global_layers(chunk), chunk.pre_process, chunk.post_process
        )
        if any(name.endswith("layer_norm_weight") for name in params):
            source = to_te_names(source)
        missing, unused = sorted(set(params) - set(source)), sorted(set(source) - set(params))
        if missing or unused:
            raise ValueError(f"HF -> megatron conversion mismatch: missing {missing[:5]}, unused {unused[:5]}")
        with torch.no_grad():
            for name, param in params.items():
                if param.shape != source[name].shape:
                    raise ValueError(f"{name}: megatron shape {tuple(param.shape)} != HF {tuple(source[name].shape)}")
                param.copy_(source[name])


def gather_hf_weights(chunks: list[nn.Module], shapes: Shapes) -> dict[str, Tensor]:
    """The full HF value-model state dict (CPU, on every rank) from all TP and PP ranks' chunks."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local = []
    for chunk in chunks:
        chunk = unwrap(chunk)
        state = {k: v.detach().cpu() for k, v in chunk.state_dict().items() if isinstance(v, Tensor)}
        local.append((global_layers(chunk), from_te_names(state)))
    tp_parts: list[Any] = [None] * ps.get_tensor_model_parallel_world_size()
    dist.all_gather_object(tp_parts, local, group=ps.get_tensor_model_parallel_group())
    stage: dict[str, Tensor] = {}
    for index, (layers, _) in enumerate(local):
        stage |= megatron_to_hf([part[index][1] for part in tp_parts], shapes, layers)
    pp_parts: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(pp_parts, stage, group=ps.get_pipeline_model_parallel_group())
    return {k: v for part in pp_parts for k, v in part.items()}


def wrap_ddp(chunks: list[nn.Module], use_distributed_optimizer: bool) -> list[nn.Module]:
    """Megatron DDP around each chunk: fp32 gradient buffers, reduced once per step (no overlap)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer
    )
    return [
        DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]


def build_optimizer(chunks: list[nn.Module], optim: OptimConfig, grad_clip: float | None, use_distributed: bool):
    """Megatron's Adam (decoupled weight decay on every parameter, as the data-parallel worker's AdamW) or plain
    SGD over the DDP-wrapped chunks; the critic clips the gradient norm itself (to skip non-finite steps)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    tf = chunks[0].config
    config = OptimizerConfig(
        optimizer="sgd" if optim.optimizer == "sgd" else "adam",
        sgd_momentum=0.0,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=float(grad_clip or 0.0),
        bf16=tf.bf16,
        fp16=tf.fp16,
        params_dtype=tf.params_dtype,
        use_distributed_optimizer=use_distributed,
    )
    return get_megatron_optimizer(config, chunks, config_overrides={}, use_gloo_process_groups=False)
