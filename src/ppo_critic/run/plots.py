"""`curves.png`: the training curves of a run (`metrics.jsonl`), drawn for a person to read.

Each panel has a title, a y-axis label with units and `step` on x; the figure title names the run and its key
settings. Per-step curves are noisy, so each is drawn faint as logged with a TensorBoard-style smoothed line on top
(`smooth_ema`); evaluation curves (logged every `eval_every` steps, on the evaluation set that `eval_name` names) are
drawn with markers. A panel with nothing to show is left out: no evaluation panels without evaluation rows, no error
against true values for rollouts read from a file, no learning-rate panel when the rate never changed.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppo_critic.run.files import write_with
from ppo_critic.run.runlog import read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SMOOTHING = 0.9  # TensorBoard's "smoothing" slider: the weight of the past; 0.9 averages over about 10 steps
LOG_SPREAD = 10.0  # a positive curve gets a log axis when its largest value is at least this many times its smallest
EV_FLOOR = -1.0  # explained variance below this (a critic worse than a constant) is drawn off the bottom edge


@dataclasses.dataclass(frozen=True)
class Series:
    """One curve: a metrics key and its legend label. `noisy` curves (logged every step) are drawn faint with a
    smoothed line on top; `sparse` ones (evaluations) with markers and their last value in the legend."""

    key: str
    label: str
    noisy: bool = False
    sparse: bool = False


@dataclasses.dataclass(frozen=True)
class Panel:
    """One chart of the figure. `log` asks for a log y-axis (used only if all its values are positive and spread
    over `LOG_SPREAD`×); `from_zero` starts the y-axis at 0 (a rate, whose warm-up dip would else set the scale);
    `if_changing` leaves the panel out when its curve is flat (a constant learning rate)."""

    title: str
    ylabel: str
    series: tuple[Series, ...]
    log: bool = False
    from_zero: bool = False
    if_changing: bool = False
    explained_variance: bool = False


def smooth_ema(values: Sequence[float], smoothing: float = SMOOTHING) -> list[float]:
    """TensorBoard's smoothing: `s ← smoothing·s + (1 − smoothing)·v` from `s = 0`, each point divided by
    `1 − smoothing^n` (n points so far) so the start is the mean of the first points, not pulled toward 0.
    `smoothing` 0 returns the values unchanged."""
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing={smoothing!r} must be in [0, 1)")
    out, acc = [], 0.0
    for n, value in enumerate(values, 1):
        acc = smoothing * acc + (1.0 - smoothing) * value
        out.append(acc / (1.0 - smoothing**n))
    return out


def points(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """The (steps, values) of `key` over `rows`, skipping rows without it and non-finite values (NaN, ±inf)."""
    pairs = [
        (row["step"], float(row[key]))
        for row in rows
        if isinstance(row.get(key), int | float) and math.isfinite(row[key])
    ]
    return [s for s, _ in pairs], [v for _, v in pairs]


def panels(rows: Sequence[dict[str, Any]], eval_name: str | None = None) -> list[Panel]:
    """The panels worth drawing for `rows`, in display order; a series without a finite point is dropped, and so is
    a panel left without series. The learning rate is drawn only when it changes."""
    on = f"\n{eval_name}" if eval_name else "\nevaluation set"
    candidates = [
        Panel(
            "value loss (training batches)",
            "½·MSE vs returns (value units²)",
            (Series("critic/vf_loss", "vf_loss", noisy=True),),
            log=True,
        ),
        Panel(
            "explained variance" + on,
            "explained variance (1 = perfect)",
            (
                Series("eval/ev_true", "vs true values", sparse=True),
                Series("eval/ev_returns", "vs Monte-Carlo returns", sparse=True),
            ),
            explained_variance=True,
        ),
        Panel(
            "mean abs. error vs true values" + on,
            "value units",
            (Series("eval/mae_true", "MAE", sparse=True),),
            log=True,
        ),
        Panel(
            "gradient norm (before clipping)",
            "L2 norm",
            (Series("critic/grad_norm", "grad_norm", noisy=True),),
            log=True,
        ),
        Panel("learning rate", "lr", (Series("critic/lr", "lr"),), if_changing=True),
        Panel(
            "throughput (critic update)",
            "tokens / s",
            (Series("perf/tokens_per_s", "tokens_per_s", noisy=True),),
            from_zero=True,
        ),
    ]
    chosen = []
    for panel in candidates:
        values = {s: points(rows, s.key)[1] for s in panel.series}
        kept = tuple(s for s in panel.series if values[s])
        flat = panel.if_changing and all(len(set(v)) < 2 for v in values.values())
        if kept and not flat:
            chosen.append(dataclasses.replace(panel, series=kept))
    return chosen


def build_figure(rows: Sequence[dict[str, Any]], title: str, eval_name: str | None = None) -> Figure:
    """The figure of `panels(rows, eval_name)`: one row for up to 3 panels, else 2 rows × ceil(n/2); titled with
    `title` and a line saying how far the run went and how the curves are drawn. Not tied to pyplot (no global
    state, nothing to close)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    chosen = panels(rows, eval_name)
    n = max(len(chosen), 1)
    nrows = 1 if n <= 3 else 2
    ncols = math.ceil(n / nrows)
    fig = Figure(figsize=(4.8 * ncols, 3.7 * nrows + 0.9), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(f"{title}\n{_subtitle(rows, chosen)}", fontsize=12)
    axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
    for ax, panel in zip(axes, chosen, strict=False):
        _draw(ax, rows, panel)
    for ax in axes[len(chosen) :]:
        ax.remove()
    if not chosen:
        fig.text(0.5, 0.5, "no metrics logged yet", ha="center", va="center")
    return fig


def plot_curves(
    metrics_path: str | os.PathLike, out_png: str | os.PathLike, title: str, eval_name: str | None = None
) -> Path:
    """Draw the curves of `metrics_path` (a `metrics.jsonl`) to `out_png`, written atomically; returns its path.
    `title` names the run and its key settings; `eval_name` says what the evaluation rows were computed on."""
    fig = build_figure(read_metrics(metrics_path), title, eval_name)
    return write_with(out_png, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))


def _subtitle(rows: Sequence[dict[str, Any]], chosen: list[Panel]) -> str:
    """`step N`, the wall time when logged, and how the curves drawn are to be read."""
    parts = [f"step {rows[-1]['step']}"] if rows else []
    _, elapsed = points(rows, "elapsed_s")
    if elapsed:
        parts.append(_duration(elapsed[-1]))
    drawn = [s for panel in chosen for s in panel.series]
    if any(s.noisy for s in drawn):
        parts.append(f"faint: per step; solid: smoothed (EMA, smoothing {SMOOTHING})")
    if any(s.sparse for s in drawn):
        parts.append("markers: evaluations")
    return " · ".join(parts)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _draw(ax: Any, rows: Sequence[dict[str, Any]], panel: Panel) -> None:
    """One panel: faint raw + smoothed line per per-step series, markers for the others (last value in the legend)."""
    from matplotlib.ticker import MaxNLocator

    every_value = []
    for index, series in enumerate(panel.series):
        steps, values = points(rows, series.key)
        every_value += values
        color = f"C{index}"
        lone = "o" if len(steps) == 1 else None  # a line through one point is invisible
        if series.noisy:
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(steps, smooth_ema(values), color=color, marker=lone, linewidth=1.8, label=series.label)
        elif series.sparse:
            marker = "o" if len(steps) <= 100 else None
            label = f"{series.label} (last {values[-1]:.3g})"
            ax.plot(steps, values, color=color, marker=marker, markersize=3.5, linewidth=1.4, label=label)
        else:
            ax.plot(steps, values, color=color, marker=lone, linewidth=1.4, label=series.label)
    if panel.log and min(every_value) > 0 and max(every_value) >= LOG_SPREAD * min(every_value):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(_plain_log_formatter())
        ax.yaxis.set_minor_formatter(_plain_log_formatter(labelOnlyBase=False))
    if panel.from_zero:
        ax.set_ylim(bottom=0)
    if panel.explained_variance:
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_ylim(max(min(every_value), EV_FLOOR) - 0.05, 1.03)
    if len(panel.series) > 1 or panel.series[0].sparse:
        ax.legend(loc="best", fontsize=8)
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 0.98 in a short run ...
    low, high = ax.get_xlim()
    if high - low < 2:  # ... nor in one of a single step
        ax.set_xlim((low + high) / 2 - 1, (low + high) / 2 + 1)
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3, which="both" if ax.get_yscale() == "log" else "major")


def _plain_log_formatter(**kwargs: Any) -> Any:
    """matplotlib's choice of which log ticks to label, written 0.03, 0.1, 2 rather than 3×10⁻², 10⁻¹, 2×10⁰."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    return PlainLogFormatter(**kwargs)
