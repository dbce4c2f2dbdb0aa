"""`trainer.logger`: names checked with a suggestion, and every backend read back with its own reader — wandb's
offline log, MLflow's client, TensorBoard's event reader — holding each step's values once, across a resume."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ppo_critic.config.train import check_loggers
from ppo_critic.run.loggers import TRACKING_FILE
from ppo_critic.run.runlog import RunLog

CONFIG = {"critic": {"optim": {"lr": 0.001}, "strategy": "none"}, "trainer": {"steps": 5, "logger": ["wandb"]}}


def metrics(step: int) -> dict[str, float]:
    return {"critic/vf_loss": 1.0 / step, "eval/ev_true": 0.1 * step, "perf/tokens_per_s": 1000.0 + step}


def run_steps(run_dir, loggers, steps, resume_step=0, **kwargs) -> dict[int, dict[str, float]]:
    """Log `steps` through a RunLog; returns the rows as logged (what each backend must hold)."""
    log = RunLog(run_dir, resume_step, loggers, "proj", "exp-1", CONFIG, **kwargs)
    for step in steps:
        log.log(step, metrics(step))
    log.close()
    return {step: metrics(step) for step in steps}


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No network, nothing written outside tmp_path, no MLflow server or file-store opt-in from the caller."""
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(name, "x")  # recorded, so the deletion (and what the code sets) is undone afterwards
        monkeypatch.delenv(name)
    return tmp_path


@pytest.mark.parametrize(
    ("value", "names"),
    [
        (["console", "jsonl"], ["console", "jsonl"]),
        (("WandB", " mlflow "), ["wandb", "mlflow"]),
        ("tensorboard", ["tensorboard"]),
        ("console,wandb,console", ["console", "wandb"]),
        ('["console", "mlflow"]', ["console", "mlflow"]),
        ([], []),
    ],
)
def test_logger_names_are_normalised(value, names):
    assert check_loggers(value) == names


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            ["console", "wandbb"],
            r"trainer.logger: unknown logger 'wandbb'; did you mean 'wandb'\? \(known: console, jsonl",
        ),
        ("console,tensorbord", r"unknown logger 'tensorbord'; did you mean 'tensorboard'\?"),
        (["swanlab"], r"unknown logger 'swanlab' \(known: console, jsonl, tensorboard, wandb, mlflow\)"),
        ([3], r"unknown logger 3 "),
        ({"wandb": True}, r"trainer.logger=\{'wandb': True\} must be a list of names from console, jsonl"),
    ],
)
def test_unknown_logger_names_are_refused_with_a_suggestion(value, message):
    with pytest.raises(ValueError, match=message):
        check_loggers(value)


def wandb_history(run_dir) -> tuple[list[dict], dict[int, dict]]:
    """The run records and the history (step -> values) of every offline wandb log in the run directory, read with
    wandb's own reader of its transaction log (`wandb leet inspect --json`). A step logged twice fails."""
    runs, history = [], {}
    logs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    for path in logs:
        command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)]
        out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=300).stdout
        for record in map(json.loads, out.splitlines()):
            if record["type"] == "run":
                runs.append(record["run"])
            elif record["type"] == "history":
                step = record["history"]["step"]["num"]
                assert step not in history, f"step {step} logged twice"
                history[step] = {k: v for k, v in record["history"]["item"].items() if not k.startswith("_")}
    assert len(runs) == len(logs)
    return runs, history


def test_wandb_offline_holds_every_step_once_and_a_resume_continues_the_same_run(offline):
    run_dir = offline / "run"
    logged = run_steps(run_dir, ["console", "wandb"], [1, 2, 3])
    run_id = json.loads((run_dir / TRACKING_FILE).read_text())["wandb"]["run_id"]
    logged |= run_steps(run_dir, ["console", "wandb"], [4, 5], resume_step=3)

    runs, history = wandb_history(run_dir)
    assert [r["run_id"] for r in runs] == [run_id, run_id]  # one wandb run, in two offline segments
    assert {(r["project"], r["display_name"]) for r in runs} == {("proj", "exp-1")}
    assert runs[0]["config"]["update"]["critic"] == CONFIG["critic"]
    assert sorted(history) == [1, 2, 3, 4, 5]
    for step, values in logged.items():
        row = history[step]
        assert {k: row[k] for k in values} == values, step
        assert row["elapsed_s"] >= 0 and "time" not in row  # `time` is wandb's own _timestamp
    assert not (run_dir / "metrics.jsonl").exists()  # jsonl was not chosen


def test_mlflow_file_store_holds_every_step_once_and_a_resume_continues_the_same_run(offline):
    from mlflow.tracking import MlflowClient

    run_dir = offline / "run"
    logged = run_steps(run_dir, ["mlflow"], [1, 2, 3])
    stored = json.loads((run_dir / TRACKING_FILE).read_text())["mlflow"]
    assert stored["tracking_uri"] == (run_dir / "mlruns").resolve().as_uri()
    logged |= run_steps(run_dir, ["mlflow"], [4, 5], resume_step=3)

    client = MlflowClient(stored["tracking_uri"])
    run = client.get_run(stored["run_id"])
    assert run.info.run_name == "exp-1" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    assert run.data.params["critic.optim.lr"] == "0.001" and run.data.params["trainer.logger"] == "['wandb']"
    for key in metrics(1):  # metric names keep their `/`
        history = client.get_metric_history(stored["run_id"], key)
        assert [(m.step, m.value) for m in history] == [(step, values[key]) for step, values in logged.items()]
    elapsed = client.get_metric_history(stored["run_id"], "elapsed_s")
    assert [m.step for m in elapsed] == [1, 2, 3, 4, 5]
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [stored["run_id"]]


def test_mlflow_uses_the_tracking_uri_of_the_environment_and_a_new_run_gets_a_new_mlflow_run(offline, monkeypatch):
    from mlflow.tracking import MlflowClient

    elsewhere = (offline / "server").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as a user of a file store sets it
    run_steps(offline / "run", ["mlflow"], [1])
    first = json.loads((offline / "run" / TRACKING_FILE).read_text())["mlflow"]
    run_steps(offline / "run", ["mlflow"], [1, 2])  # resume_step 0: the run starts over, in a new mlflow run
    second = json.loads((offline / "run" / TRACKING_FILE).read_text())["mlflow"]

    assert first["tracking_uri"] == second["tracking_uri"] == elsewhere and first["run_id"] != second["run_id"]
    assert not (offline / "run" / "mlruns").exists()
    client = MlflowClient(elsewhere)
    assert [m.step for m in client.get_metric_history(second["run_id"], "critic/vf_loss")] == [1, 2]


def test_tensorboard_holds_each_step_once_after_a_resume_past_a_crash(offline):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = offline / "run"
    run_steps(run_dir, ["tensorboard"], [1, 2, 3])  # then a crash; the checkpoint was at step 2
    logged = run_steps(run_dir, ["tensorboard"], [3, 4], resume_step=2)
    logged = {1: metrics(1), 2: metrics(2)} | logged

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for key in metrics(1):  # TensorBoard stores scalars as float32: one rounding (2**-24 relative) < approx's 1e-6
        assert [(e.step, e.value) for e in events.Scalars(key)] == [
            (step, pytest.approx(values[key])) for step, values in logged.items()
        ]
    assert "time" not in events.Tags()["scalars"] and "elapsed_s" in events.Tags()["scalars"]


def test_a_missing_package_stops_before_any_file_changes(offline, monkeypatch):
    run_dir = offline / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n')
    for name in ["mlflow", *(m for m in sys.modules if m.startswith("mlflow."))]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it fails as when it is not installed
    with pytest.raises(ModuleNotFoundError) as info:
        RunLog(run_dir, 1, ["jsonl", "tensorboard", "mlflow"])
    assert info.value.name.split(".")[0] == "mlflow"  # what the CLI turns into pip install 'ppo-critic[mlflow]'
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n'
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


def test_a_full_disk_never_leaves_a_torn_row_in_metrics_jsonl(tmp_path):
    """A real full file system (tmpfs): the row that does not fit is not there at all, the rows before are whole,
    and the error says what failed."""
    import errno

    from ppo_critic.run.loggers import JsonlLog
    from ppo_critic.run.runlog import read_metrics
    from test_files import tiny_disk

    with tiny_disk(tmp_path / "disk", "64k") as disk:
        log = JsonlLog(disk / "metrics.jsonl", [{"step": 0, "pad": "x" * 4000}])  # ~4 KiB: the next row crosses a page
        log.log(1, {"loss": 0.5})
        before = (disk / "metrics.jsonl").read_bytes()
        filler = disk / "filler"
        with open(filler, "wb", buffering=0) as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 4096)
        with pytest.raises(OSError, match=r"appending step 2 to .*metrics\.jsonl failed") as err:
            log.log(2, {"loss": 0.25, "pad": "y" * 5000})
        assert err.value.errno == errno.ENOSPC
        assert (disk / "metrics.jsonl").read_bytes() == before
        assert [r["step"] for r in read_metrics(disk / "metrics.jsonl")] == [0, 1]
        filler.unlink()
        log.log(2, {"loss": 0.25})
        assert [r["step"] for r in read_metrics(disk / "metrics.jsonl")] == [0, 1, 2]
