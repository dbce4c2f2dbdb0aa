"""Option descriptions: every config field has one, `--help` and `configs/default.yaml` show them all."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from ppo_critic.cli import load_config
from ppo_critic.config import reference as options
from ppo_critic.config.bench import BenchConfig
from ppo_critic.config.critic import CriticConfig, MegatronConfig, ModelConfig, OptimConfig
from ppo_critic.config.train import DEFAULT_MODEL, TrainConfig, TrainerConfig
from ppo_critic.tasks import TASK_CONFIGS

DEFAULT_YAML = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
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
    resolved = BenchConfig(device="cpu").resolved(cuda=False)
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


# ---------------------------------------------------------------------------------------------------------------
# Reading options (issue 30): train_config.load_options and read_yaml_options, which cli.load_config calls


def test_options_read_by_load_options_are_those_omegaconf_merges(tmp_path):
    """Defaults ← file ← overrides: the same config as OmegaConf's merge for valid options (interpolations too)."""
    from omegaconf import OmegaConf

    from ppo_critic.config.train import load_options, read_yaml_options

    config = tmp_path / "cfg.yaml"
    config.write_text("trainer:\n  steps: 7\n  run_dir: runs/${task.name}\ncritic:\n  optim: {betas: [0.8, 0.9]}\n")
    overrides = ["task.name=dense", "critic.optim.lr=1e-3", "trainer.logger=[jsonl]", "task.max_prompt_len=4"]
    merged = OmegaConf.merge(TrainConfig().to_dict(), OmegaConf.load(config), OmegaConf.from_dotlist(overrides))
    expected = TrainConfig.from_mapping(OmegaConf.to_container(merged, resolve=True))
    assert load_options(overrides, file_options=read_yaml_options(config)) == expected
    assert expected.trainer.run_dir == "runs/dense" and expected.critic.optim.betas == (0.8, 0.9)
    assert load_options([], base=expected.to_dict()) == expected


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (f"trainer.steps={'1' * 5000}", "trainer.steps=<a 5000-digit integer> is too large to read: an integer option"),
        (f"critic.optim.betas=[0.9, {'9' * 4400}]", "critic.optim.betas[1]=<a 4400-digit integer> is too large"),
        ("critic.optim.betas=x", "critic.optim.betas='x' must be a list of 2 numbers"),
        ("trainer.steps=[1,2", "trainer.steps='[1,2' is not a valid YAML value (expected ',' or ']'"),
        ("trainer.run_dir=${nope}", "could not read the options: trainer.run_dir: Interpolation key 'nope' not found"),
    ],
    ids=["5000-digits", "5000-digits-in-a-list", "betas-string", "bad-yaml", "bad-interpolation"],
)
def test_an_override_that_cannot_be_read_is_one_line_naming_its_key(override, message):
    from ppo_critic.config.train import load_options

    with pytest.raises(ValueError) as info:
        load_options([override])
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"- 1\n- 2\n", "{path} holds a list, not options: a config file maps option names to values"),
        (b"3\n", "{path} holds a single value ('3'), not options"),
        (b"\x00\x01\x02binary", "{path} is not a text file (it holds NUL bytes: binary, or UTF-16 without"),
        (b"steps: \xe9\n", "{path} is not UTF-8 text (byte 7 is 0xe9); a config file is YAML saved as UTF-8"),
        ("trainer: {steps: 3}".encode("utf-16"), "{path} is UTF-16 text; save it as UTF-8"),
        ("trainer: {steps: 3}".encode("utf-32"), "{path} is UTF-32 text; save it as UTF-8"),
        (b"trainer:\n  steps: [1, 2\n", "{path}:3:1: not valid YAML (expected ',' or ']', but got '<stream end>')"),
        (b"trainer:\n  seed: " + b"7" * 4400 + b"\n", "{path}:2:9: trainer.seed=<a 4400-digit integer> is too large"),
        (b"a: [" + b"1, " * 3 + b"-" + b"2" * 4400 + b"]\n", "{path}:1:14: a[3]=<a 4400-digit integer> is too large"),
    ],
    ids=["list", "scalar", "binary", "latin-1", "utf-16", "utf-32", "bad-yaml", "5000-digits", "5000-digits-in-list"],
)
def test_a_config_file_that_is_not_yaml_options_is_one_line_naming_it(content, message, tmp_path):
    from ppo_critic.config.train import read_yaml_options

    path = tmp_path / "cfg.yaml"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        read_yaml_options(path)
    assert message.format(path=path) in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_config_file_may_be_empty_start_with_a_byte_order_mark_or_be_missing(tmp_path):
    from ppo_critic.config.train import read_yaml_options

    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "bom.yaml").write_bytes(b"\xef\xbb\xbftrainer: {steps: 3}\n")
    assert read_yaml_options(tmp_path / "empty.yaml") == {}
    assert read_yaml_options(tmp_path / "bom.yaml") == {"trainer": {"steps": 3}}
    with pytest.raises(FileNotFoundError, match=f"config file {tmp_path / 'no.yaml'} does not exist"):
        read_yaml_options(tmp_path / "no.yaml")
    with pytest.raises(ValueError, match=f"--config {tmp_path} is a directory; give the YAML file of options"):
        read_yaml_options(tmp_path)


def test_every_value_objective_is_described_in_the_help_from_config_modes(monkeypatch):
    from ppo_critic.config import modes

    monkeypatch.setitem(modes.VF_LOSS_TYPES, "hl_gauss", "a histogram over value bins")
    (line,) = [o for o in options.train_options(TrainConfig()) if o.key == "critic.vf_loss_type"]
    for name, what in modes.VF_LOSS_TYPES.items():
        assert f"{name} ({what})" in line.doc
