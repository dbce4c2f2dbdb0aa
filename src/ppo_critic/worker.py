"""`CriticWorker`: what a PPO trainer needs around a critic — the value model built from the config, the
optimizer, the LR schedule, checkpoints and HF export. `MegatronCriticWorker` does the same on megatron-core
(TP × PP × DP); `make_critic_worker` picks one from `strategy`.

The worker takes *global* batch sizes (verl's trainer convention) and hands the critic per-rank sizes.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import Tensor, nn

from ppo_critic.batch import Batch
from ppo_critic.checkpoint import export_hf, load_checkpoint, save_checkpoint
from ppo_critic.config import CriticConfig, ModelConfig, OptimConfig, per_rank
from ppo_critic.critics import DataParallelPPOCritic, MegatronPPOCritic
from ppo_critic.critics.base import compute_dtype
from ppo_critic.models.compile import compile_decoder_layers
from ppo_critic.models.hf import build_value_model
from ppo_critic.parallel.collectives import all_gather_rows
from ppo_critic.parallel.fsdp import parallelize
from ppo_critic.parallel.mesh import Groups, init_distributed, parallel_groups, select_device


class CriticWorker:
    """Owns model, optimizer, schedule and critic; one `update_critic` call = one schedule step."""

    def __init__(
        self,
        config: Any,
        *,
        total_steps: int | None = None,
        device: str = "auto",
        seed: int = 0,
        dist_timeout_s: float = 600.0,
    ):
        self.config = worker_config(config)
        init_distributed(dist_timeout_s)  # under torchrun: a rank stuck longer than this in a collective fails
        self.device = select_device(device)  # after: torchrun's LOCAL_RANK is the current device by then
        self.groups = parallel_groups(self.config.ulysses_sequence_parallel_size)
        self.dp_group, self.dp_size = self.groups.dp_group, self.groups.dp_size
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        optim = self.config.optim
        factor = lr_schedule(optim, optim.total_training_steps if optim.total_training_steps > 0 else total_steps)
        torch.manual_seed(seed)
        model = model_from_config(self.config.model).to(self.device)  # same seed: same weights on every rank
        self.hf_config = model.config
        if self.config.model.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable()
            if self.config.model.lora_rank:
                model.enable_input_require_grads()  # else checkpointed layers of a frozen backbone get no grads
        if self.config.model.use_torch_compile:  # before sharding: FSDP2 wraps the compiled layers
            compile_decoder_layers(model)
        offload = bool(self.config.model.fsdp_config.get("param_offload", False))
        dtype = compute_dtype(self.config, self.device)
        self.model = parallelize(model, self.config.strategy, self.device, dtype, cpu_offload=offload)
        self.optimizer = _torch_optimizer(_param_groups(self.model, optim), optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.critic = DataParallelPPOCritic(per_rank_config(self.config, self.dp_size), self.model, self.optimizer)
        self.step = 0

    def compute_values(self, batch: Any) -> Tensor:
        """Values of the whole (global) batch, in input order, on every rank; each rank computes a 1/DP share."""
        if self.dp_size == 1:
            return self.critic.compute_values(batch)
        batch = Batch.from_any(batch)
        local = self.critic.compute_values(batch.index(self._shard(len(batch), len(batch))))
        counts = [len(rows) for rows in torch.arange(len(batch)).tensor_split(self.dp_size)]
        return all_gather_rows(local, counts, self.dp_group)

    def update_critic(self, batch: Any) -> dict[str, float]:
        """One critic update on the global batch; `critic/lr` is the rate it used, then the schedule advances.
        The metrics include `perf/compute_values_*` of the latest `compute_values` (e.g. of this batch's values).

        Under DP each rank trains on its share of every global mini-batch, so a mini-batch holds the same rows
        as in a single process (without `shuffle`) and the update is the same.
        """
        if self.dp_size > 1:
            batch = Batch.from_any(batch)
            batch = batch.index(self._shard(len(batch), self.config.ppo_mini_batch_size * self.config.rollout_n))
        metrics = self.critic.update_critic(batch)
        self.scheduler.step()
        self.step += 1
        return metrics | (self.critic.last_compute_metrics or {})  # + the perf of the latest compute_values

    def save_checkpoint(
        self,
        root: str | Path,
        tensors: dict[str, Tensor] | None = None,
        state: dict[str, Any] | None = None,
        keep_last_n: int | None = None,
    ) -> Path:
        """Model, optimizer, schedule, torch RNG, step and value-normalisation statistics, plus the caller's
        `tensors` and JSON `state`."""
        own = {"rng/torch": torch.get_rng_state(), **self._value_norm_state(), **self._ema_state()}
        tensors = {**own, **(tensors or {})}
        state = {"worker_step": self.step, "scheduler": self.scheduler.state_dict(), **(state or {})}
        return save_checkpoint(root, self.step, self.model, self.optimizer, tensors, state, keep_last_n)

    def load_checkpoint(
        self,
        path: str | Path,
        tensors: dict[str, Tensor] | None = None,
        check_state: Callable[[dict[str, Any]], None] | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Restore what `save_checkpoint` wrote; `tensors` are templates (shape/dtype) for the caller's tensors.
        Nothing changes unless the checkpoint verifies and its JSON state holds what the worker and the caller's
        `check_state` need."""
        norm, ema = self._value_norm_state(), self._ema_state()
        templates = {"rng/torch": torch.get_rng_state(), **norm, **ema, **(tensors or {})}
        checks = _checks(path, check_state)
        loaded, state = load_checkpoint(path, self.model, self.optimizer, templates, checks)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["worker_step"])
        torch.set_rng_state(loaded.pop("rng/torch"))
        if norm:
            self.critic.value_norm.load_state_dict({k: loaded.pop(k) for k in norm})
        with torch.no_grad():
            for key, average in ema.items():  # DCP loads in place; copy in case a tensor came back new
                got = loaded.pop(key)
                if got is not average:
                    average.copy_(got)
        return loaded, state

    def set_learning_rate(self, lr: float) -> None:
        """A new base rate (an option changed on resume): the schedule goes on from its current step at this rate."""
        scheduler = self.scheduler
        scheduler.base_lrs = [lr * group.get("lr_ratio", 1.0) for group in self.optimizer.param_groups]
        for group, factor, base in zip(
            self.optimizer.param_groups, scheduler.lr_lambdas, scheduler.base_lrs, strict=True
        ):
            group["initial_lr"] = base
            group["lr"] = base * factor(scheduler.last_epoch)

    def _ema_state(self) -> dict[str, Tensor]:
        """The moving average of `critic.ema_decay` (the live tensors, sharded like the parameters; or nothing)."""
        return self.critic.ema.state_dict() if self.critic.ema is not None else {}

    def _value_norm_state(self) -> dict[str, Tensor]:
        """The return statistics of `critic.value_norm` (CPU copies; nothing when it is off)."""
        norm = self.critic.value_norm
        return {k: v.detach().cpu().clone() for k, v in norm.state_dict().items()} if norm.enabled else {}

    def _shard(self, batch_size: int, block: int) -> Tensor:
        """This rank's rows: inside every block of `block` rows, the rank's contiguous 1/DP slice. A last, shorter
        block (verl's short last mini-batch) is split as evenly as it goes: its slices differ by at most one row."""
        if batch_size < self.dp_size:
            raise ValueError(
                f"a batch of {batch_size} rows cannot be split over {self.dp_size} data-parallel ranks; send at "
                f"least {self.dp_size} rows"
            )
        blocks = torch.arange(batch_size).split(block)
        return torch.cat([rows.tensor_split(self.dp_size)[self.groups.dp_rank] for rows in blocks])

    def export_hf(self, out_dir: str | Path, replace: bool = False) -> Path:
        """The critic as an HF checkpoint that predicts raw values: a LoRA critic is exported merged (adapters folded
        into the base weights, so it loads without peft), and under `value_norm` the return statistics are folded
        into the value head (`w·σ`, `b·σ + μ`); under `ema_decay` the weights are the moving average. Either way the
        export gives the values `compute_values` gives. `out_dir` must not exist or be empty, unless `replace`
        (an export this worker's run wrote before: `checkpoint.export_hf`)."""
        with self.critic.averaged_weights():  # under ema_decay: the average, which compute_values uses
            return self._export_hf(out_dir, replace)

    def _export_hf(self, out_dir: str | Path, replace: bool) -> Path:
        lora, norm = bool(self.config.model.lora_rank), self.critic.value_norm
        if not lora and not norm.enabled:
            return export_hf(self.model, out_dir, replace=replace)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from ppo_critic.models.hf import find_value_head
        from ppo_critic.models.lora import merged_model

        options = StateDictOptions(full_state_dict=True, cpu_offload=torch.distributed.is_initialized())
        full = get_model_state_dict(self.model, options=options)  # a collective under DP
        if self.rank > 0:
            return export_hf(self.model, out_dir, state_dict={}, replace=replace)  # rank 0 writes; the others wait
        with torch.device("meta"):
            skeleton = model_from_config(self.config.model)
        # copies: merging and folding work in place, and the state dict may alias the live parameters
        skeleton.load_state_dict({k: v.detach().clone() for k, v in full.items()}, assign=True)
        model = merged_model(skeleton) if lora else skeleton
        if norm.enabled:
            parent, name = find_value_head(model)
            norm.fold_into(getattr(parent, name))
        return export_hf(model, out_dir, state_dict=model.state_dict(), replace=replace)


class MegatronCriticWorker(CriticWorker):
    """`CriticWorker` on megatron-core: the HF value model is built (same seed on every rank), converted to this
    rank's TP × PP slice, wrapped in megatron DDP with the (distributed) optimizer, and run by `MegatronPPOCritic`.
    A checkpoint resumes with the same layout; across layouts, go through `export_hf` and `critic.model.path`."""

    def __init__(
        self,
        config: Any,
        *,
        total_steps: int | None = None,
        device: str = "auto",
        seed: int = 0,
        dist_timeout_s: float = 600.0,
    ):
        from megatron.core import parallel_state as ps

        from ppo_critic.models.megatron import Shapes, build_megatron_value_model, check_supported, transformer_config
        from ppo_critic.parallel import megatron as mp

        self.config = worker_config(config)
        if self.config.strategy != "megatron":
            raise ValueError(f"MegatronCriticWorker needs strategy=megatron, got {self.config.strategy!r}")
        mcfg, optim = self.config.megatron, self.config.optim
        torch.manual_seed(seed)
        hf_model = model_from_config(self.config.model)  # same seed: same weights on every rank
        check_supported(
            hf_model.config,
            mcfg.tensor_model_parallel_size,
            mcfg.pipeline_model_parallel_size,
            mcfg.virtual_pipeline_model_parallel_size,
        )
        mp.initialize(mcfg, dist_timeout_s)
        self.device = select_device(device)  # after: torchrun's LOCAL_RANK is the current device by then
        self.groups = Groups(
            dp_group=ps.get_data_parallel_group(),
            dp_size=ps.get_data_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
        )
        self.dp_group, self.dp_size = self.groups.dp_group, self.groups.dp_size
        self.rank = torch.distributed.get_rank()
        self.hf_config, self.shapes = hf_model.config, Shapes.of(hf_model.config)
        dtype = compute_dtype(self.config, self.device)
        tf_config = transformer_config(self.hf_config, mcfg, dtype, use_cpu_initialization=self.device.type == "cpu")
        chunks = build_megatron_value_model(self.hf_config, tf_config)
        mp.load_hf_weights(chunks, hf_model.state_dict(), self.shapes)
        del hf_model
        with _megatron_needs_cuda(self.device):
            self.model = mp.wrap_ddp(chunks, mcfg.use_distributed_optimizer)
            self.optimizer = mp.build_optimizer(
                self.model, optim, self.config.grad_clip, mcfg.use_distributed_optimizer
            )
        factor = lr_schedule(optim, optim.total_training_steps if optim.total_training_steps > 0 else total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer.optimizer, factor)
        self.critic = MegatronPPOCritic(
            per_rank_config(self.config, self.dp_size), critic_module=self.model, critic_optimizer=self.optimizer
        )
        self.step = 0

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The critic's weights under HF value-model names (CPU, on every rank)."""
        from ppo_critic.parallel.megatron import gather_hf_weights

        return gather_hf_weights(self.model, self.shapes)

    def export_hf(self, out_dir: str | Path, replace: bool = False) -> Path:
        """The gathered HF weights (the moving average under `ema_decay`); under `value_norm` the statistics are folded
        into the head (raw values). `replace`: as for `CriticWorker.export_hf`."""
        with self.critic.averaged_weights():
            state = self.hf_state_dict()
        with torch.device("meta"):
            skeleton = model_from_config(ModelConfig(override_config=self.hf_config.to_dict()))
        norm = self.critic.value_norm
        if norm.enabled:
            head = torch.nn.Linear(state["score.weight"].shape[1], 1, dtype=state["score.weight"].dtype)
            head.load_state_dict({"weight": state["score.weight"], "bias": state["score.bias"]})
            norm.fold_into(head)
            state |= {"score.weight": head.weight.detach(), "score.bias": head.bias.detach()}
        return export_hf(skeleton, out_dir, state_dict=state, replace=replace)

    def save_checkpoint(
        self,
        root: str | Path,
        tensors: dict[str, Tensor] | None = None,
        state: dict[str, Any] | None = None,
        keep_last_n: int | None = None,
    ) -> Path:
        """Each rank's model chunks and optimizer shard (resumable with the same layout), torch RNG, schedule,
        step and the caller's `tensors` and JSON `state`."""
        from ppo_critic.checkpoint import save_state_dicts

        tensors = {"rng/torch": torch.get_rng_state(), **self._value_norm_state(), **(tensors or {})}
        state = {"worker_step": self.step, "scheduler": self.scheduler.state_dict(), **(state or {})}
        state["megatron_layout"] = self._layout()
        return save_state_dicts(root, self.step, {**self._rank_state(), "extra": tensors}, state, keep_last_n)

    def load_checkpoint(
        self,
        path: str | Path,
        tensors: dict[str, Tensor] | None = None,
        check_state: Callable[[dict[str, Any]], None] | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        from ppo_critic.checkpoint import load_state_dicts

        def same_layout(state: dict[str, Any]) -> None:
            saved = state.get("megatron_layout")
            if saved != self._layout():
                raise ValueError(
                    f"checkpoint {path} was written with the megatron layout {saved}, this job runs "
                    f"{self._layout()}; resume with the same layout, or export it to HF and start from that with "
                    "critic.model.path"
                )
            if check_state is not None:
                check_state(state)

        norm = self._value_norm_state()
        extra = {"rng/torch": torch.get_rng_state(), **norm, **(tensors or {})}
        state_dict = {**self._rank_state(), "extra": extra}
        # fills model, optimizer state and main params in place, once the files verify and the state passes
        state = load_state_dicts(path, state_dict, _checks(path, same_layout))
        self.scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr  # the rate of the saved step (param groups are not in the checkpoint)
        self.step = int(state["worker_step"])
        extra = state_dict["extra"]
        torch.set_rng_state(extra.pop("rng/torch"))
        if norm:
            self.critic.value_norm.load_state_dict({k: extra.pop(k) for k in norm})
        return extra, state

    def _layout(self) -> dict[str, int]:
        from megatron.core import parallel_state as ps

        return {
            "world": torch.distributed.get_world_size(),
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "vpp": len(self.model),
        }

    def _rank_state(self) -> dict[str, Any]:
        """This rank's tensors under rank-unique names: model chunks, the inner optimizer's state and the
        parameters it steps (fp32 main copies, or shards of them with the distributed optimizer)."""
        from ppo_critic.parallel.megatron import unwrap

        inner = self.optimizer.optimizer
        if not inner.state:  # a fresh optimizer: create its state with a step that changes nothing
            _zero_step(inner)
        params = [p for group in inner.param_groups for p in group["params"]]
        model = {
            f"chunk{i}.{k}": v
            for i, chunk in enumerate(self.model)
            for k, v in unwrap(chunk).state_dict().items()
            if isinstance(v, Tensor)
        }
        optim = {
            "main": {str(i): p.data for i, p in enumerate(params)},
            "state": {str(i): inner.state[p] for i, p in enumerate(params) if p in inner.state},
        }
        rank = f"rank{self.rank}"
        ema = {"ema": {rank: self.critic.ema.state_dict()}} if self.critic.ema is not None else {}
        return {"model": {rank: model}, "optim": {rank: optim}, **ema}


def _zero_step(optimizer: torch.optim.Optimizer) -> None:
    """One step with zero gradients and learning rate 0: the optimizer's state exists, the parameters are untouched."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        group["lr"] = lr
        for p in group["params"]:
            p.grad = None


@contextlib.contextmanager
def _megatron_needs_cuda(device: torch.device) -> Iterator[None]:
    """megatron-core puts its gradient buffers and optimizer state on CUDA whatever the device; on a machine without
    CUDA say so, instead of torch's bare "Torch not compiled with CUDA enabled" (a CPU build) or "Found no NVIDIA
    driver" (a CUDA build) from deep inside it."""
    try:
        yield
    except (AssertionError, RuntimeError) as err:
        if device.type == "cuda" or torch.cuda.is_available():
            raise
        raise ValueError(
            "critic.strategy=megatron needs CUDA GPUs (megatron-core allocates its gradient buffers on CUDA); on "
            f"this machine use critic.strategy=fsdp2, ddp or none ({err})"
        ) from err


def make_critic_worker(config: Any, **kwargs: Any) -> CriticWorker:
    """`MegatronCriticWorker` for `strategy: megatron`, else `CriticWorker`."""
    config = CriticConfig.from_any(config)
    return (MegatronCriticWorker if config.strategy == "megatron" else CriticWorker)(config, **kwargs)


def _checks(path: str | Path, caller: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None]:
    """What a worker needs of a checkpoint's JSON state (its step and LR schedule), then the caller's checks."""

    def check(state: dict[str, Any]) -> None:
        step, schedule = state.get("worker_step"), state.get("scheduler")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0 or not isinstance(schedule, dict):
            raise ValueError(
                f"checkpoint {path} is damaged: its trainer_state.json lacks a valid worker_step or scheduler"
            )
        if caller is not None:
            caller(state)

    return check


def worker_config(config: Any) -> CriticConfig:
    """The critic config checked for what a worker builds too (model, optimizer, layout), not only the critic."""
    return CriticConfig.from_any(config, worker=True)


def model_from_config(model: ModelConfig) -> nn.Module:
    """The value model named by `model.path` (+ `override_config`), or built from `override_config` alone; with
    LoRA adapters (only they and the value head trainable) when `model.lora_rank` > 0."""
    if model.external_lib:
        importlib.import_module(model.external_lib)
    if model.path is None and "model_type" not in model.override_config:
        raise ValueError(
            "critic.model.path is not set; give a model directory, or a full transformers config with "
            "model_type in critic.model.override_config"
        )
    overrides = dict(model.override_config)
    source = model.path if model.path is not None else overrides
    try:
        built = build_value_model(
            source,
            head=model.head,
            value_head_init=model.value_head_init,
            value_head_dtype=model.value_head_dtype,
            override_config=overrides if model.path is not None else None,
            attn_implementation=model.attn_implementation,
            trust_remote_code=model.trust_remote_code,
        )
    except (MemoryError, RuntimeError, SafetensorError) as err:  # a model too large to allocate; damaged weights
        what = f"critic.model.path={model.path}" if model.path is not None else "critic.model.override_config"
        raise ValueError(f"cannot build the value model of {what}: {type(err).__name__}: {err}") from err
    if model.lora_rank:
        from ppo_critic.models.lora import apply_lora

        built = apply_lora(built, model.lora_rank, model.lora_alpha, model.target_modules)
    return built


def per_rank_config(config: CriticConfig, dp_size: int) -> CriticConfig:
    """Global sizes (× `rollout_n`) divided over `dp_size` ranks, as the critic expects (DESIGN §3) and as verl's
    worker does: `ppo_mini_batch_size` is global, `*_per_gpu` sizes are per rank, verl's deprecated global
    micro-batch sizes are divided too. Errors name the keys the user set (the `critic.` section)."""
    cfg = copy.deepcopy(config)
    mini = config.ppo_mini_batch_size * config.rollout_n
    global_mini = f"critic.ppo_mini_batch_size={config.ppo_mini_batch_size} (global) × rollout_n={config.rollout_n}"
    if mini % dp_size:
        raise ValueError(
            f"{global_mini} is not divisible by the {dp_size} data-parallel ranks; choose a multiple of {dp_size}"
        )
    cfg.ppo_mini_batch_size = mini // dp_size
    cfg.ppo_micro_batch_size_per_gpu = per_rank(
        config.ppo_micro_batch_size_per_gpu, config.ppo_micro_batch_size, dp_size
    )
    cfg.forward_micro_batch_size_per_gpu = per_rank(
        config.forward_micro_batch_size_per_gpu, config.forward_micro_batch_size, dp_size
    )
    cfg.ppo_micro_batch_size = cfg.forward_micro_batch_size = None
    micro = cfg.ppo_micro_batch_size_per_gpu
    if not config.use_dynamic_bsz and micro is not None and cfg.ppo_mini_batch_size % micro:
        key = (
            "ppo_micro_batch_size_per_gpu"
            if config.ppo_micro_batch_size_per_gpu is not None
            else "ppo_micro_batch_size"
        )
        typed = getattr(config, key)
        raise ValueError(
            f"critic.{key}={typed} does not divide the per-GPU mini-batch of {cfg.ppo_mini_batch_size} rows "
            f"({global_mini} over {dp_size} data-parallel ranks); set critic.ppo_micro_batch_size_per_gpu to a "
            f"divisor of {cfg.ppo_mini_batch_size}, or null for one micro-batch per mini-batch"
        )
    cfg.validate()
    return cfg


def _param_groups(model: torch.nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    """The trainable parameters as optimizer groups: one, or with `optim.value_head_lr_ratio` != 1 the body and
    the value head, each group's `lr_ratio` (its rate over `optim.lr`) kept for a rate changed on resume."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optim.value_head_lr_ratio == 1:
        return [{"params": trainable, "lr_ratio": 1.0}]
    from ppo_critic.models.hf import find_value_head

    parent, name = find_value_head(model)
    head = {id(p) for p in getattr(parent, name).parameters()}
    ratio = optim.value_head_lr_ratio
    return [
        {"params": [p for p in trainable if id(p) not in head], "lr_ratio": 1.0},
        {"params": [p for p in trainable if id(p) in head], "lr_ratio": ratio, "lr": optim.lr * ratio},
    ]


def _torch_optimizer(params: Any, optim: OptimConfig) -> torch.optim.Optimizer:
    if optim.optimizer == "sgd":
        return torch.optim.SGD(params, lr=optim.lr, weight_decay=optim.weight_decay)
    return torch.optim.AdamW(
        params,
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        fused=optim.fused,
    )


def lr_schedule(optim: OptimConfig, total_steps: int | None) -> Callable[[int], float]:
    """LR factor per update: linear warmup, then constant or cosine down to `min_lr_ratio` at `total_steps`."""
    if optim.warmup_style == "cosine" and not total_steps:
        raise ValueError("optim.warmup_style=cosine needs optim.total_training_steps (or the trainer's step count)")
    warmup = (
        optim.lr_warmup_steps if optim.lr_warmup_steps > 0 else int(optim.lr_warmup_steps_ratio * (total_steps or 0))
    )
    floor = optim.min_lr_ratio or 0.0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.warmup_style == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
