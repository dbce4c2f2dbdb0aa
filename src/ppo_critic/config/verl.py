"""verl's critic config, in every form verl produces it, read as ppo-critic's (DESIGN §7).

verl (0.7.x, the legacy critic API) hands its critic a hydra-composed `DictConfig`, a resolved dict, or its config
dataclasses (`FSDPCriticConfig`, `McoreCriticConfig`: what its trainer really passes). `to_mapping` turns any of
them into a plain dict; `normalise` renames verl's spellings to ours the way verl itself reads them and sets aside
the keys that belong to verl's worker (optimizer construction, schedulers, engine, LoRA, ...), so the caller can
ignore them by name while a truly unknown key is still an error. Nothing here imports verl.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

HYDRA_KEYS = ("_target_", "defaults")  # hydra's instantiation hint and composition list, not settings
MISSING = "???"  # OmegaConf's "mandatory value not set"

# What verl's workers read from the critic section and the critic never does, by section (verl 0.7.x).
VERL_WORKER_KEYS: dict[str, frozenset[str]] = {
    "": frozenset(
        {
            "engine",
            "model_config",
            "ppo_infer_micro_batch_size_per_gpu",
            "ppo_infer_max_token_len_per_gpu",
            "nccl_timeout",
            "load_weight",
        }
    ),
    "model": frozenset(
        {
            "lora",
            "tiled_mlp",
            "lora_adapter_path",
            "custom_chat_template",
            "freeze_vision_tower",
            "use_fused_kernels",
            "fused_kernel_options",
            "exclude_modules",
        }
    ),
    "optim": frozenset(
        {
            "optimizer_impl",
            "override_optimizer_config",
            "clip_grad",
            "num_cycles",
            "zero_indexed_step",
            "lr_warmup_init",
            "lr_decay_steps",
            "lr_decay_style",
            "min_lr",
            "weight_decay_incr_style",
            "lr_wsd_decay_style",
            "lr_wsd_decay_steps",
            "use_checkpoint_opt_param_scheduler",
        }
    ),
    "megatron": frozenset(
        {
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
            "use_dist_checkpointing",
            "dist_checkpointing_path",
            "dist_checkpointing_prefix",
            "dist_ckpt_optim_fully_reshardable",
            "distrib_optim_fully_reshardable_mem_efficient",
            "override_ddp_config",
            "override_transformer_config",
            "override_mcore_model_config",
            "use_mbridge",
            "vanilla_mbridge",
            "use_remove_padding",
            "use_fused_kernels",
            "forward_only",
            "dtype",
            "strategy",
            "router_replay",
            "full_determinism",
            "micro_batch_size_per_gpu",
            "max_token_len_per_gpu",
            "infer_micro_batch_size_per_gpu",
            "infer_max_token_len_per_gpu",
            "use_dynamic_bsz",
        }
    ),
}

# verl-owned settings that ppo-critic's own workers cannot honour, with the values they can (anything else is an
# error there; inside verl's worker verl honours them itself). Dotted key -> allowed values.
WORKER_HONOURS: dict[str, tuple[Any, ...]] = {
    "optim.optimizer_impl": (None, "torch.optim"),
    "optim.override_optimizer_config": (None, {}),
    "optim.num_cycles": (None, 0.5),
    "optim.lr_warmup_init": (None, 0.0),
    "optim.min_lr": (None, 0.0),
    "optim.lr_decay_style": (None, "constant", "cosine"),
    "model.lora_adapter_path": (None,),
    "model.tiled_mlp.enabled": (None, False),
    "model.lora.rank": (None, 0),
    "megatron.expert_model_parallel_size": (None, 1),
    "megatron.expert_tensor_parallel_size": (None, 1),
    "megatron.use_dist_checkpointing": (None, False),
}


def to_mapping(cfg: Any) -> dict:
    """A plain nested dict of a verl critic config: a `DictConfig` (interpolations resolved), a mapping, or a
    config dataclass (verl's `BaseConfig` subclasses; `model_config` only by its type name)."""
    if type(cfg).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        try:
            cfg = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        except OmegaConfBaseException as err:
            raise ValueError(f"could not resolve the critic config: {err}") from err
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return _dataclass_dict(cfg)
    if not isinstance(cfg, Mapping):
        raise TypeError(
            "critic config must be a CriticConfig, a dict, an OmegaConf node or one of verl's critic config "
            f"dataclasses, got {type(cfg).__name__}"
        )
    return {k: _plain(v) for k, v in cfg.items()}


def _dataclass_dict(obj: Any) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        # verl's HFModelConfig holds the loaded HF config and tokenizer: named, not copied
        opaque = f.name == "model_config" and value is not None
        out[f.name] = f"<{type(value).__name__}>" if opaque else _plain(value)
    if type(obj).__module__.startswith("verl.") and not out.get("_target_"):
        out["_target_"] = f"{type(obj).__module__}.{type(obj).__qualname__}"  # built directly, not by hydra
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _dataclass_dict(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    return value


def is_verl_config(data: Mapping) -> bool:
    """Whether a critic section came from verl (its hydra yaml and its dataclasses name a `verl.` target)."""
    return str(data.get("_target_") or "").startswith("verl.")


def normalise(data: Mapping, prefix: str = "") -> tuple[dict, dict[str, Any]]:
    """`(ours, verl_keys)`: `data` with verl's spellings read as verl reads them, and the keys verl's worker owns
    (dotted names → values) set aside. `prefix` is where the section sits, for error messages."""
    from_verl = is_verl_config(data)
    data = _without_hydra_keys(data)
    set_aside: dict[str, Any] = {}
    for section, keys in VERL_WORKER_KEYS.items():
        node = data.get(section) if section else data
        if isinstance(node, dict):
            for key in sorted(keys & node.keys()):
                set_aside[f"{section}.{key}" if section else key] = node.pop(key)
    missing = sorted(prefix + key for key, value in _settings(data) if isinstance(value, str) and value == MISSING)
    if missing:
        raise ValueError(
            f"critic config value(s) {missing} are not set (verl's yaml leaves them '???' for the trainer to fill); "
            "set them, e.g. strategy=fsdp2"
        )
    strategy = data.get("strategy")
    optim = data.get("optim")
    if isinstance(optim, dict):
        _normalise_optim(optim, set_aside, megatron=strategy == "megatron")
        if strategy == "megatron" and "grad_clip" not in data and "optim.clip_grad" in set_aside:
            data["grad_clip"] = set_aside["optim.clip_grad"]  # verl's megatron critic clips with optim.clip_grad
    model = data.get("model")
    if isinstance(model, dict) and strategy == "megatron":
        overrides = model.get("override_config")
        if isinstance(overrides, dict) and set(overrides) <= {"model_config", "moe_config"}:
            # verl's megatron critic nests the HF overrides under model_config (moe_config is its worker's)
            if "moe_config" in overrides:
                set_aside["model.override_config.moe_config"] = overrides["moe_config"]
            model["override_config"] = dict(overrides.get("model_config") or {})
    megatron = data.get("megatron")
    if isinstance(megatron, dict) and megatron.get("tensor_model_parallel_size", 1) == 1:
        megatron["sequence_parallel"] = False  # verl (and megatron) switch sequence parallelism off at TP=1
    if from_verl and strategy == "megatron" and data.get("shuffle") and data.get("data_loader_seed") is None:
        data["data_loader_seed"] = 0  # verl's megatron critic shuffles with an unseeded generator: any order will do
    if from_verl and strategy != "megatron" and "shuffle" in data:
        # verl 0.7's FSDP critic splits mini-batches in order whatever `shuffle` says (its megatron critic shuffles);
        # so does ppo-critic for a verl config (opt in with PPO_CRITIC_OPTIONS="shuffle=true")
        set_aside["shuffle"] = data.pop("shuffle")
    return data, set_aside


def _normalise_optim(optim: dict, set_aside: dict[str, Any], megatron: bool) -> None:
    """verl's optimizer names (`AdamW`, megatron's `adam` = decoupled weight decay) and scheduler spellings
    (`lr_scheduler_type`, the deprecated `warmup_style` which wins when set, megatron's `lr_decay_style`)."""
    name = optim.get("optimizer")
    if isinstance(name, str):
        name = name.lower()
        optim["optimizer"] = "adamw" if megatron and name == "adam" else name
    if "grad_clip" in optim:  # verl's deprecated spelling of optim.clip_grad
        grad_clip = optim.pop("grad_clip")
        if grad_clip is not None:
            set_aside["optim.clip_grad"] = grad_clip
    style = optim.get("warmup_style")
    scheduler = optim.pop("lr_scheduler_type", None)
    decay = set_aside.get("optim.lr_decay_style")
    if style is None:
        style = scheduler or (decay if decay in ("constant", "cosine") else None)
    if style is None:
        optim.pop("warmup_style", None)
    else:
        optim["warmup_style"] = style


def worker_errors(verl_keys: Mapping[str, Any]) -> list[str]:
    """The verl-owned settings (from `normalise`) that ppo-critic's own workers would silently not honour."""
    errors = []
    for dotted, allowed in WORKER_HONOURS.items():
        value = _lookup(verl_keys, dotted)
        if value is not _ABSENT and value not in allowed:
            shown = [a for a in allowed if a is not None]
            errors.append(
                f"{dotted}={value!r} is a setting of verl's worker that ppo-critic's worker does not support; "
                f"use {' or '.join(repr(a) for a in shown)}, or run the critic inside verl's worker"
            )
    return errors


_ABSENT = object()


def _lookup(verl_keys: Mapping[str, Any], dotted: str) -> Any:
    """`verl_keys[dotted]`, or a field inside a set-aside section (`model.lora.rank` inside `model.lora`)."""
    if dotted in verl_keys:
        return verl_keys[dotted]
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        node = verl_keys.get(".".join(parts[:i]), _ABSENT)
        if node is _ABSENT:
            continue
        for part in parts[i:]:
            if not isinstance(node, Mapping) or part not in node:
                return _ABSENT
            node = node[part]
        return node
    return _ABSENT


def _without_hydra_keys(data: Mapping, top: bool = True) -> dict:
    """A copy without hydra's `_target_` (at any depth) and `defaults` (at the top)."""
    drop = HYDRA_KEYS if top else ("_target_",)
    kept = {k: v for k, v in data.items() if k not in drop}
    return {k: _without_hydra_keys(v, top=False) if isinstance(v, Mapping) else v for k, v in kept.items()}


def _settings(data: Mapping):
    """(dotted key, value) of the scalar settings ppo-critic reads: the section's own and those of model, optim,
    megatron (nested mappings such as profiler or fsdp_config are opaque)."""
    for key, value in data.items():
        if key in ("model", "optim", "megatron") and isinstance(value, Mapping):
            yield from ((f"{key}.{k}", v) for k, v in value.items() if not isinstance(v, Mapping))
        elif not isinstance(value, Mapping):
            yield key, value
