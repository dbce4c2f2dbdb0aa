"""Option descriptions: every config field has one, `--help` and `configs/default.yaml` show them all."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from ppo_critic import options
from ppo_critic.bench_config import BenchConfig
from ppo_critic.cli import load_config
from ppo_critic.config import CriticConfig, MegatronConfig, ModelConfig, OptimConfig
from ppo_critic.tasks import TASK_CONFIGS
from ppo_critic.train_config import DEFAULT_MODEL, TrainConfig, TrainerConfig

DEFAULT_YAML = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
DOCUMENTED = [CriticConfig, OptimConfig, ModelConfig, MegatronConfig, TrainerConfig, TrainConfig, BenchConfig]


@pytest.mark.parametrize("cls", DOCUMENTED + list(TASK_CONFIGS.values()), ids=lambda cls: cls.__name__)
def test_every_config_field_has_a_one_line_description(cls):
    docs = options.field_docs(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    assert [name for name in names if name not in docs] == [], "add an attribute docstring after each of these"
    assert set(docs) <= set(names)  # no description of a field that is gone
    assert all("\n" not in doc and len(doc) > 10 for doc in docs.values())


def test_the_shipped_default_config_is_the_rendered_one_and_loads_back_to_the_defaults():
    assert DEFAULT_YAML.read_text() == options.render_yaml(TrainConfig()), (
        "configs/default.yaml is out of date; regenerate it: ppo-critic train --print-config > configs/default.yaml"
    )
    assert load_config(DEFAULT_YAML, []).to_dict() == TrainConfig().to_dict()


def test_the_yaml_lists_every_option_with_its_description_as_a_comment():
    lines = options.render_yaml(TrainConfig()).splitlines()
    optim, trainer = options.field_docs(OptimConfig), options.field_docs(TrainerConfig)
    task = options.field_docs(TASK_CONFIGS["counting"])
    assert f"    betas: [0.9, 0.999]  # {optim['betas']}" in lines
    assert f"  eval_fraction: 0.1  # {trainer['eval_fraction']}" in lines
    assert f"  # max_response_len: 12  # {task['max_response_len']}" in lines
    assert f"  # num_fillers: 8  # {task['num_fillers']}" in lines  # left at its default by `task`: commented out
    settings = [line for line in lines if line and not line.startswith("#")]
    assert len(settings) == len(options.train_options(TrainConfig()))  # one line per option and per group


def test_yaml_of_changed_options_loads_back_to_them(tmp_path):
    cfg = load_config(None, ["trainer.steps=7", "task.num_fillers=5", "critic.optim.betas=[0.8,0.9]"])
    written = tmp_path / "cfg.yaml"
    written.write_text(options.render_yaml(cfg))
    assert load_config(written, []) == cfg
    assert yaml.safe_load(written.read_text())["task"]["num_fillers"] == 5


def test_help_groups_every_option_by_section_with_its_default_and_description():
    cfg = TrainConfig()
    text = options.render_help(options.train_options(cfg), options.HELP_SECTIONS)
    leaves = [o for o in options.train_options(cfg) if not o.section]
    assert {o.key.rpartition(".")[0] for o in leaves} == set(options.HELP_SECTIONS)
    for option in leaves:
        assert f"  {option.key}={options.yaml_value(option.value)}  {option.doc}" in text.splitlines()
    titles = [line.split(":")[0] for line in text.splitlines() if line and not line.startswith(" ")]
    assert titles == ["trainer", "critic", "critic.model", "critic.optim", "critic.megatron", "task", "top level"]
    default_model = " ".join(f"{k}={v}" for k, v in DEFAULT_MODEL.items())
    assert "critic.model.override_config={}" in text and default_model in text


def test_bench_options_are_read_from_the_source_with_their_defaults():
    read = {o.key: o.value for o in options.bench_options()}
    assert read == {f.name: f.default for f in dataclasses.fields(BenchConfig)}
    text = options.render_help(options.bench_options())
    resolved = BenchConfig(device="cpu").resolved()
    automatic = [f.name for f in dataclasses.fields(BenchConfig) if f.default == 0 and getattr(resolved, f.name)]
    assert len(automatic) == 11  # model and batch sizes: 0 takes the device's default, which the help gives
    for name in automatic:
        assert f"  {name}=0  " in text and "; 0: " in _line(text, f"  {name}=0  ")


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (None, "null"),
        (True, "true"),
        ("off", "'off'"),
        ((0.9, 0.999), "[0.9, 0.999]"),
        (1e-8, "1.0e-08"),
        ({}, "{}"),
        ("runs/x", "runs/x"),
    ],
)
def test_values_are_shown_as_yaml(value, shown):
    assert options.yaml_value(value) == shown


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))
