"""CriticConfig: verl field names, dict / OmegaConf input, unknown keys, and validation messages."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from ppo_critic import CriticConfig
from ppo_critic.config.train import TrainConfig

VERL_CRITIC = """
_target_: verl.workers.config.CriticConfig
rollout_n: 1
strategy: fsdp
enable: null
optim: {lr: 1.0e-5, lr_warmup_steps_ratio: 0.0, total_training_steps: -1, weight_decay: 0.01,
        lr_warmup_steps: -1, min_lr_ratio: null, warmup_style: constant}
model:
  path: ~/models/deepseek-llm-7b-chat
  tokenizer_path: ${model.path}
  override_config: {}
  external_lib: null
  trust_remote_code: false
  use_shm: false
  enable_gradient_checkpointing: true
  enable_activation_offload: false
  use_remove_padding: false
  fsdp_config: {param_offload: false, optimizer_offload: false, wrap_policy: {min_num_params: 0}, fsdp_size: -1}
  lora_rank: 0
  lora_alpha: 16
  target_modules: all-linear
ppo_mini_batch_size: 256
ppo_micro_batch_size: null
ppo_micro_batch_size_per_gpu: 8
forward_micro_batch_size: null
forward_micro_batch_size_per_gpu: 16
use_dynamic_bsz: false
ppo_max_token_len_per_gpu: 32768
forward_max_token_len_per_gpu: ${ppo_max_token_len_per_gpu}
ppo_epochs: 1
shuffle: false
cliprange_value: 0.5
loss_agg_mode: token-mean
ulysses_sequence_parallel_size: 1
grad_clip: 1.0
checkpoint: {save_contents: [model, optimizer, extra], load_contents: [model, optimizer, extra], async_save: false}
profiler: {enable: false, all_ranks: false, ranks: []}
"""


def test_a_verl_critic_section_is_accepted_as_is():
    node = OmegaConf.create(VERL_CRITIC)
    cfg = CriticConfig.from_any(node)
    assert cfg.strategy == "fsdp" and cfg.ppo_micro_batch_size_per_gpu == 8
    assert cfg.model.enable_gradient_checkpointing and cfg.model.tokenizer_path == cfg.model.path
    assert cfg.forward_max_token_len == 32768 and cfg.optim.lr == 1e-5
    assert cfg.micro_batch_sizes() == (8, 16)
    assert CriticConfig.from_any(OmegaConf.to_container(node, resolve=True)) == cfg
    assert CriticConfig.from_any(cfg) == cfg and CriticConfig.from_any(cfg) is not cfg


def test_defaults_and_micro_batch_resolution():
    cfg = CriticConfig()
    assert cfg.strategy == "fsdp2" and cfg.loss_agg_mode == "token-mean" and cfg.cliprange_value == 0.5
    assert cfg.micro_batch_sizes() == (256, 256)  # one micro-batch per mini-batch when unset
    legacy = CriticConfig(ppo_mini_batch_size=16, ppo_micro_batch_size=8, forward_micro_batch_size=32)
    assert legacy.micro_batch_sizes(dp_size=4) == (2, 8)  # verl's deprecated global sizes / DP
    assert CriticConfig(forward_max_token_len_per_gpu=100).forward_max_token_len == 100


def test_unknown_keys_are_named_with_a_suggestion():
    with pytest.raises(ValueError, match=r"unknown config key 'ppo_mini_batchsize'.*'ppo_mini_batch_size'"):
        CriticConfig.from_any({"ppo_mini_batchsize": 4})
    with pytest.raises(ValueError, match=r"'model\.use_remove_pading'.*'model\.use_remove_padding'"):
        CriticConfig.from_any({"model": {"use_remove_pading": True}})
    with pytest.raises(TypeError, match="optim"):
        CriticConfig.from_any({"optim": 0.1})
    with pytest.raises(TypeError, match=r"CriticConfig, a dict, an OmegaConf node or one of verl's critic config"):
        CriticConfig.from_any(["ppo_epochs", 1])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss_agg_mode": "seq-mean"}, "loss_agg_mode='seq-mean' is unknown"),
        ({"strategy": "deepspeed"}, "strategy='deepspeed' is unknown"),
        ({"ppo_mini_batch_size": 0}, "ppo_mini_batch_size=0 must be a positive integer"),
        ({"ppo_epochs": 1.5}, "ppo_epochs=1.5 must be an integer"),
        ({"ppo_epochs": "two"}, "ppo_epochs='two' must be an integer"),
        ({"shuffle": "yes"}, "shuffle='yes' must be true or false"),
        ({"model": {"override_config": [1]}}, "model.override_config=[1] must be a mapping"),
        ({"optim": {"lr": "fast"}}, "optim.lr='fast' must be a number"),
        ({"ppo_micro_batch_size_per_gpu": -2}, "ppo_micro_batch_size_per_gpu=-2"),
        ({"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 3}, "not divisible by the micro-batch size 3"),
        ({"shuffle": True}, "shuffle=true needs data_loader_seed"),
        ({"cliprange_value": -0.2}, "cliprange_value=-0.2 must be a positive (finite) number"),
        ({"grad_clip": 0}, "grad_clip=0.0 must be a positive (finite) number"),
        ({"dtype": "int8"}, "dtype='int8' is unknown"),
        (
            {"ulysses_sequence_parallel_size": 2, "model": {"use_remove_padding": False}},
            "needs model.use_remove_padding=true (or auto)",
        ),
        (
            {"ulysses_sequence_parallel_size": 2, "model": {"attn_implementation": "flash_attention_2"}},
            "model.attn_implementation=flash_attention_2 cannot run Ulysses",
        ),
        (
            {"ulysses_sequence_parallel_size": 4, "model": {"attn_implementation": "flash_attention_3"}},
            "model.attn_implementation=flash_attention_3 cannot run Ulysses",
        ),
        (
            {"model": {"use_remove_padding": "yes"}},
            "model.use_remove_padding='yes' must be true or false or 'auto'",
        ),
        ({"model": {"use_remove_padding": 1}}, "model.use_remove_padding=1 must be true or false or 'auto'"),
        ({"model": {"value_head_init": "normal:abc"}}, "model.value_head_init='normal:abc' is invalid"),
        ({"model": {"value_head_dtype": "fp8"}}, "model.value_head_dtype='fp8' is unknown"),
        ({"model": {"head": "mlp"}}, "model.head='mlp' is unknown"),
        ({"model": {"lora_rank": -1}}, "model.lora_rank=-1 must be an integer >= 0"),
        ({"optim": {"betas": [0.9, 1.5]}}, "optim.betas"),
        ({"optim": {"warmup_style": "linear"}}, "optim.warmup_style='linear' is unknown"),
        ({"optim": {"lr": float("inf")}}, "optim.lr=inf must be a finite number >= 0"),
        ({"optim": {"weight_decay": -0.1}}, "optim.weight_decay=-0.1 must be a finite number >= 0"),
        ({"model": {"value_head_init": "normal:1e999"}}, "the standard deviation must be positive and finite"),
        ({"model": {"override_config": {"hidden_size": 0}}}, "model.override_config.hidden_size=0 must be a positive"),
        ({"rollout_n": 0}, "rollout_n=0 must be a positive integer"),
    ],
)
def test_each_invalid_setting_is_explained(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        CriticConfig.from_dict(overrides).validate()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"param_dtype": "int8"},
            "param_dtype='int8' is unknown; use bfloat16 (float32 master weights), float32 or null",
        ),
        (
            {"strategy": "none", "param_dtype": "fp16"},
            "param_dtype=fp16 is not supported (float16 gradients need loss scaling); use bfloat16 or null",
        ),
        (
            {"param_dtype": "bf16"},
            "param_dtype=bf16 is what strategy=fsdp2 does by itself (float32 shards, the master weights, gathered in "
            "dtype by its MixedPrecisionPolicy); set param_dtype null and choose the gathered dtype with dtype",
        ),
        (
            {"strategy": "fsdp", "param_dtype": "bfloat16"},
            "param_dtype=bfloat16 is not supported with strategy=fsdp (FSDP1); use strategy none or ddp, or fsdp2 "
            "(float32 shards gathered in dtype), or set param_dtype null",
        ),
        (
            {"strategy": "megatron", "param_dtype": "bfloat16"},
            "param_dtype=bfloat16 is what strategy=megatron does by itself (parameters in dtype, float32 main weights "
            "in its optimizer); set param_dtype null",
        ),
        (
            {"strategy": "none", "param_dtype": "bfloat16", "dtype": "fp32"},
            "param_dtype=bfloat16 computes in bfloat16, not dtype=fp32; set dtype=bfloat16 or null",
        ),
        (
            {"strategy": "ddp", "param_dtype": "bfloat16", "model": {"fsdp_config": {"optimizer_offload": True}}},
            "model.fsdp_config.optimizer_offload=true with param_dtype=bfloat16 is not supported (the float32 master "
            "weights would stay on the device); set optimizer_offload false or param_dtype null",
        ),
    ],
)
def test_param_dtype_is_refused_in_one_line_where_it_cannot_apply(overrides, message):
    with pytest.raises(ValueError) as info:
        CriticConfig.from_dict(overrides).validate(prefix="critic.")
    assert str(info.value) == f"invalid critic config:\n  - critic.{message}"


@pytest.mark.parametrize("strategy", ["none", "ddp"])
def test_bf16_parameters_compute_in_bf16_and_float32_parameters_change_nothing(strategy):
    config = CriticConfig.from_any({"strategy": strategy, "param_dtype": "bf16"}, worker=True)
    assert config.param_dtype_name == config.torch_dtype_name == "bfloat16"
    config = CriticConfig.from_any({"strategy": strategy, "param_dtype": "bf16", "dtype": "bfloat16"}, worker=True)
    assert config.torch_dtype_name == "bfloat16"
    for unchanged in ({}, {"param_dtype": "float32"}, {"param_dtype": "fp32", "strategy": "megatron"}):
        config = CriticConfig.from_any(unchanged, worker=True)
        assert config.param_dtype_name is None and config.torch_dtype_name is None


@pytest.mark.parametrize(
    "overrides",
    [
        {"model": {"enable_activation_offload": True}},
        {"strategy": "fsdp", "model": {"fsdp_config": {"param_offload": True}}},
        {"optim": {"optimizer": "adam"}},
        {"strategy": "megatron", "megatron": {"tensor_model_parallel_size": 2, "sequence_parallel": True}},
    ],
)
def test_the_critic_leaves_model_and_optimizer_settings_to_whoever_built_them(overrides):
    """Inside verl's worker, verl builds the model and optimizer (and honours these); only a ppo-critic worker,
    which builds them itself, rejects what it cannot do."""
    cfg = CriticConfig.from_any(overrides)
    with pytest.raises(ValueError, match="invalid critic config"):
        cfg.validate()


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_use_remove_padding_takes_true_false_or_auto(value):
    assert CriticConfig.from_any({"model": {"use_remove_padding": value}}).model.use_remove_padding == value


def test_ulysses_packs_by_default():
    assert CriticConfig.from_any({"ulysses_sequence_parallel_size": 2}).model.use_remove_padding == "auto"


def test_all_problems_are_reported_at_once():
    with pytest.raises(ValueError) as info:
        CriticConfig.from_any({"loss_agg_mode": "x", "ppo_epochs": 0, "shuffle": True})
    text = str(info.value)
    assert "loss_agg_mode" in text and "ppo_epochs" in text and "data_loader_seed" in text


def test_dynamic_batching_does_not_need_divisible_micro_batches():
    cfg = CriticConfig.from_any({"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 3, "use_dynamic_bsz": True})
    assert cfg.use_dynamic_bsz


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"trainer": {"log_every": 0}}, "trainer.log_every=0 must be >= 1"),
        ({"trainer": {"eval_fraction": 1.0}}, "trainer.eval_fraction=1.0 must be in [0, 1)"),
        ({"trainer": {"eval_fraction": -0.1}}, "trainer.eval_fraction=-0.1 must be in [0, 1)"),
        ({"trainer": {"eval_data": "held_out.jsonl"}}, "trainer.eval_data is read together with data="),
        ({"trainer": {"logger": ["console", "neptune"]}}, "trainer.logger: unknown logger 'neptune'"),
        ({"trainer": {"length_adaptive_alpha": 0}}, "trainer.length_adaptive_alpha=0.0 must be a number > 0"),
        ({"trainer": {"length_adaptive_alpha": "x"}}, "trainer.length_adaptive_alpha='x' must be a number"),
        ({"trainer": {"lam": 0.9}}, "trainer.lam=0.9 has no effect while trainer.length_adaptive_alpha=0.5"),
        (
            {"trainer": {"length_adaptive_scope": "token"}},
            "trainer.length_adaptive_scope='token' must be one of response, batch",
        ),
        (
            {"trainer": {"shared_prefix_returns": "yes"}},
            "trainer.shared_prefix_returns='yes' must be true or false",
        ),
        ({"trainer": {"eval_live_weights": 1}}, "trainer.eval_live_weights=1 must be true or false"),
        ({"task": {"name": "dense", "num_targets": 2}}, "unknown config key 'task.num_targets'"),
        (
            {"task": {"name": "chess"}},
            "task.name='chess' is unknown; built-in tasks: ['counting', 'dense', 'lengths', 'long', 'recall', 'scale']",
        ),
        ({"critic": {"model": {"use_remove_padding": "on"}}}, "critic.model.use_remove_padding='on' must be true or"),
    ],
)
def test_each_invalid_trainer_setting_is_explained(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig.from_mapping(options)


def test_the_trainer_accepts_its_documented_settings():
    cfg = TrainConfig.from_mapping(
        {"data": "train.jsonl", "trainer": {"eval_data": "eval.jsonl", "eval_fraction": 0.0, "logger": "jsonl,wandb"}}
    )
    assert cfg.trainer.eval_data == "eval.jsonl" and cfg.trainer.logger == ["jsonl", "wandb"]  # normalised


# ---------------------------------------------------------------------------------------------------------------
# Issue 30: values too large for their type, malformed betas, sizes that cannot be allocated; each one message


HUGE = 10**399  # 400 digits: no float holds it


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"trainer": {"gamma": HUGE}}, "trainer.gamma=<a 400-digit integer> is too large: it must be a finite number"),
        ({"trainer": {"dist_timeout_s": HUGE}}, "trainer.dist_timeout_s=<a 400-digit integer> is too large"),
        ({"trainer": {"dist_timeout_s": 1e300}}, "trainer.dist_timeout_s=1e+300 is too large: torch.distributed"),
        ({"trainer": {"steps": 10**4999}}, "trainer.steps=<an integer of more than 4300 digits> is too large"),
        ({"trainer": {"steps": 2**63}}, "trainer.steps=9223372036854775808 is too large: it must be a 64-bit integer"),
        ({"task": {"max_prompt_len": -(2**70)}}, "task.max_prompt_len=<a 22-digit integer> is too large"),
        ({"critic": {"optim": {"betas": [0.9]}}}, "critic.optim.betas=[0.9] must be a list of 2 numbers"),
        ({"critic": {"optim": {"betas": "x"}}}, "critic.optim.betas='x' must be a list of 2 numbers"),
        ({"critic": {"optim": {"betas": [0.9, 0.99, 0.1]}}}, "critic.optim.betas=[0.9, 0.99, 0.1] must be a list of 2"),
        ({"critic": {"optim": {"betas": [[0.9], [0.99]]}}}, "critic.optim.betas[0]=[0.9] must be a number"),
        ({"critic": {"optim": {"betas": [0.9, True]}}}, "critic.optim.betas[1]=True must be a number"),
        ({"critic": {"optim": {"betas": [0.9, HUGE]}}}, "critic.optim.betas[1]=<a 400-digit integer> is too large"),
        (
            {"critic": {"model": {"override_config": {"max_position_embeddings": HUGE}}}},
            "critic.model.override_config.max_position_embeddings=<a 400-digit integer> must be a positive integer",
        ),
    ],
    ids=[
        "gamma-400-digits",
        "timeout-400-digits",
        "timeout-1e300",
        "steps-5000-digits",
        "steps-2**63",
        "task-length--2**70",
        "betas-one",
        "betas-string",
        "betas-three",
        "betas-nested",
        "betas-bool",
        "betas-400-digits",
        "positions-400-digits",
    ],
)
def test_a_value_too_large_for_its_type_or_malformed_is_one_line_naming_the_key(options, message):
    with pytest.raises(ValueError) as info:
        TrainConfig.from_mapping(options)
    assert message in str(info.value) and len(str(info.value).splitlines()) <= 2  # (critic errors: a title line)


def test_betas_built_in_code_are_checked_without_a_type_error():
    from ppo_critic.config.critic import OptimConfig

    with pytest.raises(ValueError, match=re.escape("optim.betas=[0.9, 'x'] must be two numbers in [0, 1)")):
        CriticConfig(optim=OptimConfig(betas=(0.9, "x"))).validate()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"trainer": {"eval_size": 10**10}}, "trainer.eval_size=10000000000: 10000001056 rollouts (192 a step, 1000"),
        (
            {"trainer": {"rollout_batch_size": 2**40}, "critic": {"ppo_mini_batch_size": 64}},
            "trainer.rollout_batch_size=1099511627776: 6047313953280 rollouts (1099511627776 a step, 512 held out",
        ),
        (
            {"task": {"max_prompt_len": 10**8}},
            "task.max_prompt_len=100000000: 1568 rollouts (192 a step, 512 held out, 864 replayed or held",
        ),
        ({"task": {"name": "recall", "max_distractors": 10**9}}, "task.max_distractors=1000000000: 1568 rollouts"),
        (
            {"trainer": {"replay_rows": 192, "replay_window": 10**9}},
            "trainer.replay_window=1000000000: 192000000896 rollouts (192 a step, 512 held out, 192000000192 replayed",
        ),
        (
            {"data": "x.jsonl", "trainer": {"rollout_batch_size": 2**40}, "critic": {"ppo_mini_batch_size": 64}},
            "trainer.rollout_batch_size=1099511627776: 1099511627776 rollouts a step of at least 2 tokens need at",
        ),
    ],
    ids=[
        "eval-size",
        "rollout-batch",
        "max-prompt-len",
        "recall-distractors",
        "replay-window",
        "rollout-batch-of-a-file",
    ],
)
def test_a_batch_that_cannot_fit_in_memory_is_refused_by_the_config_check(options, message, monkeypatch):
    from ppo_critic.config import train as train_config

    monkeypatch.setattr(train_config, "host_memory", lambda: 64 * 2**30)  # a 64 GiB machine
    with pytest.raises(ValueError) as info:
        TrainConfig.from_mapping(options)
    text = str(info.value)
    assert message in text and "more than this machine's 64.0 GiB; lower" in text and "\n" not in text, text


def test_the_memory_bound_is_the_machines_and_the_default_fits_a_small_one(monkeypatch):
    from ppo_critic.config import train as train_config

    options = {"trainer": {"eval_size": 10**7}}  # 10M rows of >= 18 tokens: >= 4 GiB of token tensors
    monkeypatch.setattr(train_config, "host_memory", lambda: 2**30)
    TrainConfig.from_mapping({})  # the defaults need a few hundred KiB
    with pytest.raises(ValueError, match=r"trainer\.eval_size=10000000: .* more than this machine's 1\.0 GiB"):
        TrainConfig.from_mapping(options)
    monkeypatch.setattr(train_config, "host_memory", lambda: 2**40)
    assert TrainConfig.from_mapping(options).trainer.eval_size == 10**7
    monkeypatch.setattr(train_config, "host_memory", lambda: None)  # unknown: no bound
    assert TrainConfig.from_mapping({"trainer": {"eval_size": 10**10}}).trainer.eval_size == 10**10


def test_host_memory_is_the_physical_memory_or_a_lower_cgroup_limit(tmp_path, monkeypatch):
    import os

    from ppo_critic.config import train as train_config

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setattr(train_config, "CGROUP_LIMITS", (str(tmp_path / "absent"),))
    assert train_config.host_memory() == physical
    (tmp_path / "memory.max").write_text("max\n")  # cgroup v2 without a limit
    (tmp_path / "limit").write_text(f"{2**30}\n")
    monkeypatch.setattr(train_config, "CGROUP_LIMITS", (str(tmp_path / "memory.max"), str(tmp_path / "limit")))
    assert train_config.host_memory() == min(physical, 2**30)


def test_the_longest_row_of_a_file_is_checked_against_memory_when_the_model_is_sized(monkeypatch):
    from ppo_critic.config import train as train_config

    monkeypatch.setattr(train_config, "host_memory", lambda: 8 * 2**30)
    cfg = TrainConfig.from_mapping({"data": "x.jsonl"})
    assert train_config.resolve_model(cfg, 40, 300).critic.model.override_config["max_position_embeddings"] == 300
    message = r"trainer\.rollout_batch_size=192: 192 rollouts a step, padded to the longest row, of at least 3000000"
    with pytest.raises(ValueError, match=message + r" tokens need at least 12\.9 GiB .* lower trainer\.rollout_batch"):
        train_config.resolve_model(cfg, 40, 3_000_000)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"task": {"name": "long"}, "critic": {"model": {"override_config": {"max_position_embeddings": 64}}}},
            "task.max_response_len=288: the task's rows reach at least 294 tokens, more than the model's 64 positions "
            "(critic.model.override_config.max_position_embeddings); use a model with max_position_embeddings >= 294",
        ),
        (
            {"task": {"max_prompt_len": 100}, "critic": {"model": {"path": "MODEL"}}},
            "task.max_prompt_len=100: the task's rows reach at least 112 tokens, more than the model's 32 positions "
            "(max_position_embeddings in MODEL/config.json)",
        ),
    ],
    ids=["override-config", "model-directory"],
)
def test_task_rows_longer_than_the_models_positions_are_refused(options, message, tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 32}))
    options["critic"]["ppo_mini_batch_size"] = 96  # the trainer's (a critic section starts from verl's defaults)
    if "path" in options["critic"]["model"]:
        options["critic"]["model"]["path"] = str(tmp_path)
    with pytest.raises(ValueError) as info:
        TrainConfig.from_mapping(options)
    assert message.replace("MODEL", str(tmp_path)) in str(info.value)
    TrainConfig.from_mapping({**options, "task": {"name": "counting"}})  # 20 tokens: fits in both
