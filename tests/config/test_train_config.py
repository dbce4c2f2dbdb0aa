"""config/train.py: a `--config` file's dotted keys read as the nested options they name."""

from __future__ import annotations

import re

import pytest

from ppo_critic.cli import load_config
from ppo_critic.config.train import nested_keys, read_yaml_options


def test_dotted_keys_in_a_config_file_are_the_nested_options(tmp_path):
    path = tmp_path / "dotted.yaml"
    path.write_text("trainer.steps: 3\ncritic:\n  optim.lr: 0.002\ntrainer:\n  eval_every: 5\n")
    assert read_yaml_options(path) == {"trainer": {"steps": 3, "eval_every": 5}, "critic": {"optim": {"lr": 0.002}}}
    cfg = load_config(path, [])
    assert (cfg.trainer.steps, cfg.trainer.eval_every, cfg.critic.optim.lr) == (3, 5, 0.002)


def test_an_option_given_dotted_and_nested_is_named():
    with pytest.raises(ValueError, match=r"f.yaml: trainer.steps is given twice \(dotted and nested\); keep one"):
        nested_keys({"trainer.steps": 3, "trainer": {"steps": 4}}, "f.yaml")
    with pytest.raises(ValueError, match=r"critic.optim is given twice"):
        nested_keys({"critic": {"optim": 1, "optim.lr": 2}}, "f.yaml")


def test_override_config_keeps_its_keys_as_written():
    tree = {"critic": {"model": {"override_config": {"rope_scaling.type": "linear"}}}}
    assert nested_keys(tree, "f.yaml") == tree


@pytest.mark.parametrize("option", ["trainer.run_dir=runs/x ", "data= rollouts.jsonl", "critic.model.path=/m\t"])
def test_a_path_with_whitespace_at_an_end_is_refused_not_trimmed_in_silence(option):
    """Issue 43 family 10: `trainer.run_dir='runs/x '` ran in runs/x without a word."""
    key = option.split("=", 1)[0]
    with pytest.raises(ValueError, match=rf"^{re.escape(key)}=.* has whitespace at an end"):
        load_config(None, [option])
    assert load_config(None, ["critic.optim.lr= 1e-3"]).critic.optim.lr == 1e-3  # a number: nothing lost


def test_a_config_file_nested_thousands_deep_is_named_not_a_recursion_error(tmp_path):
    """Issue 43 family 8 (a regression): a --config nested 5000 deep raised RecursionError with a traceback."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "{b: " * 5000 + "1" + "}" * 5000 + "\n")
    with pytest.raises(ValueError, match=r"deep.yaml nests too deeply to read"):
        read_yaml_options(deep)


def test_a_number_from_an_environment_variable_names_the_way_to_read_it(monkeypatch):
    """Issue 43 family 8: `${oc.env:X}` gives text, so `trainer.steps=${oc.env:X}` failed as "must be an integer"
    with no way out named; the error now names `oc.decode`, which works."""
    monkeypatch.setenv("PPO_STEPS", "5")
    with pytest.raises(ValueError, match=r"trainer.steps='5' must be an integer \(an \$\{oc.env:...\} value is text"):
        load_config(None, ["trainer.steps=${oc.env:PPO_STEPS}"])
    assert load_config(None, ["trainer.steps=${oc.decode:${oc.env:PPO_STEPS}}"]).trainer.steps == 5


@pytest.mark.parametrize("section", ["critic:\n", "critic: null\n", "critic:\n#  optim:\n#    lr: 0.001\n"])
def test_a_null_section_sets_nothing_and_keeps_the_commands_recipe(tmp_path, section):
    """Issue 52: a `critic:` section left null (its options commented out) replaced the command's recipe (PopArt,
    EMA, lr 5e-4) by the library's defaults once another critic option was given, or failed as not a mapping."""
    recipe = load_config(None, [])
    path = tmp_path / "c.yaml"
    path.write_text(section + "trainer:\n  steps: 3\n")
    for overrides in ([], ["critic.ppo_epochs=2"]):
        cfg = load_config(path, overrides)
        assert (cfg.critic.value_norm, cfg.critic.ema_decay, cfg.critic.optim.lr) == ("popart", 0.9, 5e-4)
        assert cfg.trainer.steps == 3 and cfg.critic.ppo_epochs == (2 if overrides else recipe.critic.ppo_epochs)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ('trainer:\n  replay_rows: "96"\n', "trainer.replay_rows='96' must be an integer or 'auto' (an ${oc.env"),
        ("trainer:\n  replay_rows: 96.0\n", "trainer.replay_rows=96.0 must be an integer or 'auto'"),
        ("trainer:\n  replay_rows: true\n", "trainer.replay_rows=True must be an integer or 'auto'"),
        ("trainer.replay_rows=96.0", "trainer.replay_rows=96.0 must be an integer or 'auto'"),
    ],
)
def test_replay_rows_is_an_integer_or_auto_and_says_what_it_got(tmp_path, source, message):
    """Issue 52: `replay_rows: "8"` was refused without saying it is text; `replay_rows=8.0` passed validation and
    failed at step 1 in torch."""
    path = tmp_path / "c.yaml"
    path.write_text(source)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, [source]) if "=" in source else load_config(path, [])
    assert load_config(None, ["trainer.replay_rows=192"]).trainer.replay_rows == 192


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "+Infinity"])
def test_nan_and_inf_typed_on_the_command_line_are_named_not_sent_to_oc_env(value):
    """Issue 52: `critic.optim.lr=nan` got the hint meant for `${oc.env:...}`; YAML reads nan and inf as text, and no
    option takes a number that is not finite."""
    for key in ("critic.optim.lr", "trainer.steps", "critic.cliprange_value"):
        with pytest.raises(ValueError, match=re.escape(f"({value} is not a finite number")) as caught:
            load_config(None, [f"{key}={value}"])
        assert "oc.env" not in str(caught.value) and str(caught.value).startswith(f"{key}='{value}' must be")
