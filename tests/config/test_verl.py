"""verl_config: verl's spellings read as verl reads them, its worker's keys set aside (without verl installed; the
verl suite in tests/with_verl/ checks the same against verl's own yaml and dataclasses)."""

from __future__ import annotations

import dataclasses

import pytest

from ppo_critic import CriticConfig
from ppo_critic.config.verl import (
    engine_keys,
    engine_section,
    normalise,
    to_mapping,
    worker_errors,
)

VERL = "verl.workers.config.FSDPCriticConfig"


def test_scheduler_and_optimizer_spellings():
    read = CriticConfig.from_dict(
        {"optim": {"optimizer": "AdamW", "lr_scheduler_type": "cosine", "warmup_style": None}}
    )
    assert (read.optim.optimizer, read.optim.warmup_style) == ("adamw", "cosine")
    # the deprecated warmup_style wins when set, as in verl's FSDPOptimizerConfig
    both = CriticConfig.from_dict({"optim": {"lr_scheduler_type": "cosine", "warmup_style": "constant"}})
    assert both.optim.warmup_style == "constant"
    megatron = {"strategy": "megatron", "optim": {"optimizer": "adam", "clip_grad": 0.3, "lr_decay_style": "cosine"}}
    read = CriticConfig.from_dict(megatron)
    assert (read.optim.optimizer, read.grad_clip, read.optim.warmup_style) == ("adamw", 0.3, "cosine")
    assert CriticConfig.from_dict({"optim": {"clip_grad": 0.3}}).grad_clip == 1.0  # the FSDP critic: grad_clip


def test_megatron_sections_as_verl_writes_them():
    ours, aside = normalise(
        {
            "strategy": "megatron",
            "model": {"override_config": {"model_config": {"rope_theta": 5e5}, "moe_config": {"freeze": False}}},
            "megatron": {"tensor_model_parallel_size": 1, "sequence_parallel": True, "use_mbridge": True},
        }
    )
    assert ours["model"]["override_config"] == {"rope_theta": 5e5}
    assert ours["megatron"] == {"tensor_model_parallel_size": 1, "sequence_parallel": False}
    assert aside == {"model.override_config.moe_config": {"freeze": False}, "megatron.use_mbridge": True}


@pytest.mark.parametrize(("strategy", "kept"), [("fsdp", False), ("megatron", True)])
def test_shuffle_of_a_verl_config_does_what_verls_critic_did(strategy, kept):
    """verl 0.7's FSDP critic never reads `shuffle`; its megatron critic shuffles (unseeded when no seed is set)."""
    read = CriticConfig.from_dict({"_target_": VERL, "strategy": strategy, "shuffle": True, "data_loader_seed": None})
    assert read.shuffle is kept and (read.verl_keys.get("shuffle") is True) is not kept
    assert CriticConfig.from_dict({"strategy": strategy, "shuffle": True, "data_loader_seed": 3}).shuffle  # ours


def test_hydra_keys_and_missing_values():
    nested = {"_target_": VERL, "defaults": ["critic"], "strategy": "fsdp2", "checkpoint": {"_target_": "x", "a": 1}}
    assert normalise(nested)[0] == {"strategy": "fsdp2", "checkpoint": {"a": 1}}
    with pytest.raises(ValueError, match=r"\['critic.optim.lr', 'critic.strategy'\] are not set"):
        normalise({"strategy": "???", "optim": {"lr": "???"}, "profiler": {"tool": "???"}}, prefix="critic.")


def test_a_dataclass_reads_field_by_field():
    @dataclasses.dataclass
    class Optim:
        lr: float = 0.1

    @dataclasses.dataclass
    class Section:
        strategy: str = "fsdp2"
        optim: Optim = dataclasses.field(default_factory=Optim)
        model_config: object = dataclasses.field(default_factory=object)

    assert to_mapping(Section()) == {"strategy": "fsdp2", "optim": {"lr": 0.1}, "model_config": "<object>"}
    assert CriticConfig.from_any(Section()).optim.lr == 0.1


def test_worker_errors_look_inside_set_aside_sections():
    assert worker_errors({"model.lora": {"rank": 0}, "optim.optimizer_impl": "torch.optim"}) == []
    (error,) = worker_errors({"model.lora": {"rank": 8, "alpha": 16}})
    assert error.startswith("model.lora.rank=8 is a setting of verl's worker that ppo-critic's worker does not")


# verl 0.9's configs as its trainer hands them to the ppo_critic engine (a few keys of each, as `to_mapping` gives them)
MODEL = {"_target_": "verl.workers.config.model.HFModelConfig", "path": "Qwen/Qwen3-8B", "local_path": "/cache/qwen"}
MODEL |= {"use_remove_padding": False, "tokenizer_path": None, "lora": {"rank": 0}, "lora_adapter_path": None}
ENGINE = {"_target_": "verl.workers.config.engine.FSDPEngineConfig", "dtype": "bfloat16", "param_offload": True}
ENGINE |= {"micro_batch_size_per_gpu": 4, "max_token_len_per_gpu": None, "use_remove_padding": True, "fsdp_size": 8}
ENGINE |= {"qat": {"enable": False, "mode": "w4a16"}, "seed": 42}
OPTIM = {"_target_": "verl.workers.config.optimizer.FSDPOptimizerConfig", "optimizer": "AdamW", "lr": 1e-5}
OPTIM |= {"clip_grad": 0.5, "optimizer_impl": "torch.optim", "zero_indexed_step": True}


def test_engine_keys_sort_every_key_of_verls_configs():
    keys = engine_keys(MODEL, ENGINE, OPTIM)
    assert set(keys.honoured) == {
        *("model.path", "model.local_path", "model.use_remove_padding"),
        *("fsdp.dtype", "fsdp.param_offload", "fsdp.micro_batch_size_per_gpu", "fsdp.max_token_len_per_gpu"),
        *("fsdp.seed", "optim.optimizer", "optim.lr", "optim.clip_grad"),
    }
    # verl's own (its engine's knobs, what verl reads around the engine), and refusable keys at an allowed value
    assert set(keys.verls) == {
        *("model.tokenizer_path", "model.lora", "model.lora_adapter_path", "fsdp.use_remove_padding"),
        *("fsdp.fsdp_size", "fsdp.qat", "optim.optimizer_impl", "optim.zero_indexed_step"),
    }


def test_engine_settings_it_cannot_honour_are_one_line_naming_each():
    engine = ENGINE | {"model_dtype": "bf16", "qat": {"enable": True}, "pad_to_length": True, "new_knob": 3}
    with pytest.raises(ValueError) as error:
        engine_keys(MODEL | {"lora": {"rank": 8}}, engine | {"future_flag": None}, OPTIM)
    message = str(error.value)
    assert "\n" not in message
    assert [part.split("=")[0] for part in message.split(" | ")] == [
        "critic.model.lora.rank",
        "critic.fsdp.qat.enable",
        "critic.fsdp.model_dtype",
        "critic.fsdp.new_knob",  # unknown and set: refused; unknown and unset (future_flag=None): verl's
    ]
    assert (
        "critic.fsdp.model_dtype='bf16' is not supported by the ppo_critic engine: ppo-critic keeps float32" in message
    )
    assert "does not know (it knows verl 0.9's); remove it" in message
    with pytest.raises(
        ValueError, match=r"^critic.strategy=ppo_critic got verl's McoreEngineConfig; .*model_engine=dp"
    ):
        engine_keys(MODEL, {"_target_": "verl.workers.config.engine.McoreEngineConfig"}, OPTIM)


ULYSSES_UNPACKED = (
    "critic.fsdp.ulysses_sequence_parallel_size=2 needs critic.model.use_remove_padding=true (Ulysses shards packed "
    "sequences); set critic.model.use_remove_padding=true, or critic.fsdp.ulysses_sequence_parallel_size=1"
)


def test_ulysses_without_packing_is_one_line_naming_verls_keys():
    ulysses = ENGINE | {"ulysses_sequence_parallel_size": 2}
    with pytest.raises(ValueError) as error:
        engine_keys(MODEL | {"use_remove_padding": False}, ulysses, OPTIM)
    assert str(error.value) == ULYSSES_UNPACKED
    assert engine_keys(MODEL | {"use_remove_padding": True}, ulysses, OPTIM).honoured["model.use_remove_padding"]


@pytest.mark.parametrize(
    ("dtype", "mixed", "ours"),
    [
        ("bfloat16", {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}, "float32"),
        ("bfloat16", {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}, None),  # verl's default
        ("bfloat16", {"param_dtype": "fp16", "reduce_dtype": "float32"}, "float16"),
        ("float32", {"param_dtype": 32, "reduce_dtype": "32"}, "float32"),  # verl's PrecisionType spellings
        ("float16", {"reduce_dtype": "fp32"}, "float16"),  # no param_dtype: critic.fsdp.dtype decides
    ],
)
def test_mixed_precision_that_ppo_critic_computes_sets_the_compute_dtype(dtype, mixed, ours):
    """verl's FSDP engine computes in `mixed_precision.param_dtype` (verl's default `dtype` bfloat16 gives way);
    ppo-critic's FSDP2 policy gathers parameters in the compute dtype and reduces gradients in float32."""
    keys = engine_keys(MODEL, ENGINE | {"dtype": dtype, "mixed_precision": mixed}, OPTIM)
    assert keys.honoured["fsdp.mixed_precision"] == mixed
    assert engine_section(MODEL, ENGINE | {"dtype": dtype, "mixed_precision": mixed}, OPTIM)["dtype"] == ours


def test_mixed_precision_that_ppo_critic_cannot_compute_is_refused_naming_the_key():
    mixed = {"param_dtype": "bf16", "reduce_dtype": "bf16", "buffer_dtype": "fp16"}
    with pytest.raises(ValueError) as error:
        engine_keys(MODEL, ENGINE | {"mixed_precision": mixed}, OPTIM)
    assert str(error.value).split(" | ") == [
        "critic.fsdp.mixed_precision.reduce_dtype='bf16' is not supported by the ppo_critic engine: ppo-critic reduces "
        "gradients in float32; set fp32",
        "critic.fsdp.mixed_precision.buffer_dtype='fp16' is not supported by the ppo_critic engine: ppo-critic keeps "
        "buffers in float32; set fp32",
    ]
    with pytest.raises(ValueError, match=r"^critic.fsdp.mixed_precision=True is not supported .*: verl reads it as a"):
        engine_keys(MODEL, ENGINE | {"mixed_precision": True}, OPTIM)
    with pytest.raises(ValueError) as error:
        engine_keys(MODEL, ENGINE | {"dtype": "float16", "mixed_precision": {"param_dtype": "fp32"}}, OPTIM)
    assert str(error.value) == (
        "critic.fsdp.mixed_precision.param_dtype='fp32' disagrees with critic.fsdp.dtype='float16' (both set the "
        "compute dtype; verl's FSDP engine takes param_dtype); set critic.fsdp.dtype=float32, or remove param_dtype"
    )


@pytest.mark.parametrize(("dtype", "ours"), [("bfloat16", None), ("fp16", "float16"), ("float32", "float32")])
def test_engine_section_is_what_the_engine_runs(dtype, ours):
    section = engine_section(MODEL, ENGINE | {"dtype": dtype}, OPTIM)
    assert section == {
        "strategy": "fsdp2",
        "ppo_mini_batch_size": 4,  # verl's worker cuts the mini-batches: one is a micro-batch at most
        "ppo_micro_batch_size_per_gpu": 4,
        "dtype": ours,  # bfloat16: ppo-critic's default (bf16 autocast on CUDA, float32 on the CPU)
        "grad_clip": 0.5,
        "model": {"path": "/cache/qwen", "use_remove_padding": False, "fsdp_config": {"param_offload": True}},
        "optim": {"optimizer": "AdamW", "lr": 1e-5},
    }
    read = CriticConfig.from_dict(section)
    assert (read.ppo_max_token_len_per_gpu, read.optim.optimizer, read.model.fsdp_config) == (
        32768,  # verl left the budget unset: ppo-critic's default
        "adamw",
        {"param_offload": True},
    )
