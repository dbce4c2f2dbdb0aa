"""A run's metrics, step by step, to the `trainer.logger` backends (`ppo_critic.run.loggers`), and `metrics.jsonl` read
back (a torn last line dropped); `curves.png` is drawn from it by `ppo_critic.run.plots`."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ppo_critic.config.train import check_loggers
from ppo_critic.run.loggers import Backend, JsonlLog, MlflowLog, TensorBoardLog, WandbLog

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"


class RunLog:
    """Each step's metrics, stamped with `time` (unix seconds) and `elapsed_s` (seconds of this run, continued
    across resumes), fanned out to the `trainer.logger` backends. A resume drops the rows past the checkpoint from
    `metrics.jsonl` (rewritten atomically) and continues the same TensorBoard log and wandb / mlflow runs."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        resume_step: int = 0,
        loggers: Sequence[str] | str = ("console", "jsonl", "tensorboard"),
        project_name: str = "ppo-critic",
        experiment_name: str | None = None,
        config: Mapping[str, Any] | None = None,
    ):
        run_dir = Path(run_dir)
        names = check_loggers(loggers)
        self.path = run_dir / METRICS_FILE
        kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step] if resume_step else []
        self.elapsed_before = kept[-1].get("elapsed_s", 0.0) if kept else 0.0
        self.start = time.monotonic()
        name, config = experiment_name or run_dir.resolve().name, config or {}
        build = {  # the remote ones first: a missing package stops the run before any file changes
            "wandb": lambda: WandbLog(run_dir, resume_step > 0, project_name, name, config),
            "mlflow": lambda: MlflowLog(run_dir, resume_step > 0, project_name, name, config),
            "tensorboard": lambda: TensorBoardLog(run_dir / "tensorboard", resume_step),
            "jsonl": lambda: JsonlLog(self.path, kept),
        }
        self.backends: list[Backend] = []
        self._closing = contextlib.ExitStack()
        try:
            for backend in (make() for key, make in build.items() if key in names):
                self.backends.append(backend)
                self._closing.callback(backend.close)
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: dict[str, float]) -> None:
        elapsed = self.elapsed_before + time.monotonic() - self.start
        row = {**metrics, "time": round(time.time(), 3), "elapsed_s": round(elapsed, 3)}
        for backend in self.backends:
            backend.log(step, row)

    def close(self) -> None:
        """Close every backend (all of them, even when one fails)."""
        self._closing.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of `metrics.jsonl`; a last line cut short by a crash (no newline) is not a row."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as err:
            raise ValueError(f"{path}:{number} is not a JSON row ({err}); fix or remove that line") from err
    return rows
