"""Data-parallel wrapping applied to a plain model (torchtitan style), and gradient clipping that fits it.

`parallelize(model, config, device, layout)`: gradient checkpointing, then per-layer compile, then `shard` over the
layout's mesh. `shard(model, strategy, device)`: `none`, `ddp`, `fsdp` (FSDP1) or `fsdp2` (`fully_shard` per decoder
layer, then the root).
Build the optimizer *after* wrapping: FSDP replaces the parameters.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ppo_critic.config.critic import STRATEGIES, CriticConfig
from ppo_critic.models.compile import compile_decoder_layers
from ppo_critic.models.hf import ValueHead, find_value_head
from ppo_critic.parallel.collectives import all_reduce_, served_device_types
from ppo_critic.parallel.layout import ParallelLayout
from ppo_critic.parallel.master_weights import MasterWeightOptimizer
from ppo_critic.parallel.mesh import BACKEND_CUDA, compute_dtype, default_dtype


def parallelize(
    model: nn.Module, config: CriticConfig, device: torch.device, layout: ParallelLayout | None = None
) -> nn.Module:
    """`model` made ready to train as `config` says, in the one order that works: gradient checkpointing, then
    `torch.compile` per decoder layer, then `shard` in the compute dtype over `layout`'s dp × sp ranks (FSDP2 wraps
    the compiled layers); no layout: over the default process group."""
    settings = config.model
    if settings.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if settings.lora_rank:
            model.enable_input_require_grads()  # else checkpointed layers of a frozen backbone get no grads
    if settings.use_torch_compile:
        compile_decoder_layers(model)
    policy = bool(settings.fsdp_config.get("offload_policy", False))
    dtype = compute_dtype(config.torch_dtype_name, device)
    mesh = layout.shard_mesh if layout is not None else None
    return shard(model, config.strategy, device, dtype, offload_policy=policy, mesh=mesh)


def shard(
    model: nn.Module,
    strategy: str,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
    offload_policy: bool = False,
    mesh: object | None = None,
) -> nn.Module:
    """Wrap `model` for data parallelism over the ranks of the 1-D DeviceMesh `mesh` (None: the default process
    group); a no-op without a process group, or for `none`.

    `param_dtype` is the compute dtype (default: `mesh.default_dtype`, as the critic's): FSDP2 gathers the parameters
    in it for the forward and backward and reduces gradients in float32; a value head of a dtype of its own
    (`model.value_head_dtype`) keeps it. `offload_policy` (FSDP2 on CUDA only): FSDP2's `CPUOffloadPolicy` keeps the
    parameter shards, their gradients and so the optimizer state in (pinned) CPU memory, copies each layer to the
    GPU for its forward/backward, and runs the optimizer step on the CPU; the process group needs a CPU backend.
    (verl's `param_offload` / `optimizer_offload` move state between calls instead: `parallel/offload.py`.)
    """
    import torch.distributed as dist

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is unknown; expected one of {STRATEGIES}")
    if offload_policy and (strategy != "fsdp2" or device.type != "cuda" or not dist.is_initialized()):
        raise ValueError(
            "critic.model.fsdp_config.offload_policy=true needs strategy=fsdp2 on CUDA under torchrun (FSDP2's "
            f"CPUOffloadPolicy); this run has strategy={strategy}, device={device.type}, "
            f"process group={'yes' if dist.is_initialized() else 'no'}; set offload_policy=false"
        )
    if offload_policy:
        check_cpu_backend()
    if strategy == "none" or not dist.is_initialized():
        return model  # under DP the critic averages the gradients itself (average_plain_gradients)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        group = mesh.get_group() if mesh is not None else None
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, process_group=group)
    if strategy == "fsdp":
        return _apply_fsdp1(model, device, mesh)
    return _apply_fsdp2(model, param_dtype or default_dtype(device), offload_policy, mesh)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: every module inside an nn.ModuleList named `layers` / `h` / `blocks`."""
    return [
        layer
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks")
        for layer in module
    ]


def check_cpu_backend() -> None:
    """`offload_policy` reduces CPU gradients (the norm's DTensor all-reduce): the default group needs a CPU backend."""
    if "cpu" not in served_device_types():
        raise ValueError(
            "critic.model.fsdp_config.offload_policy=true needs a CPU backend in the process group (it reduces CPU "
            f"gradients), but the group was initialised with backend={torch.distributed.get_backend()!r}; "
            f"initialise it with backend={BACKEND_CUDA!r} (ppo-critic does under torchrun), or set offload_policy=false"
        )


def _apply_fsdp2(
    model: nn.Module, param_dtype: torch.dtype, offload_policy: bool = False, mesh: object | None = None
) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs: dict = {"offload_policy": CPUOffloadPolicy()} if offload_policy else {}
    if mesh is not None:
        kwargs["mesh"] = mesh
    policy = _mixed_precision(param_dtype)
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=policy, **kwargs)
    parent, name = find_value_head(model)
    head = getattr(parent, name)
    if isinstance(head, ValueHead) and head.weight.dtype != param_dtype:  # its own dtype: its own policy
        _shard(head, _mixed_precision(head.weight.dtype), kwargs)
    _shard(model, policy, kwargs)
    return model


def _shard(module: nn.Module, policy, kwargs: dict) -> None:
    """`fully_shard` of a module whose outputs the caller sees (the root, an own-dtype head): no views returned."""
    from torch.distributed.fsdp import fully_shard

    module.register_forward_hook(_outputs_not_views)  # before fully_shard's own hook, which then sees copies
    fully_shard(module, mp_policy=policy, **kwargs)


def _mixed_precision(param_dtype: torch.dtype):
    """FSDP2's policy: parameters gathered in `param_dtype`, gradients reduced in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def _outputs_not_views(module: nn.Module, args: object, output: object) -> object:
    """A `Linear(hidden, 1)` head returns its [B, T, 1] logits as a view of a 2-D matmul, and FSDP2 warns that an
    in-place op on a view would drop its pre-backward hook. Nothing here changes logits in place, but a copy of
    B×T numbers costs nothing and keeps the outputs safe (and the log free of the warning)."""
    if isinstance(output, Tensor):
        return output.clone() if output._base is not None else output
    if isinstance(output, dict):  # transformers' ModelOutput
        for key, value in output.items():
            if isinstance(value, Tensor) and value._base is not None:
                output[key] = value.clone()
    return output


def _apply_fsdp1(model: nn.Module, device: torch.device, mesh: object | None = None) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    layer_types = {type(layer) for layer in _decoder_layers(model)}
    return FullyShardedDataParallel(
        model,
        process_group=mesh.get_group() if mesh is not None else None,
        auto_wrap_policy=ModuleWrapPolicy(layer_types) if layer_types else None,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=device,
        use_orig_params=True,
        sync_module_states=device.type == "cuda",
    )


def average_plain_gradients(model: nn.Module, size: int) -> None:
    """Average gradients over all `size` ranks of the default group for an unwrapped model (strategy `none`); wrapped
    models do it themselves (DDP all-reduce, FSDP reduce-scatter)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if size == 1 or isinstance(model, DistributedDataParallel | FullyShardedDataParallel):
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if any(hasattr(g, "full_tensor") for g in grads):  # FSDP2: DTensor gradients are already reduced
        return
    for grad in grads:
        all_reduce_(grad)
        grad.div_(size)


def clip_grad_norm(model: nn.Module, max_norm: float | None, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
    """Total gradient norm over all ranks before clipping; clips when `max_norm` is set. Under `critic.param_dtype`
    (`optimizer` a `MasterWeightOptimizer`) on the float32 copies of the gradients that the optimizer steps."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    limit = float("inf") if max_norm is None else max_norm
    if isinstance(model, FullyShardedDataParallel):
        return model.clip_grad_norm_(limit)
    stepped = optimizer.stepped_parameters() if isinstance(optimizer, MasterWeightOptimizer) else model.parameters()
    params = [p for p in stepped if p.grad is not None]
    if not params:
        return torch.zeros((), device=next(model.parameters()).device)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=limit)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
