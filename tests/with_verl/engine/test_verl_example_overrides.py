"""verl 0.9's own example scripts with `critic.strategy=ppo_critic`: each script's critic overrides (pinned in
example_overrides_0.9.1.txt, extracted from verl's examples/**/*.sh by tests/with_verl/example_overrides.py; the
snapshot at hand stops at tag v0.9.0, whose critic overrides are those of verl's main branch of 2026-08-22 too)
composed by hydra as verl composes them, converted as verl's trainer converts them (its v1 trainer and its legacy
one, each with its own token-budget assignment), and read by ppo-critic's engine. Every key must arrive with the
meaning verl gives it — in the field of ppo-critic's config that takes it over, or as verl's own — or be refused in one
line naming it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import verl_cpu  # noqa: F401 - before anything asks verl for its platform
from engine_helpers import critic_config
from verl.trainer.ppo.utils import need_critic
from verl.utils.config import omega_conf_to_dataclass

from example_overrides import OVERRIDE, read_pinned
from ppo_critic.config.verl import ENGINE_DTYPES, ENGINE_FIELDS, engine_keys, to_mapping
from ppo_critic.integrations.verl_engine import engine_critic_config
from verl_shared import composed

PINNED = read_pinned(Path(__file__).with_name("example_overrides_0.9.1.txt"))
# a valid value for each override whose script value is a shell variable (the scripts' defaults); model paths always
# become the tiny test model
SUBSTITUTES = {
    "actor_rollout_ref.actor.ppo_mini_batch_size": "32",
    "actor_rollout_ref.rollout.n": "4",
    "critic.optim.lr": "1e-5",
    "critic.ppo_max_token_len_per_gpu": "24576",
    "critic.megatron.tensor_model_parallel_size": "2",
    "critic.megatron.pipeline_model_parallel_size": "2",
    "trainer.n_gpus_per_node": "8",
    "trainer.nnodes": "1",
}
MODEL_PATHS = ("critic.model.path", "actor_rollout_ref.model.path")
# keys of verl's critic section that verl's trainer or its config dataclass reads, never its engine: the engine
# config field verl's own engine takes the setting from instead (ppo_critic's must agree with it)
ENGINE_SOURCE = {
    "use_dynamic_bsz": "use_dynamic_bsz",  # verl's engines: critic.fsdp.use_dynamic_bsz (default true)
    "ppo_micro_batch_size_per_gpu": "micro_batch_size_per_gpu",  # critic.fsdp.micro_batch_size_per_gpu
    "ppo_max_token_len_per_gpu": "max_token_len_per_gpu",  # the v1 trainer: ppo_infer_max_token_len_per_gpu instead
    "ulysses_sequence_parallel_size": "ulysses_sequence_parallel_size",  # deprecated: critic.fsdp.<same name>
}


def overrides(script: str, model_dir: Path) -> list[str]:
    """The script's overrides with shell variables (and model paths) replaced by valid values, and the critic on
    ppo-critic's engine (in place of verl's fsdp / fsdp2)."""
    out = []
    for line in PINNED[script]:
        assert not line.startswith("--"), f"{script}: {line} (verl 0.9's scripts use verl's ppo_trainer config)"
        match = OVERRIDE.match(line)
        key, value = match["key"], match["value"]
        if key in MODEL_PATHS:
            value = str(model_dir)
        elif "$" in value:
            assert key in SUBSTITUTES, f"{script}: {line} needs a value in SUBSTITUTES"
            value = SUBSTITUTES[key]
        if key != "critic.strategy":
            out.append(f"{match['prefix'] or ''}{key}={value}")
    return [*out, "critic.strategy=ppo_critic"]


def engine_configs(cfg, use_v1: bool):
    """verl's critic dataclass and the engine config its trainer hands the `TrainingWorker`, with the token budgets
    that trainer assigns (v1: the compute-values budget for both; legacy: each its own)."""
    critic = omega_conf_to_dataclass(cfg.critic)
    engine = critic.engine
    engine.infer_max_token_len_per_gpu = critic.ppo_infer_max_token_len_per_gpu
    engine.max_token_len_per_gpu = (
        critic.ppo_infer_max_token_len_per_gpu if use_v1 else critic.ppo_max_token_len_per_gpu
    )
    return critic, engine


def at(node, dotted: str):
    """`node[a][b]` for `a.b` (None where absent)."""
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


@pytest.mark.parametrize("use_v1", [True, False], ids=["v1-trainer", "legacy-trainer"])
@pytest.mark.parametrize("script", sorted(PINNED))
def test_every_example_override_reaches_its_meaning(script, use_v1, model_dir):
    given = overrides(script, model_dir)
    cfg = composed([*given, f"trainer.use_v1={use_v1}"])
    if not need_critic(cfg):  # critic.enable=False: verl builds no critic, so nothing of ppo-critic runs
        assert "critic.enable=False" in given
        return
    critic, engine = engine_configs(cfg, use_v1)
    if "model_engine=megatron" in given:
        # verl's megatron critic section keeps its engine's own strategy: verl's megatron engine runs whatever
        # critic.strategy says (ppo-critic's engine takes verl's dp section: model_engine=dp, or critic=dp_critic)
        assert engine.strategy == "megatron" and critic.strategy == "ppo_critic"
        return
    model, optim = to_mapping(critic.model), to_mapping(critic.optim)
    keys = engine_keys(model, to_mapping(engine), optim)
    ours = engine_critic_config(critic.model, engine, critic.optim).to_dict()
    for override in given:
        key = OVERRIDE.match(override)["key"]
        dotted = key.removeprefix("critic.")
        if dotted in ENGINE_FIELDS:  # a setting ppo-critic's engine takes over
            expected = at(to_mapping(critic), dotted.replace("fsdp.", "engine.", 1))
            expected = ENGINE_DTYPES.get(expected, expected) if dotted == "fsdp.dtype" else expected
            assert dotted in keys.honoured and at(ours, ENGINE_FIELDS[dotted]) == expected, override
        elif dotted in ENGINE_SOURCE:  # verl's trainer reads it, its engine reads the engine config
            assert ours[dotted] == getattr(engine, ENGINE_SOURCE[dotted]), override
        else:
            assert not key.startswith("critic.") or key == "critic.strategy", f"no meaning checked for {override}"


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("fsdp.model_dtype=bf16", "critic.fsdp.model_dtype='bf16' is not supported by the ppo_critic engine: "),
        ("fsdp.full_determinism=true", "critic.fsdp.full_determinism=True is not supported"),
        ("fsdp.qat.enable=true", "critic.fsdp.qat.enable=True is not supported"),
        ("model.enable_activation_offload=true", "critic.model.enable_activation_offload=True is not supported"),
        ("model.lora_adapter_path=/adapter", "critic.model.lora_adapter_path='/adapter' is not supported"),
        ("optim.optimizer_impl=torchao.optim", "critic.optim.optimizer_impl='torchao.optim' is not supported"),
    ],
)
def test_a_setting_the_engine_cannot_honour_is_one_line_naming_it(setting, named, model_dir):
    key, value = setting.split("=")
    verl = critic_config(model_dir, **{key: value})  # verl's own dataclasses, as its trainer converts them
    with pytest.raises(ValueError, match="^" + re.escape(named)) as error:
        engine_keys(to_mapping(verl.model), to_mapping(verl.engine), to_mapping(verl.optim))
    assert "\n" not in str(error.value) and "; " in str(error.value)  # one line: the key, why; what to use
