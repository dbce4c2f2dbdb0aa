"""`ppo-critic`: help, version, no torch before it is needed, bad options (exit code 2), values, export."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest
import torch

import ppo_critic
from conftest import FP32_REORDERED
from ppo_critic import cli
from ppo_critic import train as train_mod
from ppo_critic.cli import load_config, main
from ppo_critic.data.rows import collate
from ppo_critic.rollout_files.read import read_rollouts
from ppo_critic.train import make_worker
from test_rollout_files import TEMPLATE, TEXT_IDS, TEXT_ROWS, id_rows, save_tokenizer
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
        "critic.optim.lr=0.0005",
        "critic.ema_decay=0.9",
        "critic.value_norm=popart",
        "trainer.length_adaptive_alpha=0.5",
        "trainer.replay_rows=auto",
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

    from ppo_critic.run.checkpoint import latest_checkpoint

    worker = make_worker(load_config(None, [], base=OmegaConf.to_container(OmegaConf.load(run / "config.yaml"))))
    worker.load_checkpoint(latest_checkpoint(run / "checkpoints"))
    rollouts = read_rollouts(data)
    for i in (0, 3, 9):  # each row alone: no batching effect can hide a reordering
        batch = collate([rollouts[i]])
        expected = worker.compute_values(batch)[0, : len(rows[i]["response_ids"])]
        # the same sums in another order (one row vs the file's chunk): FP32_REORDERED, values in [0, 1]
        torch.testing.assert_close(torch.tensor(written[i]["values"]), expected, **FP32_REORDERED)

    code, text = run_cli(["export", str(run), str(tmp_path / "exported")], capsys)
    assert code == 0 and (tmp_path / "exported" / "model.safetensors").is_file()
    parquet_out = tmp_path / "v2.parquet"
    code, text = run_cli(["values", str(tmp_path / "exported"), f"data={data}", f"out={parquet_out}"], capsys)
    assert code == 0, text


def test_values_takes_what_outputs_mean_from_the_run_or_the_export_never_from_the_command_line(tmp_path, capsys):
    """Issue 52: `values` on a PopArt run with critic.value_norm=off wrote normalised outputs, and an export whose
    config.json lost its objective gave logits, both with exit 0. Now an option that changes what the outputs mean
    is refused (the run's or the export's is used), how the forward runs may change, and an export that does not
    say how to read its outputs is refused unless the command line says it."""
    from test_train import write_rollout_file

    data, run, exported = tmp_path / "rollouts.jsonl", tmp_path / "run", tmp_path / "exported"
    write_rollout_file(data, 12)
    assert run_cli(["train", f"data={data}", f"trainer.run_dir={run}", *SHORT], capsys)[0] == 0  # PopArt + EMA
    assert run_cli(["export", str(run), str(exported)], capsys)[0] == 0

    def values(source, *extra, code=0):
        out = tmp_path / f"values_{len(list(tmp_path.glob('values_*')))}.jsonl"
        got, text = run_cli(["values", str(source), f"data={data}", f"out={out}", *extra], capsys)
        assert got == code and out.exists() == (code == 0), text
        return text if code else [v for line in out.read_text().splitlines() for v in json.loads(line)["values"]]

    plain = torch.tensor(values(run))
    # the same sums cut into other micro-batches, packed or not: conftest.FP32_REORDERED
    for forward in (["critic.forward_micro_batch_size_per_gpu=1", "critic.model.use_remove_padding=false"],
                    ["critic.value_norm=popart", "critic.use_dynamic_bsz=true"]):  # fmt: skip
        torch.testing.assert_close(torch.tensor(values(run, *forward)), plain, **FP32_REORDERED)
    torch.testing.assert_close(torch.tensor(values(exported)), plain, **FP32_REORDERED)
    for source, option, saved in (
        (run, "critic.value_norm=off", "'popart' -> 'off'"),
        (run, "critic.ema_decay=0", "0.9 -> 0.0"),
        (run, "critic.model.override_config.hidden_size=16", "critic.model.override_config"),
        (exported, "critic.value_norm=popart", "critic.value_norm: 'off' -> 'popart'"),
        (exported, "critic.vf_loss_type=bce", "critic.vf_loss_type: 'mse' -> 'bce'"),
    ):
        text = values(source, option, code=2)
        where = source / ("config.yaml" if source == run else "config.json")
        assert f"values reads these options from {where}, not from the command line (" in text, text
        assert saved in text and "ppo-critic values --help" in text, text
    config = json.loads((exported / "config.json").read_text())
    assert config.pop("ppo_critic_vf_loss_type") == "mse"
    (exported / "config.json").write_text(json.dumps(config))
    text = values(exported, code=2)
    assert f"{exported / 'config.json'} does not say how to read the model's outputs" in text, text
    assert "pass critic.vf_loss_type=mse if its outputs are the values" in text, text
    torch.testing.assert_close(torch.tensor(values(exported, "critic.vf_loss_type=mse")), plain, **FP32_REORDERED)
    (exported / "config.json").write_text(json.dumps(config | {"ppo_critic_vf_loss_type": "pinball"}))
    text = values(exported, code=2)
    assert f"{exported / 'config.json'}: ppo_critic_vf_loss_type='pinball' is unknown" in text, text


def test_a_run_on_text_rows_and_its_values_equal_the_same_rows_as_token_ids(tmp_path, capsys):
    """`prompt` / `response` text with critic.model.tokenizer_path: trained on and evaluated like the ids it becomes
    (the tokenizer directory recorded in the run is used again by `values`)."""
    tokenizer = save_tokenizer(tmp_path / "tokenizer", chat_template=TEMPLATE)
    text, ids = tmp_path / "text.jsonl", tmp_path / "ids.jsonl"
    text.write_text("".join(json.dumps(r) + "\n" for r in TEXT_ROWS * 3))
    ids.write_text("".join(json.dumps(r) + "\n" for r in id_rows(templated=True) * 3))
    run = tmp_path / "run"
    args = ["train", f"data={text}", f"trainer.run_dir={run}", f"critic.model.tokenizer_path={tokenizer}", *SHORT]
    code, output = run_cli(args, capsys)
    assert code == 0, output
    written = []
    for name, data in (("text", text), ("ids", ids)):
        code, output = run_cli(["values", str(run), f"data={data}", f"out={tmp_path / name}_values.jsonl"], capsys)
        assert code == 0, output
        written.append(
            [json.loads(line)["values"] for line in (tmp_path / f"{name}_values.jsonl").read_text().splitlines()]
        )
    assert written[0] == written[1] and [len(v) for v in written[0][:4]] == [len(r[2]) for r in TEXT_IDS]


def test_values_and_export_explain_missing_inputs(tmp_path, capsys):
    code, text = run_cli(["values", str(tmp_path), "data=x.jsonl"], capsys)
    assert code == 2 and "out=" in text
    code, text = run_cli(["export", str(tmp_path / "nope"), str(tmp_path / "out")], capsys)
    assert code == 2 and "not a run directory" in text


def test_python_dash_m_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "ppo_critic", "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "train" in result.stdout and "export" in result.stdout


# runs the CLI in a fresh interpreter, then reports its exit code and whether torch was imported
NO_TORCH = """
import json, sys
from ppo_critic.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit_:
    code = exit_.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        ([], 2),
        (["--help"], 0),
        (["--version"], 0),
        (["train", "--help"], 0),
        (["bench", "--help"], 0),
        (["train", "critic.optim.lrr=1"], 2),
        (["train", "--print-config", "trainer.steps=5"], 0),
        (["bench", "layrs=1"], 2),
    ],
    ids=["bare", "help", "version", "train-help", "bench-help", "config-error", "print-config", "bench-error"],
)
def test_help_version_and_option_errors_do_not_import_torch(argv, code):
    result = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout.splitlines()[-1]) == {"code": code, "torch": False}, result.stderr


def test_version_is_the_installed_one(capsys, monkeypatch):
    code, text = run_cli(["--version"], capsys)
    assert code == 0 and text == f"ppo-critic {importlib.metadata.version('ppo-critic')}\n"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.version() == ppo_critic.__version__  # a source checkout that is not installed


def test_print_config_writes_a_config_file_that_reproduces_the_options(tmp_path, capsys):
    argv = ["trainer.steps=5", "backend=ddp", "task.min_count=3"]
    code, text = run_cli(["train", "--print-config", *argv], capsys)
    assert code == 0 and "  steps: 5  # " in text and "  strategy: ddp  # " in text
    written = tmp_path / "run.yaml"
    written.write_text(text)
    assert load_config(written, []) == load_config(None, argv)
    assert not (tmp_path / "runs").exists()


def test_train_leaves_the_report_to_the_trainer(tmp_path, capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(train_mod, "train", lambda cfg, overwrite: seen.append(cfg) or {"eval/ev_true": 0.5})
    code, text = run_cli(["train", f"trainer.run_dir={tmp_path}", "trainer.steps=3"], capsys)
    assert code == 0 and text == "" and seen[0].trainer.steps == 3


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (train_mod.Interrupted("interrupted at step 2; nothing partial was saved"), "interrupted at step 2;"),
        (ModuleNotFoundError("No module named 'wandb'", name="wandb"), "pip install 'ppo-critic[wandb]'"),
        (ModuleNotFoundError("No module named 'mlflow'", name="mlflow"), "pip install 'ppo-critic[mlflow]'"),
    ],
    ids=["interrupted", "wandb", "mlflow"],
)
def test_train_failures_exit_2_with_the_reason(error, message, tmp_path, capsys, monkeypatch):
    def fail(cfg, overwrite):
        raise error

    monkeypatch.setattr(train_mod, "train", fail)
    code, text = run_cli(["train", f"trainer.run_dir={tmp_path}"], capsys)
    assert code == 2 and message in text, text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without CUDA")
def test_megatron_on_a_machine_without_cuda_is_a_clear_error(tmp_path):
    """megatron-core allocates its buffers on CUDA: exit 2 naming the option and what to use instead, no traceback,
    nothing written."""
    pytest.importorskip("megatron.core")
    run = tmp_path / "run"
    args = ["-m", "ppo_critic", "train", "backend=megatron", "trainer.steps=1", f"trainer.run_dir={run}"]
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "critic.strategy=megatron needs CUDA GPUs" in result.stderr and "Traceback" not in result.stderr
    assert not run.exists()
