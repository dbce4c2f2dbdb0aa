"""curves.png: which panels a run gets, TensorBoard-style smoothing, labelled axes, and a PNG written in place."""

from __future__ import annotations

import json
import math

import pytest

from ppo_critic.run.plots import SMOOTHING, build_figure, panels, plot_curves, points, smooth_ema

EVAL_NAME = "held-out: 10% of rollouts.jsonl"


def synthetic_rows(steps: int = 60, eval_every: int = 10, truth: bool = True, lr_changes: bool = False) -> list:
    """A run's metrics rows: loss decaying over two decades, evaluation every `eval_every` steps."""
    rows = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "critic/vf_loss": 0.5 * math.exp(-step / 10) * (1.3 if step % 2 else 0.8),
            "critic/grad_norm": 2.0 + (step % 3),
            "critic/lr": 1e-3 * step / steps if lr_changes else 1e-3,
            "perf/tokens_per_s": 50_000.0 + 1000 * (step % 5),
            "critic/vf_clipfrac": 0.0,
            "critic/vpred_mean": 0.1,
            "time": 1.7e9 + step,
            "elapsed_s": float(step),
        }
        if step % eval_every == 0:
            row["eval/ev_returns"] = 0.6 * step / steps
            if truth:
                row["eval/ev_true"] = 0.98 * step / steps
                row["eval/mae_true"] = 0.3 / step
        rows.append(row)
    return rows


def titles(rows: list, eval_name: str | None = EVAL_NAME) -> list[str]:
    return [p.title.split("\n")[0] for p in panels(rows, eval_name)]


def test_smoothing_is_debiased_tensorboard_ema():
    # float64 arithmetic, a few roundings of 2**-53 per value: approx's default rel=1e-6 is far above
    assert smooth_ema([4.0, 4.0, 4.0], 0.9) == pytest.approx([4.0, 4.0, 4.0])  # the start is not pulled to 0
    # s1 = 0.5·1 / (1 − 0.5) = 1; s2 = (0.5·0.5 + 0.5·3) / (1 − 0.25) = 1.75 / 0.75
    assert smooth_ema([1.0, 3.0], 0.5) == pytest.approx([1.0, 1.75 / 0.75])
    assert smooth_ema([1.0, 5.0, 2.0], 0.0) == [1.0, 5.0, 2.0]
    assert smooth_ema([], 0.9) == []
    with pytest.raises(ValueError, match="smoothing"):
        smooth_ema([1.0], 1.0)


def test_a_task_run_with_a_constant_lr_gets_every_panel_but_the_lr():
    assert titles(synthetic_rows()) == [
        "value loss (training batches)",
        "explained variance",
        "mean abs. error vs true values",
        "gradient norm (before clipping)",
        "throughput (critic update)",
    ]
    ev = panels(synthetic_rows(), EVAL_NAME)[1]
    assert [s.key for s in ev.series] == ["eval/ev_true", "eval/ev_returns"]
    assert ev.title.endswith(EVAL_NAME)  # says what it was computed on


def test_a_changing_lr_gets_its_panel():
    assert "learning rate" in titles(synthetic_rows(lr_changes=True))


def test_a_file_run_without_truth_has_no_error_panel_and_ev_against_returns_only():
    chosen = panels(synthetic_rows(truth=False), EVAL_NAME)
    assert "mean abs. error vs true values" not in [p.title.split("\n")[0] for p in chosen]
    ev = next(p for p in chosen if p.explained_variance)
    assert [s.key for s in ev.series] == ["eval/ev_returns"]


def test_a_run_without_evaluation_has_no_evaluation_panels():
    rows = synthetic_rows(eval_every=10_000)
    assert titles(rows) == [
        "value loss (training batches)",
        "gradient norm (before clipping)",
        "throughput (critic update)",
    ]


def test_non_finite_points_are_skipped_and_a_curve_with_none_is_dropped():
    rows = synthetic_rows(steps=4)
    rows[1]["critic/vf_loss"] = float("nan")
    rows[2]["critic/vf_loss"] = float("inf")
    for row in rows:
        row["critic/grad_norm"] = float("nan")
    assert points(rows, "critic/vf_loss") == ([1, 4], [rows[0]["critic/vf_loss"], rows[3]["critic/vf_loss"]])
    assert "gradient norm (before clipping)" not in titles(rows)


def axes_by_title(fig) -> dict:
    return {ax.get_title().split("\n")[0]: ax for ax in fig.axes}


def test_the_figure_has_labelled_axes_a_title_and_adapts_its_layout():
    fig = build_figure(synthetic_rows(lr_changes=True), "runs/default — counting task, lr 1e-3", EVAL_NAME)
    assert fig.get_suptitle().startswith("runs/default — counting task, lr 1e-3\nstep 60 · 60 s")
    assert len(fig.axes) == 6
    assert {ax.get_subplotspec().get_geometry()[:2] for ax in fig.axes} == {(2, 3)}
    for ax in fig.axes:
        assert ax.get_xlabel() == "step"
        assert ax.get_ylabel()
    by_title = axes_by_title(fig)
    assert by_title["value loss (training batches)"].get_ylabel() == "½·MSE vs returns (value units²)"
    assert by_title["explained variance"].get_ylabel() == "explained variance (1 = perfect)"
    assert by_title["mean abs. error vs true values"].get_ylabel() == "value units"
    assert by_title["throughput (critic update)"].get_ylabel() == "tokens / s"

    five = build_figure(synthetic_rows(), "run", EVAL_NAME)  # 2 × 3 with the empty slot removed
    assert len(five.axes) == 5
    three = build_figure(synthetic_rows(eval_every=10_000), "run")
    assert {ax.get_subplotspec().get_geometry()[:2] for ax in three.axes} == {(1, 3)}
    assert "markers: evaluations" in five.get_suptitle() and "markers" not in three.get_suptitle()


def test_a_one_step_run_shows_its_points_on_whole_steps():
    fig = build_figure(synthetic_rows(steps=1), "run")
    for ax in fig.axes:
        assert ax.get_lines()[-1].get_marker() == "o"  # a line through one point would be invisible
        assert all(float(t).is_integer() for t in ax.get_xticks())


def test_noisy_curves_are_drawn_raw_and_smoothed_and_evaluations_with_markers():
    rows = synthetic_rows()
    by_title = axes_by_title(build_figure(rows, "run", EVAL_NAME))
    raw, smoothed = by_title["value loss (training batches)"].get_lines()
    _, losses = points(rows, "critic/vf_loss")
    assert list(raw.get_ydata()) == losses
    assert list(smoothed.get_ydata()) == pytest.approx(smooth_ema(losses, SMOOTHING))  # float64: default rel=1e-6
    assert raw.get_alpha() < 0.5 and smoothed.get_alpha() is None  # a faint raw line under an opaque smoothed one
    ev_lines = [line for line in by_title["explained variance"].get_lines() if line.get_marker() == "o"]
    assert [line.get_xdata().tolist() for line in ev_lines] == [[10, 20, 30, 40, 50, 60]] * 2


def test_a_hopeless_early_explained_variance_does_not_set_the_scale():
    rows = synthetic_rows()
    rows[9]["eval/ev_true"] = -30.0
    ax = axes_by_title(build_figure(rows, "run"))["explained variance"]
    assert ax.get_ylim() == pytest.approx((-1.05, 1.03))  # float64 limits and margins: approx's default rel=1e-6


def test_log_scale_only_for_positive_curves_spanning_decades():
    rows = synthetic_rows()
    by_title = axes_by_title(build_figure(rows, "run"))
    assert by_title["value loss (training batches)"].get_yscale() == "log"
    assert by_title["gradient norm (before clipping)"].get_yscale() == "linear"  # 2..4: not a decade
    rows[5]["critic/vf_loss"] = 0.0
    assert axes_by_title(build_figure(rows, "run"))["value loss (training batches)"].get_yscale() == "linear"


def test_plot_curves_writes_a_png_in_place(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows(truth=False)))
    out = plot_curves(metrics, tmp_path / "run" / "curves.png", "runs/file — rollouts.jsonl", EVAL_NAME)
    assert out == tmp_path / "run" / "curves.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 30_000
    assert [p.name for p in out.parent.iterdir()] == ["curves.png"]  # no temporary file left behind


def test_an_empty_run_still_gets_a_picture(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    fig = build_figure([], "run")
    assert fig.axes == []
    assert plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png", "run").read_bytes()[:4] == b"\x89PNG"
