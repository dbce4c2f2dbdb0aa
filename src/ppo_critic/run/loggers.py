"""Where a run's metrics go (`trainer.logger`, its names checked in `config.train`): one small backend per destination —
`metrics.jsonl`, TensorBoard, Weights & Biases, MLflow — each with `log(step, row)` and `close()`.

A row is one step's metrics plus `time` (unix seconds: the backends' timestamp) and `elapsed_s`. `console` is the
trainer's progress output, not a backend. torch, wandb and mlflow are imported when their backend is built, never
here: this module is on the torch-free config-validation path. A resumed run continues the same wandb / mlflow run
through the ids kept in `<run_dir>/tracking.json`.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from ppo_critic.run.files import explained_os_error, write_file

TRACKING_FILE = "tracking.json"  # {"wandb": {...}, "mlflow": {...}}: the runs a resumed run continues


class Backend(Protocol):
    """One destination of the rows: `log` each step, `close` once."""

    def log(self, step: int, row: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlLog:
    """`metrics.jsonl`: one JSON line per step, fsynced, whole or not at all. It starts as `rows` (those a resume
    keeps, written atomically); a kill inside a write may still leave a torn last line, which `runlog.read_metrics`
    drops and the next open rewrites away."""

    def __init__(self, path: str | os.PathLike, rows: list[dict[str, Any]]):
        self.path = Path(path)
        write_file(self.path, "".join(json.dumps(r) + "\n" for r in rows))

    def log(self, step: int, row: dict[str, float]) -> None:
        """Append the step's row whole, or nothing: a failed write (a full disk) is cut back to the rows before."""
        line = (json.dumps({"step": step, **row}) + "\n").encode()
        with explained_os_error(f"appending step {step} to {self.path} failed"):
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                _append_whole(fd, line)
            finally:
                os.close(fd)

    def close(self) -> None:
        """Nothing is held open between steps."""


def _append_whole(fd: int, data: bytes) -> None:
    """Write `data` at the end of `fd` and fsync it; on any failure the file is truncated to its size before."""
    size = os.fstat(fd).st_size
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.ftruncate(fd, size)
        raise


class TensorBoardLog:
    """Scalars under `log_dir`; events past `resume_step` (from a run that crashed after them) are purged."""

    def __init__(self, log_dir: str | os.PathLike, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=resume_step + 1)

    def log(self, step: int, row: dict[str, float]) -> None:
        for key, value in row.items():
            if key != "time":
                self.writer.add_scalar(key, value, step, walltime=row["time"])

    def close(self) -> None:
        self.writer.close()


class WandbLog:
    """A Weights & Biases run under `<run_dir>/wandb`, with a run id kept in the run directory so a resumed run
    continues it (`resume="allow"`); `WANDB_MODE=offline` works without a network. Steps the wandb run already
    holds (logged after the checkpoint by a run that then crashed) keep their first values: wandb never rewrites
    a step."""

    def __init__(self, run_dir: Path, resume: bool, project: str, name: str, config: Mapping[str, Any]):
        import wandb

        run_id = _tracked(run_dir).get("wandb", {}).get("run_id") if resume else None
        if run_id is None:
            run_id = secrets.token_hex(6)
            _track(run_dir, "wandb", {"run_id": run_id})
        self.run = wandb.init(
            project=project,
            name=name,
            dir=str(run_dir),
            config=dict(config),
            id=run_id,
            resume="allow",
            reinit="create_new",  # never adopt (and later finish) a run the caller already has open
        )

    def log(self, step: int, row: dict[str, float]) -> None:
        self.run.log({k: v for k, v in row.items() if k != "time"}, step=step, commit=True)

    def close(self) -> None:
        self.run.finish()


class MlflowLog:
    """An MLflow run (experiment `project`, run name `name`) at `MLFLOW_TRACKING_URI`, else in a file store under
    `<run_dir>/mlruns`; the config goes in as flattened params. A resumed run continues the same run; steps
    logged again after a crash appear twice in its history (MLflow cannot delete metric values)."""

    def __init__(self, run_dir: Path, resume: bool, project: str, name: str, config: Mapping[str, Any]):
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        if "MLFLOW_TRACKING_URI" not in os.environ:
            # MLflow >= 3.7 refuses its file store unless opted in; the user's own setting wins
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        stored = _tracked(run_dir).get("mlflow", {}) if resume else {}
        if stored.get("tracking_uri") == uri:
            self.run_id = stored["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            _track(run_dir, "mlflow", {"tracking_uri": uri, "run_id": self.run_id})
        # params are write-once in MLflow: a resumed run adds the ones it lacks (changes go to config_changes.jsonl)
        logged = self.client.get_run(self.run_id).data.params
        params = [Param(k, v) for k, v in _flat_params(config).items() if k not in logged]
        if params:
            self.client.log_batch(self.run_id, params=params)

    def log(self, step: int, row: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(row["time"] * 1000)
        metrics = [Metric(k, float(v), stamp, step) for k, v in row.items() if k != "time"]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys (`critic.optim.lr`), values as text."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat |= _flat_params(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


def _tracked(run_dir: Path) -> dict[str, Any]:
    path = run_dir / TRACKING_FILE
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path} is not JSON ({err}); remove it to start new wandb / mlflow runs") from err


def _track(run_dir: Path, backend: str, ids: dict[str, str]) -> None:
    write_file(run_dir / TRACKING_FILE, json.dumps(_tracked(run_dir) | {backend: ids}, indent=1) + "\n")
