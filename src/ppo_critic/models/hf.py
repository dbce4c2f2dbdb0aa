"""Value models from transformers: `*ForTokenClassification(num_labels=1)`, any backbone + a linear head, or a
caller-built TRL-style module with a `v_head`; optionally initialised from a reward model (backbone and head).

A value model's head gives `head_outputs` numbers per token (one by default; more for a distributional objective,
`critics/objectives/`); `token_values` reads them from the model's output.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppo_critic.config.critic import DTYPES, HEAD_KINDS, VALUE_HEAD_INIT, VALUE_HEAD_INIT_HELP

HEAD_NAMES = ("score", "classifier", "v_head", "value_head")
VALUE_HEAD_FILE = "value_head.safetensors"  # the head of an exported generic critic, beside its backbone
FROM_REWARD_MODEL = "from_reward_model:"
# transformers' loggers of a load: the report, and the tensor-parallel plan check it runs once that report is quieted
QUIET_LOGGERS = ("modeling_utils", "distributed.tensor_parallel", "integrations.tensor_parallel")
# where a reward model keeps its scalar head: transformers' *ForSequenceClassification, TRL's value head, ours
REWARD_HEAD_PREFIXES = ("score.", "v_head.summary.", "v_head.", "value_head.")


class ValueHead(nn.Linear):
    """`Linear(hidden, outputs)` computed in its own parameter dtype (e.g. fp32 under bf16 autocast).

    A Linear subclass, so state-dict keys stay `<head>.weight` / `<head>.bias` as in HF checkpoints.
    """

    def forward(self, hidden: Tensor) -> Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return F.linear(hidden.to(self.weight.dtype), self.weight, self.bias)


class ValueModel(nn.Module):
    """Any transformers backbone (`AutoModel`) followed by a `ValueHead`: makes every architecture a critic."""

    def __init__(self, backbone: nn.Module, head_dtype: torch.dtype | None = None, outputs: int = 1):
        super().__init__()
        self.model = backbone
        self.config = backbone.config
        hidden = _text_config(backbone.config).hidden_size
        dtype = head_dtype or next(backbone.parameters()).dtype
        self.score = ValueHead(hidden, outputs, device=next(backbone.parameters()).device, dtype=dtype)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=False, **kwargs):
        from transformers.modeling_outputs import TokenClassifierOutput

        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache, **kwargs
        )
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return TokenClassifierOutput(logits=self.score(hidden))

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)


def build_value_model(
    model: Any,
    *,
    head: str = "auto",
    value_head_init: str = "default",
    value_head_dtype: str | None = None,
    dtype: str | torch.dtype | None = None,
    override_config: Mapping[str, Any] | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    head_outputs: int = 1,
) -> nn.Module:
    """A value model from a transformers config, a config dict (with `model_type`), a local path, or a module.

    `head`: `auto` (TokenClassification when the architecture has one, else generic), `token_classification`
    or `generic` (`AutoModel` + `Linear(hidden, 1)`). Weights are loaded when `model` is a path holding them;
    a head missing from the checkpoint is initialised by `value_head_init` (`default`, `zero`,
    `normal:<std>`). `from_reward_model:<dir>` instead loads the backbone *and* the head from a reward-model
    checkpoint (see `load_reward_model`), so the critic starts out predicting the reward model's score; `model`
    then only gives the architecture. Head dropout is 0. A caller-built module must expose a TRL-style `v_head`.
    `head_outputs`: the head's outputs per token (the objective's, `critics/objectives/`).
    """
    if head not in HEAD_KINDS:
        raise ValueError(f"head={head!r} is unknown; expected one of {HEAD_KINDS}")
    if not VALUE_HEAD_INIT.match(value_head_init):
        raise ValueError(f"value_head_init={value_head_init!r} is invalid; {VALUE_HEAD_INIT_HELP}")
    reward_model = (
        value_head_init.removeprefix(FROM_REWARD_MODEL) if value_head_init.startswith(FROM_REWARD_MODEL) else None
    )
    head_dtype = _dtype(value_head_dtype, "value_head_dtype")
    if isinstance(model, nn.Module):
        if reward_model is not None:
            raise ValueError("value_head_init=from_reward_model:<dir> needs a config or a path, not a built module")
        if not hasattr(model, "v_head"):
            raise TypeError(
                f"a caller-built {type(model).__name__} must expose a TRL-style `v_head` (values at output index 2); "
                "otherwise pass a transformers config, a config dict or a model path"
            )
        _finish_head(model, value_head_init if value_head_init != "default" else None, head_dtype)
        return model
    path = os.fspath(model) if isinstance(model, str | os.PathLike) else None
    head_file = os.path.join(path, VALUE_HEAD_FILE) if path is not None else None
    if head == "auto" and head_file is not None and os.path.isfile(head_file):
        head = "generic"  # an exported generic critic
    config = hf_config_for(model, override_config, trust_remote_code)
    config.num_labels, config.classifier_dropout, config.use_cache = head_outputs, 0.0, False
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    auto_cls = _auto_class(config, head)
    param_dtype = _dtype(dtype, "dtype") or torch.float32
    if path is not None and _has_weights(path) and reward_model is None:
        with quiet_load_report(), named_mismatches(path, config, auto_cls):
            built, info = auto_cls.from_pretrained(
                path, config=config, dtype=param_dtype, trust_remote_code=trust_remote_code, output_loading_info=True
            )
        check_backbone_loaded(path, info["missing_keys"])
        head_loaded = not any(k.split(".")[0] in HEAD_NAMES for k in info["missing_keys"])
    else:
        built = auto_cls.from_config(config, trust_remote_code=trust_remote_code).to(param_dtype)
        head_loaded = False
    if head == "generic" or auto_cls.__name__ == "AutoModel":
        built = ValueModel(built, head_dtype, head_outputs)
        head_loaded = head_file is not None and os.path.isfile(head_file)
        if head_loaded:
            from safetensors.torch import load_file

            built.score.load_state_dict({k.removeprefix("score."): v for k, v in load_file(head_file).items()})
    if reward_model is not None:
        load_reward_model(built, reward_model)
        head_loaded = True
    init = None if head_loaded else value_head_init
    _finish_head(built, None if init == "default" else init, head_dtype)
    return built


def hf_config_for(model: Any, override_config: Mapping[str, Any] | None = None, trust_remote_code: bool = False):
    """The transformers config `build_value_model` builds `model` from (a config, a dict, or a directory's
    config.json, then `override_config`), without building the model: what a command checks its inputs against."""
    with _valid_config(_config_source(model)):
        config = _hf_config(model, trust_remote_code)
    with _valid_config("critic.model.override_config"):
        for key, value in (override_config or {}).items():
            setattr(config, key, value)
    check_vocab_size(config)
    return config


def _config_source(model: Any) -> str:
    """Where the config of `model` comes from, for an error: a directory's config.json, or the options."""
    if isinstance(model, str | os.PathLike):
        return os.path.join(os.fspath(model), "config.json")
    return "the model config (critic.model.override_config)"


@contextlib.contextmanager
def _valid_config(where: str) -> Iterator[None]:
    """transformers 5 validates configs through huggingface_hub's strict dataclasses, whose errors are neither
    ValueError nor one line: as a ValueError naming `where` and the broken rule."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older hub: transformers raises ValueError itself
        StrictDataclassError = ()
    try:
        yield
    except StrictDataclassError as err:
        rule = " ".join(str(err.__cause__ or err).split())
        fix = "give the config.json its weights were saved with" if where.endswith("config.json") else "fix it"
        raise ValueError(f"{where} is not a valid model config: {rule}; {fix}") from err


def check_vocab_size(config: Any) -> None:
    """A model embeds at least one token id: `vocab_size` 0 (or not an integer) built a model no batch can enter."""
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
        raise ValueError(f"vocab_size={vocab!r} must be a positive integer: the number of token ids the model embeds")


@contextlib.contextmanager
def quiet_load_report() -> Iterator[None]:
    """Silence transformers' load report: it calls the value head MISSING ("newly initialized") although the head is
    ours to initialise (`value_head_init`) or load (a checkpoint, `value_head.safetensors`), and calls a language
    model's `lm_head` UNEXPECTED although a critic has none; a missing backbone weight is `check_backbone_loaded`'s."""
    from transformers.utils import logging as hf_logging

    logs = [logging.getLogger(f"transformers.{name}") for name in QUIET_LOGGERS]
    levels = [log.level for log in logs]
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" in every `values` / `export`
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)
        if bar:
            hf_logging.enable_progress_bar()


def check_backbone_loaded(path: str, missing: list[str]) -> None:
    """Every backbone weight must come from the checkpoint: a critic with randomly initialised layers would give
    values of an untrained model without a word (only the value head may be missing: it is ours)."""
    lost = sorted(k for k in missing if k.split(".")[0] not in HEAD_NAMES)
    if lost:
        shown = ", ".join(lost[:6]) + (f", ... ({len(lost)} in all)" if len(lost) > 6 else "")
        raise ValueError(f"{path} lacks weights of the model's backbone ({shown}): its checkpoint is incomplete")


def load_reward_model(critic: nn.Module, path: str | os.PathLike) -> None:
    """Copy a reward model's backbone and scalar head into `critic` (built with the same architecture).

    `path` is a checkpoint directory holding one of: a transformers `*ForSequenceClassification(num_labels=1)`
    (head `score`), a TRL model with a value head (`v_head.summary`), or a critic exported by this package (head
    `score`, for a generic critic in `value_head.safetensors`). Head weights map onto the critic's head (a head
    without bias gets bias 0); a language-model head (`lm_head`) is dropped; every backbone weight must match
    the critic's backbone by name and shape (errors list what does not).
    """
    tensors = _read_weights(os.fspath(path))
    head_tensors = {}
    for key in list(tensors):
        prefix = next((p for p in REWARD_HEAD_PREFIXES if key.startswith(p)), None)
        if prefix is not None:
            head_tensors[key.removeprefix(prefix)] = tensors.pop(key)
        elif key.startswith("lm_head."):
            del tensors[key]
    weight = head_tensors.get("weight")
    if weight is None or weight.dim() != 2 or weight.shape[0] != 1:
        found = {k: tuple(v.shape) for k, v in head_tensors.items()}
        raise ValueError(
            f"reward model {path} has no scalar head: expected score / v_head.summary / value_head weights of shape "
            f"[1, hidden] (a reward model with num_labels=1), found {found or 'none'}"
        )
    backbone = critic.model if isinstance(critic, ValueModel) else critic.base_model
    prefix = getattr(backbone, "base_model_prefix", "model") + "."
    mapped = {k.removeprefix(prefix): v for k, v in tensors.items()}
    fix = "build the critic with the reward model's architecture (critic.model.path)"
    try:
        missing, unexpected = backbone.load_state_dict(mapped, strict=False)
    except RuntimeError as err:  # shapes differ: name the first few
        lines = [line.strip() for line in str(err).splitlines() if "size mismatch" in line]
        shown = "; ".join(lines[:3]) + (f"; ... ({len(lines)} in all)" if len(lines) > 3 else "")
        raise ValueError(f"reward model {path} does not fit the critic's backbone: {shown}; {fix}") from err
    if missing or unexpected:
        raise ValueError(
            f"reward model {path} does not fit the critic's backbone: missing {sorted(missing)[:8]}, unexpected "
            f"{sorted(unexpected)[:8]}; {fix}"
        )
    parent, name = find_value_head(critic)
    linear: nn.Linear = getattr(parent, name)
    if linear.out_features != 1:
        raise ValueError(f"a reward model's scalar head cannot start a head of {linear.out_features} outputs per token")
    with torch.no_grad():
        linear.weight.copy_(weight)
        if linear.bias is not None:
            linear.bias.copy_(head_tensors.get("bias", torch.zeros(1)))


def _read_weights(path: str) -> dict[str, Tensor]:
    """Every tensor of a checkpoint directory (safetensors, else weights-only `.bin`), including our head file."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"reward model path {path!r} is not a directory")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    tensors: dict[str, Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            tensors |= load_file(os.path.join(path, f))
    else:
        for f in sorted(f for f in os.listdir(path) if f.endswith(".bin")):
            tensors |= torch.load(os.path.join(path, f), map_location="cpu", weights_only=True)
    if not tensors:
        raise FileNotFoundError(f"reward model path {path!r} holds no .safetensors or .bin weights")
    return tensors


def token_values(module: nn.Module, output: Any) -> Tensor:
    """Per-token head outputs from a value model's output (TRL `v_head` tuple index 2, else `.logits`): [B, T] for a
    head of one output, [B, T, outputs] for more."""
    inner = getattr(module, "module", module)  # DDP / FSDP1 wrappers
    if hasattr(module, "v_head") or hasattr(inner, "v_head"):
        values = output[2]
    else:
        values = output.logits if hasattr(output, "logits") else output[0]
    return values.squeeze(-1) if values.dim() == 3 and values.shape[-1] == 1 else values


def unwrap(model: nn.Module) -> nn.Module:
    """The value model inside DDP / FSDP1 (`.module`) and peft (`get_base_model()`) wrappers."""
    while True:
        if hasattr(model, "get_base_model") and model.get_base_model() is not model:
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            return model


def find_value_head(model: nn.Module) -> tuple[nn.Module, str]:
    """(parent, attribute) of the `Linear(hidden, outputs)` value head (looking through DDP / FSDP1 / peft
    wrappers)."""
    model = unwrap(model)
    for name in HEAD_NAMES:
        head = getattr(model, name, None)
        if isinstance(head, nn.Linear):
            return model, name
        if isinstance(head, nn.Module):
            copies = getattr(head, "modules_to_save", None)  # peft's wrapper: a frozen original beside the copy in use
            if isinstance(copies, nn.ModuleDict) and getattr(head, "active_adapters", None):
                return copies, head.active_adapters[0]
            for sub_name, sub in head.named_children():
                if isinstance(sub, nn.Linear):
                    return head, sub_name
    raise ValueError(f"{type(model).__name__} has no Linear value head named one of {HEAD_NAMES}")


def _finish_head(model: nn.Module, init: str | None, head_dtype: torch.dtype | None) -> None:
    """Apply head init, fp32 (or other) head dtype, and zero head dropout."""
    parent, name = find_value_head(model)
    linear: nn.Linear = getattr(parent, name)
    if head_dtype is not None and (linear.weight.dtype != head_dtype or not isinstance(linear, ValueHead)):
        new = ValueHead(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device=linear.weight.device,
            dtype=head_dtype,
        )
        with torch.no_grad():
            new.weight.copy_(linear.weight)
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
        setattr(parent, name, new)
        linear = new
    if init is not None:
        with torch.no_grad():
            if init == "zero":
                linear.weight.zero_()
            else:
                linear.weight.normal_(0.0, float(init.split(":", 1)[1]))
            if linear.bias is not None:
                linear.bias.zero_()
    for container in (model, parent):
        for child in container.children():
            if isinstance(child, nn.Dropout):
                child.p = 0.0


def _hf_config(model: Any, trust_remote_code: bool):
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return copy.deepcopy(model)
    if isinstance(model, Mapping):
        fields = dict(model)
        if "model_type" not in fields:
            raise ValueError("a value-model config dict needs 'model_type' (e.g. 'qwen2', 'llama')")
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    if isinstance(model, str | os.PathLike):
        path = os.fspath(model)
        if os.path.isfile(path):
            raise FileNotFoundError(
                f"model path {path!r} is a file, not a model directory; give the directory holding its config.json "
                "(and weights)"
            )
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"model path {path!r} holds no config.json; give a transformers model directory")
        try:
            return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as err:
            if not os.path.exists(path):  # not a hub id in the cache either; transformers' text names the hub
                raise FileNotFoundError(
                    f"model path {path!r} does not exist, nor is it a model id in the Hugging Face cache; give a "
                    "local model directory"
                ) from err
            raise FileNotFoundError(f"model path {path!r} has a config.json transformers cannot read: {err}") from err
    raise TypeError(
        f"build_value_model takes a transformers config, a dict, a path or a module, got {type(model).__name__}"
    )


def _auto_class(config, head: str):
    from transformers import AutoModel, AutoModelForTokenClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    has_tc = config.model_type in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES
    if head == "token_classification" and not has_tc:
        raise ValueError(
            f"model_type {config.model_type!r} has no *ForTokenClassification in the installed transformers; "
            "use head='generic' (or 'auto')"
        )
    return AutoModelForTokenClassification if has_tc and head != "generic" else AutoModel


def check_trained_critic(path: str | os.PathLike) -> None:
    """A directory to score with must hold a whole critic: weights, a value head among them (`score.*`, TRL's
    `v_head.*`, ...) or an export's `value_head.safetensors`; else its values would be those of a randomly
    initialised model or head, without a word. (The backbone's own weights: `check_backbone_loaded`.)"""
    path = os.fspath(path)
    if not _has_weights(path):
        raise FileNotFoundError(
            f"{path} holds no weights (model.safetensors, pytorch_model.bin): its values would be a random model's; "
            "point at a critic `ppo-critic export` or `train` wrote (its hf/ directory)"
        )
    names = None if os.path.isfile(os.path.join(path, VALUE_HEAD_FILE)) else _weight_names(path)
    if names is not None and not any(name.split(".")[0] in HEAD_NAMES for name in names):
        heads = ", ".join(f"{h}.*" for h in HEAD_NAMES)
        raise ValueError(
            f"{path} holds no value head ({heads}): it is not a trained critic (a base model?); train one from it "
            f"with `ppo-critic train critic.model.path={path}`"
        )


def _weight_names(path: str) -> list[str] | None:
    """The tensor names in `path`'s safetensors weights (a sharded checkpoint's index); None where they cannot be
    listed (.bin weights, a damaged file: the loader then names it, `cannot build the value model of ...`)."""
    try:
        return _listed_names(path)
    except Exception:
        return None


def _listed_names(path: str) -> list[str] | None:
    """`_weight_names`, raising what a damaged file raises."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return list(json.load(f)["weight_map"])
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors") and f != VALUE_HEAD_FILE)
    if not files:
        return None
    from safetensors import safe_open

    names: list[str] = []
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as weights:
            names += list(weights.keys())
    return names


@contextlib.contextmanager
def named_mismatches(path: str, config: Any, auto_cls: Any) -> Iterator[None]:
    """transformers' refusal of weights whose sizes differ from the config ("ignore_mismatched_sizes", its report
    silenced) as a ValueError naming the tensors, their sizes in the file and by config.json, and the fix."""
    try:
        yield
    except RuntimeError as err:
        if "mismatched" not in str(err):
            raise
        found = _mismatches(path, config, auto_cls)
        listed = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
        raise ValueError(
            f"the weights in {path} do not match its config.json ({listed or 'sizes differ'}): give the config.json "
            "they were saved with"
        ) from err


def _mismatches(path: str, config: Any, auto_cls: Any) -> list[str]:
    """`name: [file sizes] in the weights, [sizes] by config.json` for every tensor whose sizes differ (names matched
    as written or under a wrapper's prefix, e.g. `model.`)."""
    from safetensors import safe_open

    with torch.device("meta"):
        expected = {k: list(v.shape) for k, v in auto_cls.from_config(config).state_dict().items()}
    found = []
    for name in sorted(f for f in os.listdir(path) if f.endswith(".safetensors") and f != VALUE_HEAD_FILE):
        with safe_open(os.path.join(path, name), framework="pt") as weights:
            names = weights.keys()  # a safetensors handle is not iterable
            for key in names:
                shape = list(weights.get_slice(key).get_shape())
                want = expected.get(key) or next((v for k, v in expected.items() if k.endswith("." + key)), None)
                if want is not None and want != shape:
                    found.append(f"{key}: {shape} in the weights, {want} by config.json")
    return found


def _has_weights(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    return any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path))


def _dtype(value: str | torch.dtype | None, name: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in DTYPES:
        raise ValueError(f"{name}={value!r} is unknown; use one of {sorted(DTYPES)}")
    return getattr(torch, DTYPES[value])


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config
