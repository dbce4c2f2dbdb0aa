"""What a training run leaves behind for people: `metrics.jsonl`, TensorBoard events and `curves.png`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ppo_critic.files import explained_os_error, write_file, write_with

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"


class RunLog:
    """Appends one JSON line per step, flushed to disk (and TensorBoard scalars); on resume, the rows past the
    checkpoint are dropped (the file is rewritten atomically)."""

    def __init__(self, run_dir: str | os.PathLike, resume_step: int = 0, tensorboard: bool = True):
        self.path = Path(run_dir) / METRICS_FILE
        rows = [r for r in read_metrics(self.path) if r["step"] <= resume_step] if resume_step else []
        write_file(self.path, "".join(json.dumps(r) + "\n" for r in rows))
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=resume_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with explained_os_error(f"appending step {step} to {self.path} failed"), open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


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


def plot_curves(metrics_path: str | os.PathLike, out_png: str | os.PathLike) -> Path:
    """Six panels: value loss, explained variance (vs truth and vs returns), MAE vs truth, grad norm, lr, tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    panels = [
        ("value loss", ["critic/vf_loss"], "log"),
        ("explained variance (held-out)", ["eval/ev_true", "eval/ev_returns"], "linear"),
        ("mean abs. error vs true values", ["eval/mae_true"], "linear"),
        ("grad norm (pre-clip)", ["critic/grad_norm"], "log"),
        ("learning rate", ["critic/lr"], "linear"),
        ("valid tokens / s (update)", ["perf/tokens_per_s"], "linear"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5), constrained_layout=True)
    for ax, (title, keys, scale) in zip(axes.flat, panels, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="." if len(points) < 50 else None, label=key.split("/")[-1])
        if title.startswith("explained"):
            ax.axhline(0.9, color="grey", linestyle=":", linewidth=1, label="0.9")
            ax.set_ylim(-0.1, 1.02)
        ax.set_title(title)
        ax.set_xlabel("step")
        if scale == "log" and any(key in r and r[key] > 0 for r in rows for key in keys):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if len(keys) > 1 or title.startswith("explained"):
            ax.legend(loc="lower right")
    out = write_with(out_png, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return out
