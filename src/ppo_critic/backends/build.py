"""What both backends of a `CriticWorker` build the same way: the checked config, the HF value model, the
optimizer's parameter groups, the torch optimizer (over float32 master weights under `critic.param_dtype`) and the LR
schedule. (The parallel layout each backend builds is `parallel.layout.ParallelLayout`.)"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from safetensors import SafetensorError
from torch import Tensor, nn

from ppo_critic.config.critic import CriticConfig, ModelConfig, OptimConfig
from ppo_critic.config.modes import EXPORTED_OBJECTIVE
from ppo_critic.critics.objectives import check_saved
from ppo_critic.models.hf import build_value_model, find_value_head, hf_config_for
from ppo_critic.models.lora import apply_lora
from ppo_critic.parallel.master_weights import MasterWeightOptimizer, store_in


def worker_config(config: Any) -> CriticConfig:
    """The critic config checked for what a worker builds too (model, optimizer, layout), not only the critic."""
    return CriticConfig.from_any(config, worker=True)


def model_from_config(model: ModelConfig, head_outputs: int = 1, objective: CriticConfig | None = None) -> nn.Module:
    """The value model named by `model.path` (+ `override_config`), or built from `override_config` alone, its head
    of `head_outputs` per token; with LoRA adapters (only they and the value head trainable) when `model.lora_rank`
    > 0. A saved critic whose config.json names another objective than `objective`'s is refused (`check_saved`)."""
    if model.path is None and "model_type" not in model.override_config:
        raise ValueError(
            "critic.model.path is not set; give a model directory, or a full transformers config with "
            "model_type in critic.model.override_config"
        )
    source, overrides = model_source(model)
    try:
        built = build_value_model(
            source,
            head=model.head,
            value_head_init=model.value_head_init,
            value_head_dtype=model.value_head_dtype,
            override_config=overrides,
            attn_implementation=model.attn_implementation,
            trust_remote_code=model.trust_remote_code,
            head_outputs=head_outputs,
        )
    except (MemoryError, RuntimeError, SafetensorError) as err:  # a model too large to allocate; damaged weights
        what = f"critic.model.path={model.path}" if model.path is not None else "critic.model.override_config"
        raise ValueError(f"cannot build the value model of {what}: {type(err).__name__}: {err}") from err
    if objective is not None:
        check_saved(getattr(built.config, EXPORTED_OBJECTIVE, None), objective, f"critic.model.path={model.path}")
    if model.lora_rank:
        built = apply_lora(built, model.lora_rank, model.lora_alpha, model.target_modules)
    return built


def model_source(model: ModelConfig) -> tuple[str | dict[str, Any], dict[str, Any] | None]:
    """`(source, override_config)` for transformers: the model path and its overrides, or the overrides alone as the
    whole config (None beside them). Imports `external_lib` first: it may register the model type."""
    if model.external_lib:
        importlib.import_module(model.external_lib)
    overrides = dict(model.override_config)
    return (model.path, overrides) if model.path is not None else (overrides, None)


def model_limits(model: ModelConfig) -> tuple[int | None, int | None]:
    """`(vocab_size, max_position_embeddings)` of the (text) model `model` describes, read from its config alone (no
    weights, no model built): the bounds a rollout file is checked against before the model is built."""
    config = hf_config_for(*model_source(model), model.trust_remote_code)
    text = config.get_text_config()
    return getattr(text, "vocab_size", None), getattr(text, "max_position_embeddings", None)


def export_skeleton(model: ModelConfig, hf_config: Any) -> nn.Module:
    """The value model `model` describes, on the meta device, for gathered weights to be loaded into: built from its
    resolved `hf_config`, not from `model.path` (transformers 5 refuses `from_pretrained` on the meta device)."""
    shape = replace(model, path=None, override_config=hf_config.to_dict(), value_head_init="default")
    with torch.device("meta"):
        return model_from_config(shape, getattr(hf_config, "num_labels", 1))


def param_groups(model: torch.nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    """The trainable parameters as optimizer groups: one, or with `optim.value_head_lr_ratio` != 1 the body and
    the value head, each group's `lr_ratio` (its rate over `optim.lr`) kept for a rate changed on resume."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optim.value_head_lr_ratio == 1:
        return [{"params": trainable, "lr_ratio": 1.0}]
    parent, name = find_value_head(model)
    head = {id(p) for p in getattr(parent, name).parameters()}
    ratio = optim.value_head_lr_ratio
    return [
        {"params": [p for p in trainable if id(p) not in head], "lr_ratio": 1.0},
        {"params": [p for p in trainable if id(p) in head], "lr_ratio": ratio, "lr": optim.lr * ratio},
    ]


def low_precision(model: nn.Module, config: CriticConfig) -> dict[Tensor, Tensor]:
    """`critic.param_dtype`: the model's parameters stored in it (a value head of its own `value_head_dtype` kept),
    with the float32 master copies an optimizer then steps (`build_optimizer`); nothing when it is unset."""
    name = config.param_dtype_name
    if name is None:
        return {}
    parent, head = find_value_head(model)
    keep = list(getattr(parent, head).parameters()) if config.model.value_head_dtype else []
    return store_in(model, getattr(torch, name), keep)


def build_optimizer(
    params: Any, optim: OptimConfig, masters: dict[Tensor, Tensor] | None = None
) -> torch.optim.Optimizer:
    """AdamW (verl's) or SGD over `params` with `optim`'s settings; with `masters` (of `low_precision`) it steps
    those float32 copies of the low-precision parameters (`MasterWeightOptimizer`)."""
    if masters:
        return MasterWeightOptimizer(params, masters, lambda groups: build_optimizer(groups, optim))
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
