"""`ppo-critic`: help, bad options (exit code 2), values on a rollout file, export."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ppo_critic.cli import load_config, main
from ppo_critic.rollouts import collate, read_rollouts
from ppo_critic.train import make_worker
from test_train import SHORT


def run_cli(args, capsys):
    try:
        code = main(args)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_train_help_lists_every_option_with_its_default(capsys):
    code, text = run_cli(["train", "--help"], capsys)
    assert code == 0
    for line in (
        "trainer.steps=400",
        "critic.ppo_epochs=1",
        "task.min_count=2",
        "critic.optim.lr=0.001",
        "critic.ema_decay=0.9",
    ):
        assert line in text
    assert "trainer.resume=auto" in text


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("ppo_epochs=-1", "did you mean 'critic.ppo_epochs'"),
        ("critic.ppo_epochs=-1", "critic.ppo_epochs=-1 must be a positive integer"),
        ("critic.ppo_mini_batchsize=4", "did you mean 'critic.ppo_mini_batch_size'"),
        ("trainer.steps=many", "trainer.steps='many' must be an integer"),
        ("task.min_count=0", "min_count"),
        ("task.name=chess", "task.name='chess' is unknown"),
        ("steps", "key=value"),
        ("trainer.rollout_batch_size=10", "multiple of critic.ppo_mini_batch_size"),
        ("backend=megatron megatron.context_parallel_size=2", "critic.megatron.context_parallel_size must be 1"),
        ("megatron.tensor_parallel_size=2", "did you mean 'critic.megatron.tensor_model_parallel_size'"),
        ("backend=deepspeed", "critic.strategy='deepspeed' is unknown"),
    ],
)
def test_bad_options_exit_2_with_a_message_naming_the_key(override, message, capsys, tmp_path):
    code, text = run_cli(["train", f"trainer.run_dir={tmp_path}", *override.split()], capsys)
    assert code == 2
    assert message in text
    assert not (tmp_path / "metrics.jsonl").exists()


def test_an_unwritable_run_directory_exits_2_with_the_os_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, text = run_cli(["train", f"trainer.run_dir={blocker}/run", "trainer.steps=1"], capsys)
    assert code == 2 and "Not a directory" in text


def test_a_malformed_rollout_file_is_reported_by_row(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    rows = [
        {"prompt_ids": [1, 2], "response_ids": [3], "reward": 1.0},
        {"prompt_ids": [1, 2], "response_ids": "abc", "reward": 1.0},
        {"prompt_ids": [1], "response_ids": [2, 3], "token_level_rewards": [0.0]},
        {"prompt_ids": [], "response_ids": [2], "reward": 0.0},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, text = run_cli(["train", f"data={data}", f"trainer.run_dir={tmp_path / 'run'}"], capsys)
    assert code == 2
    assert "row 2: field 'response_ids'" in text
    assert "row 3: field 'token_level_rewards'" in text
    assert "row 4: field 'prompt_ids'" in text


def test_values_are_written_in_input_order(tmp_path, capsys):
    data = tmp_path / "rollouts.jsonl"
    g = torch.Generator().manual_seed(1)
    rows = [
        {
            "prompt_ids": torch.randint(0, 20, (1 + i % 4,), generator=g).tolist(),
            "response_ids": torch.randint(0, 20, (1 + (7 * i) % 6,), generator=g).tolist(),
            "reward": float(i % 3 == 0),
        }
        for i in range(10)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    assert run_cli(["train", f"data={data}", f"trainer.run_dir={run}", *SHORT], capsys)[0] == 0
    out = tmp_path / "values.jsonl"
    code, text = run_cli(["values", str(run), f"data={data}", f"out={out}"], capsys)
    assert code == 0, text
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["row"] for w in written] == list(range(10))
    assert [len(w["values"]) for w in written] == [len(r["response_ids"]) for r in rows]

    from omegaconf import OmegaConf

    from ppo_critic.checkpoint import latest_checkpoint

    worker = make_worker(load_config(None, [], base=OmegaConf.to_container(OmegaConf.load(run / "config.yaml"))))
    worker.load_checkpoint(latest_checkpoint(run / "checkpoints"))
    rollouts = read_rollouts(data)
    for i in (0, 3, 9):  # each row alone: no batching effect can hide a reordering
        batch = collate([rollouts[i]])
        expected = worker.compute_values(batch)[0, : len(rows[i]["response_ids"])]
        torch.testing.assert_close(torch.tensor(written[i]["values"]), expected, rtol=1e-5, atol=1e-6)

    code, text = run_cli(["export", str(run), str(tmp_path / "exported")], capsys)
    assert code == 0 and (tmp_path / "exported" / "model.safetensors").is_file()
    parquet_out = tmp_path / "v2.parquet"
    code, text = run_cli(["values", str(tmp_path / "exported"), f"data={data}", f"out={parquet_out}"], capsys)
    assert code == 0, text


def test_values_and_export_explain_missing_inputs(tmp_path, capsys):
    code, text = run_cli(["values", str(tmp_path), "data=x.jsonl"], capsys)
    assert code == 2 and "out=" in text
    code, text = run_cli(["export", str(tmp_path / "nope"), str(tmp_path / "out")], capsys)
    assert code == 2 and "not a run directory" in text


def test_python_dash_m_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "ppo_critic", "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "train" in result.stdout and "export" in result.stdout


def test_the_shipped_default_config_file_matches_the_built_in_defaults():
    from pathlib import Path

    from omegaconf import OmegaConf

    from ppo_critic.train import TrainConfig

    shipped = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
    assert load_config(shipped, []) == TrainConfig()
    written = OmegaConf.to_yaml(OmegaConf.create(TrainConfig().to_dict()))
    assert OmegaConf.load(shipped) == OmegaConf.create(written)  # every key is written out
