"""verl's critic config, in every form verl produces it, read as ppo-critic's (DESIGN §7): the one home of "which verl
key means what" for both integrations. Nothing here imports verl (or torch).

verl 0.7.x (the legacy critic API) hands its critic a hydra-composed `DictConfig`, a resolved dict, or its config
dataclasses (`FSDPCriticConfig`, `McoreCriticConfig`: what its trainer really passes). `to_mapping` turns any of
them into a plain dict; `normalise` renames verl's spellings to ours the way verl itself reads them and sets aside
the keys that belong to verl's worker (optimizer construction, schedulers, engine, LoRA, ...), so the caller can
ignore them by name while a truly unknown key is still an error.

verl ≥ 0.9 (`critic.strategy=ppo_critic`) hands ppo-critic's engine its model, engine and optimizer configs instead.
`engine_keys` sorts every key of them into those ppo-critic takes over and those that are verl's and change nothing
the critic computes, and refuses in one line each key whose meaning ppo-critic cannot give; `engine_section` is the
critic section the engine builds from the keys it takes over.
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


# verl 0.7 under `trainer.use_legacy_worker_impl=disable` trains an FSDP critic on its engine worker (`TrainingWorker`),
# not on the `CriticWorker` whose critic ppo_critic.integrations.verl replaces
LEGACY_WORKER_ERROR = (
    "trainer.use_legacy_worker_impl=disable makes verl 0.7 train the critic on its own engine worker, which "
    "ppo_critic.integrations.verl does not replace; set trainer.use_legacy_worker_impl=auto (or, with verl >= 0.9, "
    "critic.strategy=ppo_critic)"
)


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


# verl ≥ 0.9 (`critic.strategy=ppo_critic`): the keys of the model, engine and optimizer configs verl's TrainingWorker
# hands the engine, named `<section>.<key>` as the user writes them under `critic.` (section: model, fsdp, optim).
ENGINE_SECTIONS = {"FSDPEngineConfig": "fsdp"}  # verl's engine dataclass -> its section (the only one routed to us)
# what the engine takes over -> ppo-critic's field it sets (`engine_section`)
ENGINE_FIELDS: dict[str, str] = {
    "model.path": "model.path",
    "model.local_path": "model.path",  # where verl resolved model.path to (wins when set)
    "model.override_config": "model.override_config",
    "model.trust_remote_code": "model.trust_remote_code",
    "model.external_lib": "model.external_lib",
    "model.use_remove_padding": "model.use_remove_padding",
    "model.enable_gradient_checkpointing": "model.enable_gradient_checkpointing",
    "model.lora_rank": "model.lora_rank",
    "model.lora_alpha": "model.lora_alpha",
    "model.target_modules": "model.target_modules",
    "fsdp.micro_batch_size_per_gpu": "ppo_micro_batch_size_per_gpu",
    "fsdp.infer_micro_batch_size_per_gpu": "forward_micro_batch_size_per_gpu",
    "fsdp.use_dynamic_bsz": "use_dynamic_bsz",
    "fsdp.max_token_len_per_gpu": "ppo_max_token_len_per_gpu",
    "fsdp.infer_max_token_len_per_gpu": "forward_max_token_len_per_gpu",
    "fsdp.ulysses_sequence_parallel_size": "ulysses_sequence_parallel_size",
    "fsdp.param_offload": "model.fsdp_config.param_offload",
    "fsdp.optimizer_offload": "model.fsdp_config.optimizer_offload",
    "fsdp.offload_policy": "model.fsdp_config.offload_policy",
    "optim.clip_grad": "grad_clip",
    **{
        f"optim.{key}": f"optim.{key}"  # read with verl's spellings by `normalise`
        for key in (
            *("optimizer", "lr", "betas", "weight_decay", "lr_warmup_steps", "lr_warmup_steps_ratio"),
            *("total_training_steps", "lr_scheduler_type", "warmup_style", "min_lr_ratio"),
        )
    },
}
# taken over without a config field of their own: the engine seeds its worker with fsdp.seed, verl copies grad_clip
# into clip_grad, and dtype and mixed_precision make ppo-critic's compute dtype (`_compute_dtype`)
ENGINE_HONOURS = frozenset(ENGINE_FIELDS) | {"fsdp.seed", "optim.grad_clip", "fsdp.dtype", "fsdp.mixed_precision"}
# verl's engine dtype -> ppo-critic's (bfloat16: ppo-critic's default, bf16 autocast on CUDA and fp32 on CPU)
ENGINE_DTYPES = {
    "bfloat16": None,
    "bf16": None,
    "float16": "float16",
    "fp16": "float16",
    "float32": "float32",
    "fp32": "float32",
}
# verl's spellings of `mixed_precision`'s dtypes (its PrecisionType) -> ppo-critic's compute dtype
PRECISIONS = {**ENGINE_DTYPES, 16: "float16", "16": "float16", 32: "float32", "32": "float32"}
FP32 = tuple(key for key, dtype in PRECISIONS.items() if dtype == "float32")
# keys whose meaning ppo-critic cannot give unless they hold one of these values: -> (values, why and what to use)
ENGINE_REFUSES: dict[str, tuple[tuple[Any, ...], str]] = {
    "fsdp.dtype": (tuple(ENGINE_DTYPES), "the engine computes in bfloat16, float16 or float32; use one of them"),
    "fsdp.forward_only": ((False, None), "the engine trains the critic (verl sets it for frozen models); set false"),
    "fsdp.model_dtype": (
        ("fp32", "float32", None),
        "ppo-critic keeps float32 parameters; set fp32 and pick the compute dtype with critic.fsdp.dtype",
    ),
    "fsdp.mixed_precision.param_dtype": ((None, *PRECISIONS), "the engine computes in bf16, fp16 or fp32; use one"),
    "fsdp.mixed_precision.reduce_dtype": ((None, *FP32), "ppo-critic reduces gradients in float32; set fp32"),
    "fsdp.mixed_precision.buffer_dtype": ((None, *FP32), "ppo-critic keeps buffers in float32; set fp32"),
    "fsdp.full_determinism": ((False,), "ppo-critic does not switch torch to deterministic algorithms; set false"),
    "fsdp.qat.enable": ((False,), "quantization-aware training is not supported; set false"),
    "fsdp.router_replay.mode": (("disabled",), "MoE router replay is not supported; set disabled"),
    "model.enable_activation_offload": (
        (False,),
        "activation offload is not supported; set false (critic.model."
        "enable_gradient_checkpointing=true saves activation memory)",
    ),
    "model.lora_adapter_path": ((None,), "a LoRA adapter cannot be loaded; merge it into critic.model.path"),
    "model.exclude_modules": ((None, "", []), "LoRA adapters go on critic.model.target_modules; remove it"),
    "model.target_parameters": ((None, []), "LoRA adapters go on critic.model.target_modules; remove it"),
    "model.tiled_mlp.enabled": ((False,), "tiled MLP is not supported; set false"),
    "model.mtp.enable": ((False,), "the value model has no multi-token prediction layers; set false"),
    "model.mtp.enable_train": ((False,), "the value model has no multi-token prediction layers; set false"),
    "model.lora.rank": ((0, None), "that is verl's megatron LoRA; use critic.model.lora_rank"),
    "optim.optimizer_impl": ((None, "torch.optim"), "the engine builds torch's AdamW or SGD; use torch.optim"),
    "optim.override_optimizer_config": ((None, {}), "the engine's optimizer takes critic.optim's keys; remove it"),
    "optim.num_cycles": ((None, 0.5), "the cosine schedule decays over half a cycle; set 0.5"),
}
# verl's own: what verl reads around the engine, and its FSDP engine's tuning knobs (ppo-critic wraps, compiles and
# prefetches by its own rules); none changes what the critic computes. Keys of ENGINE_REFUSES at an allowed value too.
ENGINE_VERLS = frozenset(
    {f"fsdp.{k}" for k in ("strategy", "use_remove_padding", "use_fused_kernels", "wrap_policy", "fsdp_size")}
    | {f"fsdp.{k}" for k in ("reshard_after_forward", "forward_prefetch", "use_orig_params", "use_torch_compile")}
    | {f"fsdp.{k}" for k in ("use_no_sync_for_gradient_accumulation", "pad_to_length", "pad_to_length_bucket")}
    | {f"fsdp.{k}" for k in ("entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size")}
    | {"fsdp.entropy_checkpointing", "fsdp.turbo_config", "optim.zero_indexed_step"}
    | {f"model.{k}" for k in ("tokenizer_path", "local_tokenizer_path", "hf_config_path", "local_hf_config_path")}
    | {f"model.{k}" for k in ("hf_config", "generation_config", "tokenizer", "processor", "load_tokenizer")}
    | {f"model.{k}" for k in ("model_type", "architectures", "use_shm", "custom_chat_template", "use_liger")}
    | {"model.use_fused_kernels", "model.fused_kernel_options"}
)


@dataclasses.dataclass(frozen=True)
class EngineKeys:
    """verl's settings as ppo-critic's engine takes them (`<section>.<key>` -> value): `honoured` take effect in
    ppo-critic's critic; `verls` are read by verl itself or change nothing the critic computes."""

    honoured: dict[str, Any]
    verls: dict[str, Any]


def engine_keys(model: Mapping, engine: Mapping, optim: Mapping) -> EngineKeys:
    """Every key of verl's model, engine and optimizer configs (plain mappings, `to_mapping`) sorted as ppo-critic's
    engine takes it. Raises one ValueError naming each key that ppo-critic cannot honour, why and what to use."""
    keys = EngineKeys({}, {})
    errors: list[str] = []
    for section, node in (("model", model), (_engine_section(engine), engine), ("optim", optim)):
        for key, value in node.items():
            if key not in HYDRA_KEYS:
                errors += _sort_key(f"{section}.{key}", value, keys)
    errors += _conflicts(model, engine)
    if errors:
        raise ValueError(" | ".join(errors))
    return keys


def _sort_key(dotted: str, value: Any, keys: EngineKeys) -> list[str]:
    """Put `dotted` into `keys.honoured` or `keys.verls`; the errors it (or a setting inside it) raises."""
    rules = list(_refusable(dotted, value))
    errors = [error for rule, inner in rules if (error := _refusal(rule, inner))]
    if dotted in ENGINE_HONOURS:
        keys.honoured[dotted] = value
    elif dotted in ENGINE_VERLS or rules or _is_off(value):
        keys.verls[dotted] = value
    else:
        errors.append(
            f"critic.{dotted}={value!r} is a verl setting the ppo_critic engine does not know (it knows verl 0.9's); "
            "remove it, or run verl's own engine (critic.strategy=fsdp2) for it"
        )
    return errors


def _conflicts(model: Mapping, engine: Mapping) -> list[str]:
    """The errors no single key's rule finds: settings that ppo-critic honours one by one but not together, and a
    `mixed_precision` that is not verl's mapping."""
    found = (_unpacked_ulysses(model, engine), _dtype_conflict(engine), _precision_not_a_mapping(engine))
    return [error for error in found if error]


def _unpacked_ulysses(model: Mapping, engine: Mapping) -> str | None:
    """Ulysses splits one packed row of a micro-batch's tokens over its ranks: it needs packing."""
    sp_size = engine.get("ulysses_sequence_parallel_size") or 1
    if sp_size == 1 or model.get("use_remove_padding") is not False:
        return None
    return (
        f"critic.fsdp.ulysses_sequence_parallel_size={sp_size} needs critic.model.use_remove_padding=true (Ulysses "
        "shards packed sequences); set critic.model.use_remove_padding=true, or "
        "critic.fsdp.ulysses_sequence_parallel_size=1"
    )


def _dtype_conflict(engine: Mapping) -> str | None:
    """`mixed_precision.param_dtype` and `dtype` both name the compute dtype: set, they must agree (verl's default
    `dtype`, bfloat16, gives way, as in verl's FSDP engine, which computes in param_dtype)."""
    param, dtype = _param_dtype(engine.get("mixed_precision")), engine.get("dtype")
    if param not in tuple(PRECISIONS) or dtype not in tuple(ENGINE_DTYPES):
        return None  # unset, or refused by its own rule
    if ENGINE_DTYPES[dtype] in (None, PRECISIONS[param]):
        return None
    ours = PRECISIONS[param] or "bfloat16"
    return (
        f"critic.fsdp.mixed_precision.param_dtype={param!r} disagrees with critic.fsdp.dtype={dtype!r} (both set the "
        f"compute dtype; verl's FSDP engine takes param_dtype); set critic.fsdp.dtype={ours}, or remove param_dtype"
    )


def _precision_not_a_mapping(engine: Mapping) -> str | None:
    """verl's FSDP engine reads `mixed_precision` as a mapping of dtypes (or None)."""
    mixed = engine.get("mixed_precision")
    if mixed is None or isinstance(mixed, Mapping):
        return None
    return (
        f"critic.fsdp.mixed_precision={mixed!r} is not supported by the ppo_critic engine: verl reads it as a mapping "
        "(param_dtype, reduce_dtype, buffer_dtype); set those keys, or null"
    )


def _param_dtype(mixed_precision: Any) -> Any:
    """`mixed_precision.param_dtype` of verl's engine config (None where unset)."""
    return mixed_precision.get("param_dtype") if isinstance(mixed_precision, Mapping) else None


def _compute_dtype(keys: Mapping[str, Any]) -> str | None:
    """ppo-critic's compute dtype (None: its default) from the honoured keys: `fsdp.mixed_precision.param_dtype`
    where set (verl's FSDP engine computes in it), else `fsdp.dtype`."""
    param = _param_dtype(keys.get("fsdp.mixed_precision"))
    return ENGINE_DTYPES.get(keys.get("fsdp.dtype")) if param is None else PRECISIONS[param]


def _engine_section(engine: Mapping) -> str:
    """`fsdp`, the section of verl's FSDP engine config (the only engine config verl routes to ppo_critic)."""
    name = str(engine.get("_target_") or "FSDPEngineConfig").rsplit(".", 1)[-1]
    if name not in ENGINE_SECTIONS:
        raise ValueError(
            f"critic.strategy=ppo_critic got verl's {name}; the ppo_critic engine reads verl's FSDP engine section "
            "(critic.fsdp.*): set model_engine=dp, or critic=dp_critic to keep the actor on another engine"
        )
    return ENGINE_SECTIONS[name]


def _refusable(dotted: str, value: Any):
    """(rule, value) for each ENGINE_REFUSES rule at `dotted` or inside it (`fsdp.qat.enable` inside `fsdp.qat`)."""
    for rule in ENGINE_REFUSES:
        if rule == dotted:
            yield rule, value
        elif rule.startswith(dotted + ".") and isinstance(value, Mapping):
            inner = _lookup({dotted: value}, rule)
            if inner is not _ABSENT:
                yield rule, inner


def _refusal(rule: str, value: Any) -> str | None:
    """The one-line error for `value` at `rule`, or None where ppo-critic honours it."""
    allowed, instead = ENGINE_REFUSES[rule]
    if value in allowed:
        return None
    return f"critic.{rule}={value!r} is not supported by the ppo_critic engine: {instead}"


def _is_off(value: Any) -> bool:
    """Unset or switched off: None, False, or an empty string, list or mapping."""
    return value is None or value is False or (isinstance(value, str | list | tuple | Mapping) and not value)


def engine_section(model: Mapping, engine: Mapping, optim: Mapping) -> dict:
    """The critic section ppo-critic's engine runs with, from the keys of verl's configs it honours (`engine_keys`,
    which raises for those it cannot): verl's worker cuts the mini-batches, so one is one micro-batch at most."""
    keys = engine_keys(model, engine, optim).honoured
    section: dict[str, Any] = {"strategy": "fsdp2", "model": {}, "optim": {}}
    for dotted in sorted(keys, key=lambda k: k == "model.local_path"):  # local_path last: it wins when set
        value = keys[dotted]
        if value is None or dotted not in ENGINE_FIELDS:
            continue  # unset: ppo-critic's default
        node = section
        *parents, leaf = ENGINE_FIELDS[dotted].split(".")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    section["dtype"] = _compute_dtype(keys)
    section["ppo_mini_batch_size"] = section.get("ppo_micro_batch_size_per_gpu") or 1
    return section
