"""verl's critic config, verbatim: the section verl composes with hydra (DictConfig with interpolations, resolved
dict, and the dataclass verl's trainer really passes) is read field by field as verl reads it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from verl.workers.config import FSDPCriticConfig, FSDPOptimizerConfig
from verl.workers.config.critic import FSDPCriticModelCfg
from verl_helpers import critic_dataclass

import ppo_critic.integrations.verl as integration
from ppo_critic import CriticConfig, DataParallelPPOCritic, build_value_model
from ppo_critic.worker import worker_config
from verl_shared import VERL_CONFIG_DIR, composed

SHARED = [
    "critic.ppo_mini_batch_size=32",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "critic.use_dynamic_bsz=true",
    "critic.ppo_max_token_len_per_gpu=4096",
    "critic.ppo_epochs=2",
    "critic.cliprange_value=0.3",
    "critic.loss_agg_mode=seq-mean-token-mean",
    "critic.optim.lr=3e-4",
    "critic.optim.betas=[0.8,0.95]",
    "critic.optim.weight_decay=0.1",
    "critic.optim.lr_warmup_steps=5",
    "critic.shuffle=true",
    "critic.data_loader_seed=7",
    "actor_rollout_ref.rollout.n=4",
]
FSDP = [
    *SHARED,
    "critic.strategy=fsdp2",
    "critic.forward_micro_batch_size_per_gpu=8",
    "critic.grad_clip=0.7",
    "critic.optim.lr_scheduler_type=cosine",
    "critic.optim.min_lr_ratio=0.1",
    "critic.model.use_remove_padding=true",
    "critic.model.enable_gradient_checkpointing=false",
    "critic.model.lora_rank=8",
    "critic.ulysses_sequence_parallel_size=2",
]
MEGATRON = [
    *SHARED,
    "critic.optim.clip_grad=0.7",
    "critic.optim.lr_decay_style=cosine",
    "critic.megatron.tensor_model_parallel_size=2",
    "critic.megatron.sequence_parallel=false",
    "critic.megatron.pipeline_model_parallel_size=4",
    "critic.megatron.virtual_pipeline_model_parallel_size=2",
]


def paths(model_dir: Path) -> list[str]:
    """What verl's dataclass needs before its trainer starts: a real checkpoint (it loads the HF config at
    construction) and a micro-batch size (unless dynamic batching is on)."""
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"critic.model.path={model_dir}",
        "critic.ppo_micro_batch_size_per_gpu=4",
    ]


def settings(cfg: CriticConfig) -> dict:
    """Everything the critic config holds but verl's opaque sections (profiler, checkpoint, FSDP engine), whose
    dataclass form lists more defaults than the yaml."""
    out = cfg.to_dict()
    del out["profiler"], out["checkpoint"], out["model"]["fsdp_config"]
    return out


def forms(cfg):
    """The critic section in every form verl produces it."""
    return {
        "DictConfig": cfg.critic,
        "resolved dict": OmegaConf.to_container(cfg.critic, resolve=True),
        "dataclass": critic_dataclass(cfg),
    }


@pytest.mark.parametrize(("config_name", "overrides"), [("ppo_trainer", FSDP), ("ppo_megatron_trainer", MEGATRON)])
def test_every_form_of_verls_composed_config_reads_as_verl_reads_it(config_name, overrides, model_dir):
    cfg = composed(overrides + paths(model_dir), config_name)
    read = {name: CriticConfig.from_any(form) for name, form in forms(cfg).items()}
    ours = read["dataclass"]
    assert settings(read["DictConfig"]) == settings(ours) == settings(read["resolved dict"])
    verl = critic_dataclass(cfg)  # verl's own reading of its config
    same = [
        "ppo_mini_batch_size",
        "ppo_micro_batch_size_per_gpu",
        "use_dynamic_bsz",
        "ppo_max_token_len_per_gpu",
        "forward_max_token_len_per_gpu",
        "ppo_epochs",
        "cliprange_value",
        "loss_agg_mode",
        "data_loader_seed",
        "rollout_n",
        "strategy",
    ]
    assert {k: getattr(ours, k) for k in same} == {k: getattr(verl, k) for k in same}
    assert ours.rollout_n == 4 and ours.ppo_epochs == 2  # an interpolation from the actor section, resolved
    assert (ours.optim.lr, tuple(ours.optim.betas), ours.optim.weight_decay) == (3e-4, (0.8, 0.95), 0.1)
    assert ours.optim.lr_warmup_steps == verl.optim.lr_warmup_steps == 5
    assert ours.optim.total_training_steps == verl.optim.total_training_steps
    assert ours.optim.warmup_style == "cosine"
    assert (ours.model.path, ours.model.tokenizer_path) == (verl.model.path, verl.model.tokenizer_path)
    assert ours.model.trust_remote_code == verl.model.trust_remote_code
    if config_name == "ppo_trainer":
        assert ours.grad_clip == verl.grad_clip == 0.7  # verl's FSDP critic clips with critic.grad_clip
        assert ours.forward_micro_batch_size_per_gpu == verl.forward_micro_batch_size_per_gpu == 8
        assert ours.ulysses_sequence_parallel_size == verl.ulysses_sequence_parallel_size == 2
        assert ours.model.use_remove_padding is verl.model.use_remove_padding is True
        assert ours.model.enable_gradient_checkpointing is verl.model.enable_gradient_checkpointing is False
        assert (ours.model.lora_rank, ours.model.lora_alpha) == (verl.model.lora_rank, verl.model.lora_alpha)
        assert verl.optim.lr_scheduler_type == "cosine" and ours.optim.min_lr_ratio == verl.optim.min_lr_ratio
        # verl's FSDP critic never reads `shuffle` (mini-batches in order): neither does ppo-critic for its config
        assert verl.shuffle is True and ours.shuffle is False and ours.verl_keys["shuffle"] is True
    else:
        assert ours.grad_clip == verl.optim.clip_grad == 0.7  # verl's megatron critic clips with optim.clip_grad
        assert ours.shuffle is verl.shuffle is True  # verl's megatron critic shuffles (its DataLoader)
        layout = ["tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"]
        layout += ["context_parallel_size", "sequence_parallel", "use_distributed_optimizer"]
        assert {k: getattr(ours.megatron, k) for k in layout} == {k: getattr(verl.megatron, k) for k in layout}
        assert ours.optim.optimizer == "adamw"  # megatron's adam has decoupled weight decay


def test_verls_default_configs_construct_the_critic_and_the_worker_config(model_dir):
    """No edits: the defaults verl composes (strategy fsdp, megatron's sequence_parallel=true at TP=1, ...)."""
    for config_name in ("ppo_trainer", "ppo_megatron_trainer"):
        for name, form in forms(composed(paths(model_dir), config_name)).items():
            cfg = worker_config(form)  # what a ppo-critic worker checks, beyond the critic's own settings
            assert cfg.strategy == ("megatron" if "megatron" in config_name else "fsdp"), name
            assert cfg.megatron.sequence_parallel is False  # verl switches it off at TP=1
    model = build_value_model({"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 1, "vocab_size": 64})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for form in forms(composed(paths(model_dir))).values():
        critic = DataParallelPPOCritic(form, model, optimizer)
        assert critic.config.ppo_mini_batch_size == 256 and critic.config.micro_batch_sizes() == (4, 4)


def test_verls_dataclass_built_by_hand_as_in_verls_own_tests(model_dir):
    verl = FSDPCriticConfig(
        strategy="fsdp2",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        forward_micro_batch_size_per_gpu=2,
        optim=FSDPOptimizerConfig(lr=1e-6, warmup_style="cosine", grad_clip=0.3),
        model=FSDPCriticModelCfg(path=str(model_dir), use_remove_padding=False),
    )
    ours = CriticConfig.from_any(verl)
    assert (ours.ppo_mini_batch_size, ours.micro_batch_sizes()) == (4, (2, 2))
    assert ours.optim.warmup_style == "cosine"  # the deprecated warmup_style wins, as in verl
    assert ours.verl_keys["optim.clip_grad"] == 0.3  # optim.grad_clip: verl's deprecated spelling of clip_grad
    assert ours.shuffle is False and ours.verl_keys["shuffle"] is True  # the dataclass default, never read


def test_keys_of_verls_worker_are_set_aside_and_listed_once(caplog):
    cfg = composed(["critic.strategy=fsdp2"])
    with caplog.at_level(logging.DEBUG, logger="ppo_critic.config.critic"):
        first = CriticConfig.from_any(cfg.critic)
        CriticConfig.from_any(cfg.critic)
    listed = [r.getMessage() for r in caplog.records if "read by verl's worker" in r.getMessage()]
    assert len(listed) <= 1  # once per process (an earlier test may have listed this set already)
    for key in ("optim.optimizer_impl", "optim.clip_grad", "optim.num_cycles", "optim.zero_indexed_step"):
        assert key in first.verl_keys
    assert first.verl_keys["optim.optimizer_impl"] == "torch.optim"
    assert {"model.tiled_mlp", "optim.override_optimizer_config"} <= first.verl_keys.keys()
    assert first.optim.optimizer == "adamw"  # verl's `AdamW`


def test_an_unknown_key_in_a_verl_config_is_still_an_error():
    cfg = composed(["critic.strategy=fsdp2", "+critic.ppo_mini_batchsize=3"])
    with pytest.raises(ValueError, match=r"unknown config key 'ppo_mini_batchsize'.*'ppo_mini_batch_size'"):
        CriticConfig.from_any(cfg.critic)
    cfg = composed(["critic.strategy=fsdp2", "+critic.optim.lr_sheduler_type=cosine"])
    with pytest.raises(ValueError, match=r"unknown config key 'optim.lr_sheduler_type'"):
        CriticConfig.from_any(cfg.critic)


def test_the_raw_yaml_files_verl_ships():
    raw = OmegaConf.load(VERL_CONFIG_DIR / "critic" / "critic.yaml")
    with pytest.raises(ValueError, match=r"\['strategy'\] are not set.*'\?\?\?'"):
        CriticConfig.from_any(raw)
    dp = OmegaConf.load(VERL_CONFIG_DIR / "critic" / "dp_critic.yaml")  # a hydra `defaults` list, interpolations
    cfg = CriticConfig.from_any(dp)
    assert cfg.strategy == "fsdp" and cfg.forward_micro_batch_size_per_gpu is None and cfg.grad_clip == 1.0


def test_settings_a_ppo_critic_worker_cannot_honour_are_errors_there_only():
    cfg = composed(["critic.strategy=fsdp2", "critic.optim.optimizer_impl=torchao.optim"])
    assert CriticConfig.from_any(cfg.critic).verl_keys["optim.optimizer_impl"] == "torchao.optim"  # verl's business
    with pytest.raises(ValueError, match=r"optim.optimizer_impl='torchao.optim' is a setting of verl's worker"):
        worker_config(cfg.critic)
    cfg = composed(["critic.megatron.expert_model_parallel_size=2"], "ppo_megatron_trainer")
    with pytest.raises(ValueError, match=r"megatron.expert_model_parallel_size=2"):
        worker_config(cfg.critic)


def test_ppo_critic_options_travel_in_the_environment(monkeypatch, model_dir):
    """verl's dataclass cannot carry ppo-critic's own keys: PPO_CRITIC_OPTIONS does, for the critics verl builds."""
    verl = critic_dataclass(composed(["critic.strategy=fsdp2", "critic.shuffle=true", *paths(model_dir)]))
    monkeypatch.setenv(integration.OPTIONS_ENV, "ema_decay=0.9 shuffle=true value_norm=running")
    cfg = integration.critic_config(verl)
    assert (cfg.ema_decay, cfg.shuffle, cfg.value_norm, cfg.data_loader_seed) == (0.9, True, "running", 42)
    assert "optim.optimizer_impl" in cfg.verl_keys
    monkeypatch.setenv(integration.OPTIONS_ENV, "ema_decay=2")
    with pytest.raises(ValueError, match=r"PPO_CRITIC_OPTIONS: invalid critic config:\n  - ema_decay=2.0 must be"):
        integration.critic_config(verl)
    monkeypatch.setenv(integration.OPTIONS_ENV, "ema_decay")
    with pytest.raises(ValueError, match=r"PPO_CRITIC_OPTIONS holds \['ema_decay'\]; it takes key=value"):
        integration.critic_config(verl)


def test_the_suite_runs_against_the_installed_verl_release():
    from importlib import metadata

    assert metadata.version("verl").startswith(integration.TESTED_VERL + ".")
    assert Path(VERL_CONFIG_DIR, "critic", "dp_critic.yaml").is_file()
