"""verl_config: verl's spellings read as verl reads them, its worker's keys set aside (without verl installed; the
verl suite in tests/with_verl/ checks the same against verl's own yaml and dataclasses)."""

from __future__ import annotations

import dataclasses

import pytest

from ppo_critic import CriticConfig
from ppo_critic.config.verl import normalise, to_mapping, worker_errors

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
