"""verl 0.7.1's own example scripts through ppo-critic's legacy integration: each script's critic overrides (pinned in
example_overrides_0.7.1.txt, extracted from verl's examples/**/*.sh by tests/with_verl/example_overrides.py) composed
by hydra as verl composes them, converted as verl's trainer converts them, cut to a rank's share as verl's
`CriticWorker` cuts them, then read as ppo-critic's critic reads what that worker hands it. Every key must arrive with
the meaning verl gives it: in the field of ppo-critic's config that reads it, or set aside for verl's worker, which
honours it around the critic (offload, checkpointing, profiling). `trainer.use_legacy_worker_impl=disable` makes verl
train an FSDP critic on its own engine worker instead, which the integration refuses naming the key."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra.errors import ConfigCompositionException, InstantiationException
from omegaconf import OmegaConf
from verl.trainer.ppo.utils import need_critic
from verl_helpers import critic_dataclass

import ppo_critic.integrations.verl as integration
from example_overrides import OVERRIDE, read_pinned
from ppo_critic.config.verl import LEGACY_WORKER_ERROR, to_mapping
from verl_shared import composed

PINNED = read_pinned(Path(__file__).with_name("example_overrides_0.7.1.txt"))
VERL_CONFIGS = ("ppo_trainer", "ppo_megatron_trainer")
# a valid value for each override whose script value is a shell variable (the scripts' own defaults where they set
# one); model paths always become the tiny test model
SUBSTITUTES = {
    "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "32",
    "actor_rollout_ref.rollout.n": "4",
    "algorithm.adv_estimator": "gae",  # the critic's settings are passed (the scripts drop them otherwise)
    "critic.optim.lr": "2e-6",
    "critic.ppo_max_token_len_per_gpu": "8192",
    "critic.ulysses_sequence_parallel_size": "4",
    "critic.model.ulysses_sequence_parallel_size": "4",
    "critic.model.fsdp_config.strategy": "fsdp2",
    "critic.model.fsdp_config.param_offload": "True",
    "critic.model.fsdp_config.optimizer_offload": "True",
    "critic.megatron.tensor_model_parallel_size": "2",
    "critic.megatron.pipeline_model_parallel_size": "2",
    "critic.megatron.virtual_pipeline_model_parallel_size": "null",
    "critic.megatron.context_parallel_size": "1",
    "critic.megatron.expert_model_parallel_size": "8",
    "critic.megatron.expert_tensor_parallel_size": "1",
    "critic.megatron.dist_checkpointing_path": "/tmp/mcore_ckpt",
    "critic.megatron.param_offload": "True",
    "critic.megatron.optimizer_offload": "True",
    "critic.megatron.grad_offload": "True",
    "critic.profiler.ranks": "[0,1]",
    "critic.profiler.all_ranks": "False",
    "trainer.n_gpus_per_node": "8",
    "trainer.nnodes": "1",
}
MODEL_PATHS = ("critic.model.path", "actor_rollout_ref.model.path")
# keys the scripts pass that verl's own yaml has no place for (hydra refuses them before any critic exists): the
# dppo / gspo / sapo scripts derive critic keys from actor ones by text substitution, and each branch's critic keys only
# fit that branch's config
VERL_REJECTS = {
    "ppo_trainer": {
        "critic.model.ulysses_sequence_parallel_size",
        *(f"critic.megatron.{k}" for k in ("tensor_model_parallel_size", "context_parallel_size")),
        *(f"critic.megatron.{k}" for k in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")),
        *(f"critic.megatron.{k}" for k in ("expert_model_parallel_size", "expert_tensor_parallel_size")),
        *(f"critic.megatron.{k}" for k in ("param_offload", "grad_offload", "optimizer_offload", "use_mbridge")),
        *(f"critic.megatron.override_transformer_config.{k}" for k in ("moe_router_dtype", "moe_permute_fusion")),
        *(f"critic.megatron.override_transformer_config.{k}" for k in ("recompute_method", "recompute_granularity")),
        *(f"critic.megatron.override_transformer_config.{k}" for k in ("recompute_num_layers", "apply_rope_fusion")),
        "critic.megatron.override_transformer_config.gradient_accumulation_fusion",
    },
    "ppo_megatron_trainer": {
        "critic.model.use_remove_padding",
        "critic.model.ulysses_sequence_parallel_size",
        "critic.ulysses_sequence_parallel_size",
        *(f"critic.model.fsdp_config.{k}" for k in ("strategy", "param_offload", "optimizer_offload")),
    },
}
# keys outside `critic` whose value verl's critic yaml interpolates -> the critic field it lands in
INTERPOLATED = {
    "actor_rollout_ref.rollout.n": "rollout_n",
    "actor_rollout_ref.actor.use_dynamic_bsz": "use_dynamic_bsz",
    "actor_rollout_ref.actor.loss_agg_mode": "loss_agg_mode",
    "actor_rollout_ref.model.path": "model.tokenizer_path",
}


def variants() -> list[tuple[str, str]]:
    """(script, verl config): a script that picks its config at run time (`--config-name=$VAR`) runs under each."""
    out = []
    for script, block in PINNED.items():
        name = next((line.split("=", 1)[1] for line in block if line.startswith("--config-name=")), "ppo_trainer")
        out += [(script, c) for c in VERL_CONFIGS] if name.startswith("$") else [(script, _verl_config(name))]
    return out


def _verl_config(name: str) -> str:
    """verl's config a script's own one derives from (the examples' yaml files start from `ppo_trainer`)."""
    return name if name in VERL_CONFIGS else "ppo_trainer"


def overrides(script: str, model_dir: Path) -> list[str]:
    """The script's overrides with shell variables (and model paths) replaced by valid values."""
    out = []
    for line in PINNED[script]:
        match = OVERRIDE.match(line)
        if line.startswith("--config-name=") or match is None:
            continue
        key, value = match["key"], match["value"]
        if key in MODEL_PATHS:
            value = str(model_dir)
        elif value is not None and "$" in value:
            assert key in SUBSTITUTES, f"{script}: {line} needs a value in SUBSTITUTES"
            value = SUBSTITUTES[key]
        out.append(f"{match['prefix'] or ''}{key}" + ("" if value is None else f"={value}"))
    return out


_BASES: dict[str, object] = {}
ABSENT = object()


def rejected_by_verl(overrides: list[str], config: str, model_dir: Path) -> set[str]:
    """The keys verl refuses: where its composed config has no such key (hydra's error), or, added with `+`, no such
    section (its config dataclass's error)."""
    if config not in _BASES:
        _BASES[config] = composed([f"{k}={model_dir}" for k in MODEL_PATHS], config)
    matches = [OVERRIDE.match(o) for o in overrides]
    where = {m["key"]: m["key"].rsplit(".", 1)[0] if m["prefix"] else m["key"] for m in matches}
    return {key for key, place in where.items() if OmegaConf.select(_BASES[config], place, default=ABSENT) is ABSENT}


def handed_over(cfg):
    """The critic config verl's `CriticWorker` (FSDP or megatron) hands the critic: verl's dataclass with the
    mini-batch times rollout_n and, like the deprecated micro-batch sizes, divided over the data-parallel ranks."""
    config = critic_dataclass(cfg)
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    if config.strategy == "megatron":
        m = config.megatron
        dp = world // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size)
    else:
        dp = world // config.ulysses_sequence_parallel_size
    config.ppo_mini_batch_size = config.ppo_mini_batch_size * config.rollout_n // dp
    if config.ppo_micro_batch_size is not None:
        config.ppo_micro_batch_size //= dp
        config.ppo_micro_batch_size_per_gpu = config.ppo_micro_batch_size
    return config, dp


def at(node, dotted: str):
    """`node[a][b]` for `a.b`, or ABSENT."""
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return ABSENT
        node = node[part]
    return node


def ours_at(ours, dotted: str):
    """The value ppo-critic holds for a verl key: its config field (sections like `model.fsdp_config` included), else
    what it set aside for verl's worker (a key, or one inside a set-aside section); ABSENT when neither has it."""
    value = at(ours.to_dict(), dotted)
    for aside, held in ours.verl_keys.items():
        if value is ABSENT and (dotted == aside or dotted.startswith(aside + ".")):
            value = held if dotted == aside else at(held, dotted.removeprefix(aside + "."))
    return value


@pytest.mark.parametrize(("script", "config"), variants(), ids=[f"{s}-{c}" for s, c in variants()])
def test_every_example_override_reaches_its_meaning(script, config, model_dir):
    given = overrides(script, model_dir)
    refused = rejected_by_verl(given, config, model_dir)
    assert refused <= VERL_REJECTS[config], f"verl's own {config} has no place for {sorted(refused)}"
    cfg = composed([o for o in given if OVERRIDE.match(o)["key"] not in refused], config)
    if need_critic(cfg):
        verl, dp = handed_over(cfg)
        per_rank = cfg.critic.ppo_mini_batch_size * cfg.critic.rollout_n // dp  # the actor's size, interpolated
    else:  # a GRPO script: verl builds no critic; its settings are read as they would be
        verl, per_rank = cfg.critic, cfg.critic.ppo_mini_batch_size
    ours = integration.critic_config(verl)  # what ppo-critic's DataParallelPPOCritic / MegatronPPOCritic construct
    assert ours.ppo_mini_batch_size == per_rank
    handed = to_mapping(verl)
    for override in given:
        key = OVERRIDE.match(override)["key"]
        if key.startswith("critic.") and key not in refused:
            dotted = key.removeprefix("critic.")
            assert ours_at(ours, dotted) == at(handed, dotted) is not ABSENT, override
        elif key in INTERPOLATED:
            assert ours_at(ours, INTERPOLATED[key]) == at(handed, INTERPOLATED[key]) is not ABSENT, override


@pytest.mark.parametrize(
    ("config", "override", "error"),
    [
        ("ppo_trainer", "critic.model.ulysses_sequence_parallel_size=4", ConfigCompositionException),
        ("ppo_trainer", "critic.megatron.tensor_model_parallel_size=2", ConfigCompositionException),
        ("ppo_trainer", "+critic.megatron.override_transformer_config.recompute_num_layers=1", InstantiationException),
        ("ppo_megatron_trainer", "critic.ulysses_sequence_parallel_size=4", ConfigCompositionException),
        ("ppo_megatron_trainer", "critic.model.fsdp_config.param_offload=True", ConfigCompositionException),
    ],
)
def test_verl_itself_refuses_keys_its_yaml_has_no_place_for(config, override, error, model_dir):
    """What `rejected_by_verl` sets aside, verl refuses before any critic exists: hydra a key its yaml lacks, verl's
    config dataclass a section added with `+` that it lacks."""
    key = OVERRIDE.match(override)["key"]
    assert key in VERL_REJECTS[config] and rejected_by_verl([override], config, model_dir) == {key}
    with pytest.raises(error, match="megatron" if error is InstantiationException else f"Could not override '{key}'"):
        critic_dataclass(composed([f"critic.model.path={model_dir}", override], config))


def test_verls_own_engine_worker_for_the_critic_is_refused():
    """`trainer.use_legacy_worker_impl=disable` (verl's dppo, gspo and sapo scripts) makes verl 0.7 build its engine
    `TrainingWorker` for the critic, which would train verl's own critic, not ppo-critic's: refused, naming the key.
    The same worker still serves verl's actor and reference."""
    from verl.workers.engine_workers import TrainingWorker

    scripts = [s for s in PINNED if "trainer.use_legacy_worker_impl=disable" in PINNED[s]]
    assert scripts  # the pinned scripts that set it: the refusal is what their GAE branch meets
    with pytest.raises(ValueError, match=re.escape(LEGACY_WORKER_ERROR)):
        TrainingWorker(SimpleNamespace(model_type="value_model"))
    with pytest.raises(Exception) as other:  # an actor's config reaches verl's own constructor (it then needs Ray)
        TrainingWorker(SimpleNamespace(model_type="language_model"))
    assert LEGACY_WORKER_ERROR not in str(other.value)
