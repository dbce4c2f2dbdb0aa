"""Critic configuration: dataclasses with verl's field names, built from a dict, an OmegaConf node or itself.

`CriticConfig.from_any(cfg)` accepts what a verl user already has (their `critic` config section) and
rejects unknown keys by name. `validate()` lists every inconsistent setting in one error.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import logging
import math
import re
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ppo_critic.config import verl
from ppo_critic.config.modes import LOSS_AGG_MODES, VALUE_NORM_MODES, VF_LOSS_TYPES

log = logging.getLogger(__name__)

STRATEGIES = ("fsdp2", "fsdp", "ddp", "none", "megatron")
# strategies that hold parameters in their own way, refusing `param_dtype`: why, and what to do instead
PARAM_DTYPE_ELSEWHERE = {
    "fsdp2": "is what strategy=fsdp2 does by itself (float32 shards, the master weights, gathered in dtype by its "
    "MixedPrecisionPolicy); set param_dtype null and choose the gathered dtype with dtype",
    "fsdp": "is not supported with strategy=fsdp (FSDP1); use strategy none or ddp, or fsdp2 (float32 shards gathered "
    "in dtype), or set param_dtype null",
    "megatron": "is what strategy=megatron does by itself (parameters in dtype, float32 main weights in its "
    "optimizer); set param_dtype null",
}
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
DTYPES |= {"float16": "float16", "fp16": "float16"}
VALUE_HEAD_INIT = re.compile(r"^(default|zero|normal:(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?|from_reward_model:.+)$")
VALUE_HEAD_INIT_HELP = "use 'default', 'zero', 'normal:<std>' or 'from_reward_model:<path>'"
FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3")  # transformers' own varlen attention
OFFLOAD_KEYS = ("param_offload", "optimizer_offload", "offload_policy")  # verl's names under model.fsdp_config
HEAD_KINDS = ("auto", "token_classification", "generic")
WARMUP_STYLES = ("constant", "cosine")
OPTIMIZERS = ("adamw", "sgd")
# sizes in a model's (HF) config that must be positive integers when given
MODEL_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
)


@dataclass
class OptimConfig:
    """Optimizer and LR-schedule settings (used by the worker that builds the optimizer); the schedule counts
    updates (`update_critic` calls)."""

    optimizer: str = "adamw"
    """adamw, or sgd (plain, no momentum: the update is the gradient, which makes layouts comparable exactly)"""
    lr: float = 1e-5
    """learning rate (after warmup)"""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (β1, β2): decay rates of its moving averages of the gradient and its square"""
    eps: float = 1e-8
    """AdamW's ε (added to the denominator for numerical stability)"""
    weight_decay: float = 0.01
    """weight decay (AdamW: decoupled; SGD: an L2 term in the gradient)"""
    lr_warmup_steps: int = -1
    """linear warmup over this many updates; <= 0: lr_warmup_steps_ratio decides (verl)"""
    lr_warmup_steps_ratio: float = 0.0
    """warmup as a fraction of total_training_steps, when lr_warmup_steps <= 0 (verl)"""
    total_training_steps: int = -1
    """updates the LR schedule spans; <= 0: the trainer's step count (verl's trainer fills it in)"""
    warmup_style: str = "constant"
    """after warmup: constant, or cosine decay to min_lr_ratio × lr at total_training_steps (verl's name)"""
    min_lr_ratio: float | None = None
    """the floor of the cosine decay, as a fraction of lr; null: 0 (verl)"""
    fused: bool | None = None
    """AdamW's fused kernel: true / false, or null for torch's default (foreach)"""
    value_head_lr_ratio: float = 1.0
    """the value head's learning rate as a multiple of lr (its own parameter group; the schedule scales both)"""


@dataclass
class ModelConfig:
    """How the value model is built (`ppo_critic.build_value_model`) and run."""

    path: str | None = None
    """an HF model directory (its weights are loaded when present); null: a new model from override_config (verl)"""
    tokenizer_path: str | None = None
    """verl's tokenizer location; accepted, not read (the critic reads token ids)"""
    override_config: dict = field(default_factory=dict)
    """HF config fields over the model's config (verl); with path null, the whole config (model_type, sizes)"""
    external_lib: str | None = None
    """a module imported before the model is built, e.g. to register an architecture (verl); runs code"""
    trust_remote_code: bool = False
    """let transformers run the model directory's own code (verl); never read from a run's saved config"""
    use_remove_padding: bool | Literal["auto"] = "auto"
    """pack each micro-batch's valid tokens into one row (varlen attention) instead of padding. auto: packed wherever
    the model can run packed rows (faster on CUDA and CPU), else padded (e.g. a custom module or
    attn_implementation=eager); true: packed or an error saying why not; false: padded (verl)"""
    enable_gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory (verl)"""
    enable_activation_offload: bool = False
    """verl's activation offload to the CPU; not supported (false; use enable_gradient_checkpointing)"""
    use_shm: bool = False
    """verl: load the model through shared memory; accepted, not read"""
    fsdp_config: dict = field(default_factory=dict)
    """verl's FSDP section; read here: param_offload, optimizer_offload (parameters, optimizer state on the CPU
    between calls; CUDA), offload_policy (FSDP2's CPUOffloadPolicy); the rest is verl's"""
    lora_rank: int = 0
    """LoRA rank: only adapters and the value head train; 0: the full model (verl; pip install 'ppo-critic[lora]')"""
    lora_alpha: int = 16
    """LoRA's scaling α (verl)"""
    target_modules: Any = "all-linear"
    """the modules that get LoRA adapters: all-linear or a list of module names (verl)"""
    head: str = "auto"
    """auto (TokenClassification when the architecture has one, else generic), token_classification, generic
    (any backbone + a Linear(hidden, 1) head)"""
    value_head_init: str = "default"
    """how a head the checkpoint lacks starts: default, zero, normal:<std>, or from_reward_model:<dir> (backbone
    and head of a reward model)"""
    value_head_dtype: str | None = None
    """dtype of the value head, e.g. float32 to keep it in fp32 under bf16 autocast; null: the model's"""
    attn_implementation: str | None = None
    """transformers' attention (sdpa, eager, flash_attention_2, ...); null: transformers' choice, and when packed
    (use_remove_padding) ppo-critic's varlen attention"""
    use_torch_compile: bool = False
    """torch.compile each decoder layer (ppo_critic.models.compile)"""


@dataclass
class MegatronConfig:
    """The megatron-core layout (verl's `critic.megatron` section), read when `strategy` is `megatron`."""

    tensor_model_parallel_size: int = 1
    """tensor parallel degree (TP)"""
    pipeline_model_parallel_size: int = 1
    """pipeline parallel degree (PP): the number of stages the layers are split into"""
    virtual_pipeline_model_parallel_size: int | None = None
    """model chunks per pipeline stage (interleaved schedule; needs PP > 2); null: 1"""
    context_parallel_size: int = 1
    """context parallel degree; must be 1 (context parallelism needs transformer-engine)"""
    sequence_parallel: bool = False
    """megatron's sequence parallelism along TP; not supported (false; it needs transformer-engine)"""
    use_distributed_optimizer: bool = True
    """shard the optimizer state over the data-parallel ranks (megatron's distributed optimizer; Adam only)"""
    seed: int = 42
    """seed of megatron's model-parallel random state"""
    param_offload: bool = False
    """verl: keep parameters on the CPU between uses; not supported by this backend yet (false)"""
    grad_offload: bool = False
    """verl: keep gradients on the CPU between uses; not supported by this backend yet (false)"""
    optimizer_offload: bool = False
    """verl: keep the optimizer state on the CPU between uses; not supported by this backend yet (false)"""

    def errors(self) -> list[str]:
        errors = _positive_int_errors(
            self,
            ["tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"],
            ["virtual_pipeline_model_parallel_size"],
        )
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp > 1 and self.pipeline_model_parallel_size <= 2:
            # at PP=2 a stage's previous and next stage are the same rank, and megatron's exchange of
            # micro-batch shapes (needed for variable lengths) then pairs the two messages the wrong way round
            errors.append(f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 2")
        if self.context_parallel_size != 1:
            errors.append("context_parallel_size must be 1 (context parallelism needs transformer-engine)")
        if self.sequence_parallel:
            errors.append("sequence_parallel=true is not supported (it needs transformer-engine); set false")
        for name in ("param_offload", "grad_offload", "optimizer_offload"):
            if getattr(self, name):
                errors.append(f"{name}=true is not supported by the megatron backend yet; set false")
        return ["megatron." + e for e in errors]


@dataclass
class CriticConfig:
    """The critic section of a verl config, as the user writes it: `ppo_mini_batch_size` is global (all ranks),
    `*_per_gpu` sizes are per rank. `RankSizes` is what one rank runs with: a `CriticWorker` divides the global
    sizes over its ranks; a critic built directly (verl's workers) reads `ppo_mini_batch_size` as the rank's,
    since verl divides it in place before it builds one."""

    strategy: str = "fsdp2"
    """how the model is wrapped: fsdp2, fsdp (FSDP1), ddp, none (one process, no wrapper) or megatron"""
    ppo_mini_batch_size: int = 256
    """prompts per optimizer step (verl: × rollout_n responses, over all data-parallel ranks together)"""
    ppo_micro_batch_size: int | None = None
    """verl's deprecated global micro-batch size, divided over the data-parallel ranks; null: per_gpu decides"""
    ppo_micro_batch_size_per_gpu: int | None = None
    """rows per forward + backward pass on each rank (gradients accumulate over a mini-batch); null: the whole
    mini-batch at once"""
    forward_micro_batch_size: int | None = None
    """verl's deprecated global micro-batch size of compute_values; null: forward_micro_batch_size_per_gpu decides"""
    forward_micro_batch_size_per_gpu: int | None = None
    """rows per forward pass of compute_values on each rank; null: the training micro-batch size"""
    use_dynamic_bsz: bool = False
    """micro-batches by a token budget (the *_max_token_len_per_gpu options) instead of a number of rows (verl)"""
    ppo_max_token_len_per_gpu: int = 32768
    """with use_dynamic_bsz: tokens per training micro-batch on each rank (verl)"""
    forward_max_token_len_per_gpu: int | None = None
    """with use_dynamic_bsz: tokens per compute_values micro-batch on each rank; null: ppo_max_token_len_per_gpu"""
    ppo_epochs: int = 1
    """passes over the batch of each update_critic call (verl)"""
    shuffle: bool = False
    """shuffle the rows before splitting them into mini-batches, every epoch (needs data_loader_seed; verl)"""
    data_loader_seed: int | None = None
    """seed of that shuffle, the same on every rank (verl)"""
    cliprange_value: float | None = 0.5
    """PPO value clipping: the loss is the larger error of the new value and of it clipped to old ± this; null:
    off (verl)"""
    loss_agg_mode: str = "token-mean"
    """how token losses are averaged: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm
    (verl)"""
    loss_scale_factor: float | None = None
    """the divisor of seq-mean-token-sum-norm's per-sequence sums; null: the response width (verl)"""
    vf_loss_type: str = "mse"
    """the value objective, one module each in critics/objectives/"""
    huber_delta: float = 1.0
    """δ of the huber loss"""
    value_norm: str | bool = "off"
    """off; running (the model predicts returns normalised by their running mean and std); popart (running, and
    the head is rescaled when the statistics move; outputs more than 2σ off at their start move to the returns' mean). A
    bare off in YAML reads as false, the same"""
    value_norm_decay: float = 1.0
    """the weight the return statistics already hold keep at each update: 1 counts every return seen alike; below 1
    they forget, an exponential window of ~1 / (1 − value_norm_decay) updates (for a policy that moves)"""
    targets_lam: float | None = None
    """the λ of the critic's own regression targets: GAE returns recomputed from the batch's `token_level_rewards`
    and old `values` (VC-PPO's decoupled λ; 1: Monte-Carlo returns); null: the returns the trainer hands over
    (verl's, under algorithm.lam). For verl's trainer; `ppo-critic train` sets its own with trainer.lam"""
    targets_gamma: float = 1.0
    """the discount of those targets: verl's algorithm.gamma"""
    ema_decay: float = 0.0
    """> 0: compute_values (and the HF export) use a moving average of the weights with this decay; 0: off"""
    ema_warmup: bool = False
    """ramp the average's decay up, min(ema_decay, (1 + k) / (10 + k)) at its k-th update, so that early on it follows
    the fast-moving weights instead of lagging ~1 / (1 − ema_decay) steps behind (timm's EMA warmup)"""
    grad_clip: float | None = 1.0
    """clip the gradients' global norm to this; null: no clipping (verl)"""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence parallelism: each sequence split over this many ranks (needs model.use_remove_padding true
    or auto; verl)"""
    dtype: str | None = None
    """compute dtype: bfloat16, float16 or float32; null: a bfloat16 param_dtype's, else bf16 autocast on CUDA and
    fp32 on CPU"""
    param_dtype: str | None = None
    """bfloat16: parameters and gradients in bf16 on the device, float32 master weights in the optimizer (strategy
    none or ddp; fsdp2 keeps float32 shards and gathers them in dtype by itself); null or float32: float32 parameters"""
    rollout_n: int = 1
    """responses per prompt (verl's actor_rollout_ref.rollout.n); ppo_mini_batch_size counts prompts. ppo-critic
    train's tasks draw trainer.rollout_batch_size / rollout_n prompts, each with rollout_n responses"""
    enable: bool | None = None
    """verl's switch for using a critic (null: the algorithm decides); accepted, not read"""
    checkpoint: dict = field(default_factory=dict)
    """verl's checkpoint section (save_contents, load_contents); accepted, not read"""
    profiler: dict = field(default_factory=dict)
    """verl's profiler section; accepted, not read"""
    model: ModelConfig = field(default_factory=ModelConfig)
    """the value model: what is built and how it runs"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """the optimizer and its LR schedule"""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """the megatron-core layout, read when strategy=megatron"""

    def __post_init__(self) -> None:
        # not a field: the keys of a verl config that belong to verl's worker (dotted name -> value), set aside by
        # `from_dict`; copies keep them, `dataclasses.replace` does not
        self.verl_keys: dict[str, Any] = {}
        if self.value_norm is False:
            self.value_norm = "off"

    @classmethod
    def from_any(cls, cfg: Any, worker: bool = False) -> CriticConfig:
        """Build from a CriticConfig, a nested dict, an OmegaConf node or one of verl's critic config dataclasses
        (`ppo_critic.config.verl`), and check what the critic reads (`worker=True`: also what a worker builds)."""
        config = copy.deepcopy(cfg) if isinstance(cfg, CriticConfig) else cls.from_dict(verl.to_mapping(cfg))
        config.validate(worker=worker)
        return config

    @classmethod
    def from_dict(cls, data: Mapping, prefix: str = "") -> CriticConfig:
        """From a plain nested dict: verl's spellings read as verl reads them, the keys of verl's worker set aside in
        `verl_keys` (listed once in a debug log), any other unknown key an error naming it."""
        ours, verl_keys = verl.normalise(data, prefix)
        config = from_mapping(cls, ours, prefix)
        config.verl_keys = verl_keys
        if verl_keys and frozenset(verl_keys) not in _LOGGED_VERL_KEYS:
            _LOGGED_VERL_KEYS.add(frozenset(verl_keys))
            log.debug("critic config: keys read by verl's worker, not by the critic: %s", ", ".join(sorted(verl_keys)))
        return config

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def micro_batch_sizes(self, dp_size: int = 1) -> tuple[int, int | None]:
        """Per-rank `(train, forward)` micro-batch sizes.

        Per-GPU fields win; verl's deprecated global fields are divided by `dp_size`; an unset train size
        means one micro-batch per mini-batch, an unset forward size falls back to the train size.
        """
        train = per_rank(self.ppo_micro_batch_size_per_gpu, self.ppo_micro_batch_size, dp_size)
        forward = per_rank(self.forward_micro_batch_size_per_gpu, self.forward_micro_batch_size, dp_size)
        train = self.ppo_mini_batch_size if train is None else train
        return train, train if forward is None else forward

    @property
    def forward_max_token_len(self) -> int:
        return self.forward_max_token_len_per_gpu or self.ppo_max_token_len_per_gpu

    @property
    def torch_dtype_name(self) -> str | None:
        """Canonical compute dtype name: `dtype`, else a low-precision `param_dtype` (such parameters compute in
        their dtype), else None for the device default (bf16 on CUDA, fp32 on CPU)."""
        return self.param_dtype_name if self.dtype is None else DTYPES[self.dtype]

    @property
    def param_dtype_name(self) -> str | None:
        """Canonical name of a low-precision `param_dtype` (master weights kept in float32), or None for float32
        parameters."""
        name = DTYPES.get(self.param_dtype) if isinstance(self.param_dtype, str) else None
        return None if name == "float32" else name

    def validate(self, prefix: str = "", *, worker: bool = True) -> None:
        """Raise one ValueError listing every invalid or contradictory setting (with the fix); `prefix` is where
        this section sits in a larger config (e.g. `critic.`), so messages name the key the user typed. With
        `worker=False` only what the critic reads is checked (model and optimizer are then the caller's)."""
        errors = self.critic_errors() + (self.worker_errors() if worker else [])
        if errors:
            raise ValueError("invalid critic config:\n  - " + "\n  - ".join(prefix + e for e in errors))

    def critic_errors(self) -> list[str]:
        """Settings the critic reads: batch sizes, loss, clipping, normalisation, averaging, sequence parallel."""
        errors = _positive_int_errors(
            self,
            ["ppo_mini_batch_size", "ppo_max_token_len_per_gpu", "ppo_epochs", "ulysses_sequence_parallel_size"],
            [
                "ppo_micro_batch_size",
                "ppo_micro_batch_size_per_gpu",
                "forward_micro_batch_size",
                "forward_micro_batch_size_per_gpu",
                "forward_max_token_len_per_gpu",
            ],
        )
        errors += _choice_errors(
            {
                "loss_agg_mode": (self.loss_agg_mode, LOSS_AGG_MODES),
                "strategy": (self.strategy, STRATEGIES),
                "vf_loss_type": (self.vf_loss_type, tuple(VF_LOSS_TYPES)),
                "value_norm": (self.value_norm, VALUE_NORM_MODES),
            }
        )
        if self.dtype is not None and self.dtype not in DTYPES:
            errors.append(f"dtype={self.dtype!r} is unknown; use one of {sorted(DTYPES)} or null for the default")
        if not _positive_number(self.huber_delta):
            errors.append(f"huber_delta={self.huber_delta!r} must be a positive (finite) number")
        errors += self.value_norm_errors() + self.ema_errors() + self.param_dtype_errors() + self.targets_errors()
        for name in ("cliprange_value", "grad_clip", "loss_scale_factor"):
            value = getattr(self, name)
            if value is not None and not _positive_number(value):
                errors.append(f"{name}={value!r} must be a positive (finite) number or null (off)")
        if isinstance(self.rollout_n, bool) or not isinstance(self.rollout_n, int) or self.rollout_n < 1:
            errors.append(f"rollout_n={self.rollout_n!r} must be a positive integer (responses per prompt)")
        if not self.use_dynamic_bsz and not errors:
            micro = self.micro_batch_sizes()[0]
            if self.ppo_mini_batch_size % micro:
                errors.append(
                    f"ppo_mini_batch_size={self.ppo_mini_batch_size} is not divisible by the micro-batch size "
                    f"{micro} (ppo_micro_batch_size_per_gpu); choose a divisor, or set use_dynamic_bsz=true"
                )
        if self.shuffle and self.data_loader_seed is None:
            errors.append("shuffle=true needs data_loader_seed (an int) so every rank shuffles identically")
        packing = self.model.use_remove_padding
        if not (isinstance(packing, bool) or packing == "auto"):
            errors.append(f"model.use_remove_padding={packing!r} is unknown; expected true, false or auto")
        elif self.ulysses_sequence_parallel_size > 1 and packing is False:
            errors.append("ulysses_sequence_parallel_size > 1 needs model.use_remove_padding=true (or auto)")
        if self.ulysses_sequence_parallel_size > 1 and self.model.attn_implementation in FLASH_ATTENTION:
            errors.append(
                f"model.attn_implementation={self.model.attn_implementation} cannot run Ulysses "
                "(ulysses_sequence_parallel_size > 1): transformers' flash-attention gets this rank's slice of the "
                "row with the whole row's sequence bounds; leave attn_implementation null (ppo-critic's varlen "
                "attention, which swaps sequence for head shards first)"
            )
        if self.strategy == "megatron" and self.ulysses_sequence_parallel_size != 1:
            errors.append(
                "ulysses_sequence_parallel_size must be 1 with strategy=megatron (use megatron's tensor parallel)"
            )
        return errors

    def worker_errors(self) -> list[str]:
        """Settings a ppo-critic worker reads to build the model, the optimizer and the megatron layout (inside
        verl's worker verl builds those, and these are not checked)."""
        errors = self.model_errors() + self.optim_errors() + verl.worker_errors(self.verl_keys)
        if self.strategy == "megatron":
            errors += self.megatron.errors()
            if self.optim.optimizer == "sgd" and self.megatron.use_distributed_optimizer:
                errors.append(
                    "optim.optimizer=sgd needs megatron.use_distributed_optimizer=false (megatron shards Adam only)"
                )
            if self.model.lora_rank:
                errors.append("model.lora_rank > 0 (LoRA) is not supported with strategy=megatron; set 0")
            if self.model.use_torch_compile:
                errors.append("model.use_torch_compile is not supported with strategy=megatron; set false")
            if self.model.value_head_dtype not in (None, "float32", "fp32"):
                errors.append("model.value_head_dtype: the megatron value head is always float32; set null or float32")
        return errors

    def value_norm_errors(self) -> list[str]:
        """`value_norm_decay` is a number in (0, 1], below 1 only where there are statistics to forget."""
        decay = self.value_norm_decay
        if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 < decay <= 1:
            return [f"value_norm_decay={decay!r} must be a number in (0, 1] (1: every return counts alike; e.g. 0.95)"]
        if decay < 1 and self.value_norm in ("off", False):
            return [f"value_norm_decay={decay} needs value_norm=running or popart (there are no statistics to forget)"]
        return []

    def targets_errors(self) -> list[str]:
        """`targets_lam` (null or in [0, 1]) and `targets_gamma` (in [0, 1])."""
        errors = []
        for name, value, allow_null in (
            ("targets_lam", self.targets_lam, True),
            ("targets_gamma", self.targets_gamma, False),
        ):
            if value is None and allow_null:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
                null = " or null (the trainer's returns)" if allow_null else ""
                errors.append(f"{name}={value!r} must be a number in [0, 1]{null}")
        return errors

    def ema_errors(self) -> list[str]:
        """`ema_decay` is a number in [0, 1) and works where the average can live beside the parameters."""
        decay = self.ema_decay
        if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 <= decay < 1:
            return [f"ema_decay={decay!r} must be a number in [0, 1) (0: off; e.g. 0.9)"]
        if not isinstance(self.ema_warmup, bool):
            return [f"ema_warmup={self.ema_warmup!r} must be true or false"]
        if not decay:
            return ["ema_warmup=true needs ema_decay > 0 (the decay it ramps up to)"] if self.ema_warmup else []
        if self.strategy == "fsdp":
            return ["ema_decay > 0 is not supported with strategy=fsdp (FSDP1); use fsdp2, ddp or none, or set 0"]
        return []

    def param_dtype_errors(self) -> list[str]:
        """`param_dtype` is bfloat16, float32 or null; bfloat16 where ppo-critic keeps master weights itself
        (strategy none or ddp), with a compute dtype that matches (the offload keys: `offload_errors`)."""
        value = self.param_dtype
        name = DTYPES.get(value) if isinstance(value, str) else None
        if value is None or name == "float32":
            return []
        if name is None:
            return [f"param_dtype={value!r} is unknown; use bfloat16 (float32 master weights), float32 or null"]
        if name == "float16":
            return [f"param_dtype={value} is not supported (float16 gradients need loss scaling); use bfloat16 or null"]
        if self.strategy in PARAM_DTYPE_ELSEWHERE:
            return [f"param_dtype={value} {PARAM_DTYPE_ELSEWHERE[self.strategy]}"]
        if DTYPES.get(self.dtype, name) != name:
            return [f"param_dtype={value} computes in {name}, not dtype={self.dtype}; set dtype={name} or null"]
        return []

    def model_errors(self) -> list[str]:
        m = self.model
        errors = _choice_errors({"model.head": (m.head, HEAD_KINDS)})
        init = m.value_head_init
        if not isinstance(init, str) or not VALUE_HEAD_INIT.match(init):
            errors.append(f"model.value_head_init={init!r} is invalid; {VALUE_HEAD_INIT_HELP}")
        elif init.startswith("normal:") and not _positive_number(float(init.split(":", 1)[1])):
            errors.append(f"model.value_head_init={init!r}: the standard deviation must be positive and finite")
        for key in MODEL_SIZES:
            value = m.override_config.get(key)
            if value is not None and not (_is_int(value) and 1 <= value <= MAX_INT):
                errors.append(f"model.override_config.{key}={show(value)} must be a positive integer below 2**63")
        if m.value_head_dtype is not None and m.value_head_dtype not in DTYPES:
            errors.append(f"model.value_head_dtype={m.value_head_dtype!r} is unknown; use one of {sorted(DTYPES)}")
        if isinstance(m.lora_rank, bool) or not isinstance(m.lora_rank, int) or m.lora_rank < 0:
            errors.append(f"model.lora_rank={m.lora_rank!r} must be an integer >= 0 (0: no LoRA)")
        if m.lora_rank and not (isinstance(m.lora_alpha, int | float) and m.lora_alpha > 0):
            errors.append(f"model.lora_alpha={m.lora_alpha!r} must be a positive number")
        if m.lora_rank and self.strategy == "fsdp":
            errors.append("model.lora_rank > 0 (LoRA) is not supported with strategy=fsdp (FSDP1); use fsdp2 or ddp")
        if m.enable_activation_offload:
            errors.append(
                "model.enable_activation_offload=true is not supported; set false (use "
                "model.enable_gradient_checkpointing=true to save activation memory)"
            )
        return errors + self.offload_errors()

    def offload_errors(self) -> list[str]:
        """verl's offload keys are booleans, each set only where this worker honours it: `param_offload` and
        `optimizer_offload` with fsdp2, ddp or none (`parallel/offload.py`) and float32 parameters, `offload_policy`
        with fsdp2."""
        errors = []
        for key in OFFLOAD_KEYS:
            value = self.model.fsdp_config.get(key, False)
            if not isinstance(value, bool):
                errors.append(f"model.fsdp_config.{key}={value!r} must be true or false")
            elif value and self.strategy in ("fsdp", "megatron"):
                errors.append(
                    f"model.fsdp_config.{key}=true is not supported with strategy={self.strategy}; use strategy "
                    "fsdp2 (or ddp / none for param_offload, optimizer_offload), or set it false"
                )
            elif value and key == "offload_policy" and self.strategy != "fsdp2":
                errors.append(
                    f"model.fsdp_config.offload_policy=true needs strategy=fsdp2 (FSDP2's CPUOffloadPolicy); with "
                    f"strategy={self.strategy} use param_offload / optimizer_offload, or set it false"
                )
            elif value and self.param_dtype_name and self.strategy in ("none", "ddp"):
                errors.append(
                    f"model.fsdp_config.{key}=true with param_dtype={self.param_dtype} is not supported (the float32 "
                    f"master weights would stay on the device); set {key} false or param_dtype null"
                )
        return errors

    def optim_errors(self) -> list[str]:
        o = self.optim
        errors = _choice_errors(
            {"optim.warmup_style": (o.warmup_style, WARMUP_STYLES), "optim.optimizer": (o.optimizer, OPTIMIZERS)}
        )
        if not (_finite(o.lr) and o.lr >= 0):
            errors.append(f"optim.lr={o.lr!r} must be a finite number >= 0")
        if not (_finite(o.weight_decay) and o.weight_decay >= 0):
            errors.append(f"optim.weight_decay={o.weight_decay!r} must be a finite number >= 0")
        if not _betas_ok(o.betas):
            betas = list(o.betas) if isinstance(o.betas, tuple) else o.betas
            errors.append(f"optim.betas={show(betas)} must be two numbers in [0, 1), e.g. [0.9, 0.999]")
        if not _positive_number(o.eps):
            errors.append(f"optim.eps={o.eps!r} must be a positive (finite) number")
        if o.min_lr_ratio is not None and not 0 <= o.min_lr_ratio <= 1:
            errors.append(f"optim.min_lr_ratio={o.min_lr_ratio!r} must be in [0, 1]")
        if o.fused is not None and not isinstance(o.fused, bool):
            errors.append(f"optim.fused={o.fused!r} must be true, false or null (torch's default)")
        elif o.fused and (o.optimizer != "adamw" or self.strategy == "megatron"):
            errors.append("optim.fused=true applies to AdamW on the data-parallel backends; set null")
        if not _positive_number(o.value_head_lr_ratio):
            errors.append(f"optim.value_head_lr_ratio={o.value_head_lr_ratio!r} must be a positive (finite) number")
        elif o.value_head_lr_ratio != 1 and self.strategy == "megatron":
            errors.append("optim.value_head_lr_ratio != 1 is not supported with strategy=megatron yet; set 1")
        return errors


_LOGGED_VERL_KEYS: set[frozenset[str]] = set()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive_number(value: Any) -> bool:
    return _finite(value) and value > 0


def _betas_ok(betas: Any) -> bool:
    """AdamW's betas: a pair of numbers, each in [0, 1)."""
    return isinstance(betas, tuple | list) and len(betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in betas)


@dataclass(frozen=True)
class RankSizes:
    """The batch sizes one data-parallel rank runs with, derived once from a `CriticConfig`: rows of a mini-batch
    (one optimizer step), of a training and of a forward micro-batch, and the token budgets of dynamic batching
    (per rank; Ulysses multiplies them by sp)."""

    mini_batch: int
    micro_batch: int
    forward_micro_batch: int
    max_token_len: int
    forward_max_token_len: int

    @classmethod
    def as_given(cls, config: CriticConfig, dp_size: int = 1) -> RankSizes:
        """The sizes of a config already cut to this rank, as verl's workers hand one to a critic: its
        `ppo_mini_batch_size` is the rank's; verl's deprecated global micro-batch sizes are divided by `dp_size`."""
        train, forward = config.micro_batch_sizes(dp_size)
        tokens = (config.ppo_max_token_len_per_gpu, config.forward_max_token_len)
        return cls(config.ppo_mini_batch_size, train, forward, *tokens)

    @classmethod
    def over_ranks(cls, config: CriticConfig, dp_size: int) -> RankSizes:
        """This rank's share of `config`'s global mini-batch (× `rollout_n`) over `dp_size` ranks, as verl's worker
        divides it; `*_per_gpu` sizes are per rank, verl's deprecated global ones are divided too. Errors name the
        keys the user set (the `critic.` section)."""
        mini = config.ppo_mini_batch_size * config.rollout_n
        global_mini = f"critic.ppo_mini_batch_size={config.ppo_mini_batch_size} (global) × rollout_n={config.rollout_n}"
        if mini % dp_size:
            raise ValueError(
                f"{global_mini} is not divisible by the {dp_size} data-parallel ranks; choose a multiple of {dp_size}"
            )
        mini //= dp_size
        micro = per_rank(config.ppo_micro_batch_size_per_gpu, config.ppo_micro_batch_size, dp_size)
        if not config.use_dynamic_bsz and micro is not None and mini % micro:
            key = (
                "ppo_micro_batch_size_per_gpu"
                if config.ppo_micro_batch_size_per_gpu is not None
                else "ppo_micro_batch_size"
            )
            raise ValueError(
                f"critic.{key}={getattr(config, key)} does not divide the per-GPU mini-batch of {mini} rows "
                f"({global_mini} over {dp_size} data-parallel ranks); set critic.ppo_micro_batch_size_per_gpu to a "
                f"divisor of {mini}, or null for one micro-batch per mini-batch"
            )
        train = mini if micro is None else micro
        forward = per_rank(config.forward_micro_batch_size_per_gpu, config.forward_micro_batch_size, dp_size)
        tokens = (config.ppo_max_token_len_per_gpu, config.forward_max_token_len)
        return cls(mini, train, train if forward is None else forward, *tokens)


def per_rank(per_gpu: int | None, global_size: int | None, dp_size: int) -> int | None:
    """A per-rank micro-batch size: the per-GPU field, else verl's deprecated global one divided over DP."""
    if per_gpu is not None or global_size is None:
        return per_gpu
    return max(global_size // dp_size, 1)


def _positive_int_errors(cfg: Any, required: list[str], optional: list[str]) -> list[str]:
    errors = []
    for name in required + optional:
        value = getattr(cfg, name)
        if value is None and name in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            errors.append(f"{name}={value!r} must be a positive integer" + (" or null" if name in optional else ""))
    return errors


def _choice_errors(choices: dict[str, tuple[Any, tuple[str, ...]]]) -> list[str]:
    return [
        f"{name}={value!r} is unknown; expected one of {allowed}"
        for name, (value, allowed) in choices.items()
        if value not in allowed
    ]


def from_mapping(cls: type, data: Mapping, prefix: str = "") -> Any:
    """Instantiate dataclass `cls` from `data`: nested dataclasses recursively, values type-checked against the
    annotations (ints widen to floats, lists to tuples), unknown keys rejected with a suggestion."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            nested = _nested_key(cls, str(key))
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known keys: {sorted(fields)}"
            hint = f"; did you mean '{prefix}{nested}'?" if nested and not close else hint
            raise ValueError(f"unknown config key '{prefix}{key}'{hint}")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, Mapping):
                raise TypeError(f"config key '{prefix}{key}' must be a mapping, got {type(value).__name__}")
            build = getattr(hints[key], "from_dict", None) or functools.partial(from_mapping, hints[key])
            kwargs[key] = build(value, prefix=f"{prefix}{key}.")
        else:
            kwargs[key] = _typed(f"{prefix}{key}", value, hints[key])
    return cls(**kwargs)


def _nested_key(cls: type, key: str) -> str | None:
    """The dotted path of a field named `key` inside a nested dataclass of `cls` (for "did you mean")."""
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            if key in {g.name for g in dataclasses.fields(hint)}:
                return f"{f.name}.{key}"
            deeper = _nested_key(hint, key)
            if deeper:
                return f"{f.name}.{deeper}"
    return None


def _text_hint(value: Any, base: Any) -> str:
    """For text where a number or a boolean is expected, why it is text: `nan` / `inf`, which YAML reads as text and
    no option takes, or a number quoted in YAML or given by `${oc.env:X}` (always text), with how to have it read."""
    if not isinstance(value, str) or base not in (int, float, bool):
        return ""
    text = value.strip().lower()
    if text.lstrip("+-.") in ("nan", "inf", "infinity"):
        return f" ({value} is not a finite number: every numeric option takes one)"
    if text not in ("true", "false") and not _reads_as_number(text):
        return ""
    return (
        " (an ${oc.env:...} value is text, as is a number quoted in YAML: write ${oc.decode:${oc.env:NAME}} to read "
        "it as YAML, or the number without quotes)"
    )


def _reads_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
# integers are 64-bit where they are used (torch's int64 tensors and generator seeds, C sizes and counters)
MAX_INT = 2**63 - 1


def _typed(name: str, value: Any, hint: Any) -> Any:
    """`value` checked against a simple annotation (bool/int/float/str/dict/tuple, a `Literal`, or a union of them:
    the first that accepts it), as the type it names."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _one_of(name, value, [a for a in args if a is not type(None)])
    if origin is typing.Literal:
        if value not in args or isinstance(value, bool) != isinstance(args[0], bool):
            raise ValueError(f"{name}={show(value)} must be {_wanted(hint)}")
        return value
    base = origin or hint
    if base is tuple and args and Ellipsis not in args:
        return _fixed_tuple(name, value, args)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
        dict: isinstance(value, Mapping),
        tuple: isinstance(value, list | tuple),
    }.get(base, True)
    if not ok:
        raise ValueError(f"{name}={show(value)} must be {_wanted(hint)}{_text_hint(value, base)}")
    if base is int and not -MAX_INT - 1 <= value <= MAX_INT:
        raise ValueError(f"{name}={show(value)} is too large: it must be a 64-bit integer (-2**63 to 2**63 - 1)")
    if base is float:
        return _float(name, value)
    return dict(value) if base is dict else tuple(value) if base is tuple else value


def _one_of(name: str, value: Any, options: list[Any]) -> Any:
    """`value` as the first of the union's `options` that accepts it; else one error naming them all (and why text
    is not a number, when it is)."""
    if len(options) == 1:
        return _typed(name, value, options[0])
    for option in options:
        try:
            return _typed(name, value, option)
        except ValueError:
            continue
    hint = next((h for h in (_text_hint(value, typing.get_origin(o) or o) for o in options) if h), "")
    raise ValueError(f"{name}={show(value)} must be {' or '.join(_wanted(o) for o in options)}{hint}")


def _wanted(hint: Any) -> str:
    """What an annotation takes, in words: `an integer`, `'auto'`, `a list of 2`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " or ".join(show(a) for a in args)
    base = origin or hint
    return _TYPE_NAMES.get(base, f"a list of {len(args)}" if base is tuple else str(hint))


def _float(name: str, value: int | float) -> float:
    """`value` as a float; an integer beyond the float range (about 1.8e308) is an error naming the key."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name}={show(value)} is too large: it must be a finite number (below 1.8e308)") from None


def _fixed_tuple(name: str, value: Any, args: tuple) -> tuple:
    """A list of exactly `len(args)` items of the types `args` (e.g. AdamW's betas), as a tuple."""
    if not isinstance(value, list | tuple) or len(value) != len(args):
        plural = _PLURALS.get(args[0], "values") if len(set(args)) == 1 else "values"
        shown = show(list(value) if isinstance(value, tuple) else value)  # as the YAML list it was written as
        raise ValueError(f"{name}={shown} must be a list of {len(args)} {plural}")
    return tuple(_typed(f"{name}[{i}]", item, hint) for i, (item, hint) in enumerate(zip(value, args, strict=True)))


def show(value: Any, limit: int = 80) -> str:
    """`value` for an error message: its repr, an integer of more than 20 digits as its size, cut at `limit`."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**20:
        try:
            return f"<a {len(str(abs(value)))}-digit integer>"
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            return f"<an integer of more than {sys.get_int_max_str_digits()} digits>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
