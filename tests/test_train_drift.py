"""The main job under a moving policy (`task.drift`): each iteration's rollouts come from the task of its step, the
evaluation set from the policy of each evaluation's step, the tracking metrics, and resume in the middle of a ramp."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import bench_script, without_timings
from ppo_critic import train as train_mod
from ppo_critic.cli import load_config
from ppo_critic.train import TaskSource, tracking_metrics, train

SHORT = [
    "trainer.steps=6",
    "trainer.rollout_batch_size=8",
    "trainer.eval_size=16",
    "trainer.eval_every=1",
    "trainer.save_every=2",
    "trainer.progress=false",
    "trainer.logger=[jsonl]",
    "trainer.export_hf=true",
    "critic.ppo_mini_batch_size=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "critic.model.override_config.hidden_size=32",
    "critic.model.override_config.intermediate_size=64",
]
RAMP = ["task.drift=ramp", "task.drift_start=2", "task.drift_steps=3", "task.target_prob=0.1", "task.drift_to=0.9"]


def config(run_dir, *extra):
    return load_config(None, [*SHORT, f"trainer.run_dir={run_dir}", *extra])


def target_share(task, batch) -> float:
    """The share of response tokens that are the prompt's target (counting task)."""
    targets = batch["input_ids"][:, task.prompt_width - 2]
    mask = batch["response_mask"].bool()
    return ((batch["responses"] == targets[:, None]) & mask).sum().item() / mask.sum().item()


def test_tracking_metrics_after_the_warmup():
    curve = [(10, 0.2), (20, 0.95), (30, 0.5), (40, 0.8), (50, 0.92), (60, 0.97)]
    got = tracking_metrics(curve, warmup=30, changed_at=30)
    assert got == pytest.approx({"tracking_ev": (0.5 + 0.8 + 0.92 + 0.97) / 4, "worst_ev": 0.5, "recover_steps": 20})
    assert tracking_metrics(curve, warmup=30) == pytest.approx({"tracking_ev": 0.7975, "worst_ev": 0.5})
    assert tracking_metrics(curve, warmup=20, changed_at=20)["recover_steps"] == 0  # never fell below the bar
    assert tracking_metrics(curve[:4], warmup=30, changed_at=30)["recover_steps"] == math.inf  # not back yet
    assert tracking_metrics(curve, warmup=61) == {}
    assert "recover_steps" not in tracking_metrics(curve, warmup=0, changed_at=70)  # nothing evaluated since


def test_the_rollouts_follow_the_ramp(tmp_path):
    source = TaskSource(config(tmp_path, *RAMP, "trainer.rollout_batch_size=256"))
    shares = [target_share(source.task, source.next_batch()) for _ in range(6)]
    assert shares[:2] == pytest.approx([0.1, 0.1], abs=0.02)
    assert shares[2] == pytest.approx(0.1 + 0.8 / 3, abs=0.03) and shares[4:] == pytest.approx([0.9, 0.9], abs=0.02)
    assert source.step == 6


def test_the_evaluation_set_is_drawn_from_the_policy_of_its_step(tmp_path):
    source = TaskSource(config(tmp_path, *RAMP, "trainer.eval_size=512"))
    fixed = TaskSource(config(tmp_path, "task.target_prob=0.1", "trainer.eval_size=512"))
    first = source.evaluation_batch(0)
    assert all(torch.equal(first[k], v) for k, v in fixed.eval_batch.items())  # unmoved: today's fixed set
    assert source.evaluation_batch(1) is first
    moved = source.evaluation_batch(5)
    assert target_share(source.task, moved) == pytest.approx(0.9, abs=0.02)
    assert torch.equal(moved["true_values"], source.task.at(5).true_values(moved, 1.0))
    again = TaskSource(config(tmp_path, *RAMP, "trainer.eval_size=512")).evaluation_batch(5)
    assert all(torch.equal(again[k], v) for k, v in moved.items())  # the seed and the step decide it


def test_without_a_drift_the_evaluation_set_never_changes(tmp_path):
    source = TaskSource(config(tmp_path))
    assert all(source.evaluation_batch(step) is source.eval_batch for step in (0, 5, 10_000))
    assert source.tracking(3, {"eval/ev_true": 0.5}, last=True) == {} and "drift_evals" not in source.state()[1]


def test_a_drifting_run_reports_its_tracking_on_the_last_row(tmp_path):
    metrics = train(config(tmp_path / "run", *RAMP, "task.drift=step"), out=io.StringIO())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("eval/ev_true" in r for r in rows) and "eval/tracking_ev" not in rows[-2]
    evs = [r["eval/ev_true"] for r in rows[1:]]  # steps 2..6: from the step on
    assert rows[-1]["eval/tracking_ev"] == pytest.approx(sum(evs) / len(evs))
    assert rows[-1]["eval/worst_ev"] == min(evs) and "eval/recover_steps" in rows[-1]
    assert metrics["eval/tracking_ev"] == rows[-1]["eval/tracking_ev"]


def test_resume_in_the_middle_of_a_ramp_is_the_uninterrupted_run(tmp_path, monkeypatch):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(config(straight, *RAMP), out=io.StringIO())
    calls = {"n": 0}
    original = train_mod._iteration

    def crash_on_fourth(*args):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt  # stopped after step 2 was checkpointed, one step into the ramp
        return original(*args)

    monkeypatch.setattr(train_mod, "_iteration", crash_on_fourth)
    with pytest.raises(train_mod.Interrupted, match="interrupted at step 3"):
        train(config(resumed, *RAMP), out=io.StringIO())
    monkeypatch.setattr(train_mod, "_iteration", original)
    train(config(resumed, *RAMP), out=io.StringIO())
    a, b = load_file(straight / "hf" / "model.safetensors"), load_file(resumed / "hf" / "model.safetensors")
    assert all(torch.equal(a[key], b[key]) for key in a)
    rows_a, rows_b = ((run / "metrics.jsonl").read_text().splitlines() for run in (straight, resumed))
    assert [without_timings(json.loads(r)) for r in rows_a] == [without_timings(json.loads(r)) for r in rows_b]
    assert "eval/tracking_ev" in json.loads(rows_b[-1])


def test_the_drift_bench_measures_the_three_critics_and_tabulates_them():
    """bench/drift.py on a tiny budget: ablation's configurations under a step, tracking metrics, one row each."""
    bench = bench_script("drift.py")
    tiny = [s for s in SHORT if s.startswith(("critic.", "trainer.rollout", "trainer.eval_size"))]
    overrides = [*bench.schedule("step", 2, 1, "0.6"), *tiny]
    runs = {
        name: [bench.measure(name, "counting", 0, overrides, steps=4, start=2, abrupt=True)]
        for name in (bench.ablation.DEFAULT, "verl_lr1e-3", bench.CEILING)
    }
    for (run,) in runs.values():
        assert {"tracking_ev", "worst_ev", "recover_steps"} <= set(run) and run["curve"][-1][0] == 4
    rows = bench.table(runs).splitlines()[2:]
    assert len(rows) == 3 and "(verl-best)" in rows[1] and "(ceiling)" in rows[2]


def drift_run(bench, config: str, seed: int, ev: float, recover: float | None = None) -> dict:
    """A stored drift run as bench/drift.py writes it, on the summary's step schedule."""
    run = {
        "config": config,
        "seed": seed,
        "tracking_ev": ev,
        "worst_ev": ev,
        "drift": bench.schedule("step", 200, 300, None),
    }
    return run | {"steps_budget": 700, "task": "counting"} | ({} if recover is None else {"recover_steps": recover})


def test_the_drift_summary_judges_issue_41s_target_from_the_stored_runs(tmp_path, monkeypatch):
    """One row per task and schedule: medians over seeds, verl-best by its median, and each part of the target the
    default misses, with the ceiling named where it is the bound (here: 0.95 above the ceiling's 0.93)."""
    bench = bench_script("drift.py")
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    default, meta = bench.ablation.DEFAULT, {}
    for seed, (ours, verl, truth) in enumerate([(0.90, 0.80, 0.93), (0.92, 0.85, 0.92), (0.91, 0.70, 0.94)]):
        for config, ev, recover in [(default, ours, 30), ("verl_lr1e-3", verl, math.inf), (bench.CEILING, truth, 10)]:
            bench.ablation.append_result(
                tmp_path / "counting_step.json", drift_run(bench, config, seed, ev, recover), meta
            )
    other = drift_run(bench, default, 0, 0.1) | {"drift": bench.schedule("step", 100, 300, None)}  # another schedule
    bench.ablation.append_result(tmp_path / "counting_step.json", other, meta)
    lucky = drift_run(bench, "verl_lr3e-3", 0, 0.99, 10)  # one seed of a rate dropped after it: not verl-best
    bench.ablation.append_result(tmp_path / "counting_step.json", lucky, meta)
    (row,) = bench.summary().splitlines()[2:]
    assert row.startswith("| counting | step | 0.910, 30 (0.900, 0.920, 0.910) |  | 0.800, never (1e-3) | 0.930, 10 |")
    assert row.endswith("| missed: EV < 0.95 (above the ceiling); recovery > 2x the ceiling's |")
    runs = bench.runs_of("counting", "step")
    runs[default] = [r | {"tracking_ev": 0.96, "recover_steps": 20} for r in runs[default]]
    assert bench.verdict(runs, abrupt=True, eval_every=10) == "**met**"
    runs["verl_lr1e-3"] = [r | {"tracking_ev": 0.95} for r in runs["verl_lr1e-3"]]
    assert bench.verdict(runs, abrupt=True, eval_every=10) == "missed: < verl-best + 0.02 (above the ceiling)"
    runs[bench.CEILING] = [r | {"tracking_ev": 0.99} for r in runs[bench.CEILING]]
    assert bench.verdict(runs, abrupt=True, eval_every=10) == "missed: < verl-best + 0.02"


def test_the_return_noise_of_a_terminal_0_1_reward_is_the_bernoulli_variance_of_the_true_value():
    """counting's only reward is 0/1 at the end (γ 1), so E[(G − V_t)² | prefix] = V_t (1 − V_t): the bench's noise
    matches the mean of that over the same rollouts within 0.06. Bound: each row's mean of (G − V)² − V(1 − V) has
    mean 0 and lies in [−0.25, 1], rows are independent, so over 1024 rows the gap's standard deviation is at most
    0.625 / 32 < 0.02; 0.06 is 3 of them."""
    bench = bench_script("drift.py")
    var, noise = bench.signal_and_noise("counting", 0)
    cfg = load_config(None, ["task.name=counting"])
    policy = bench.ablation.task_of(cfg)
    batch = policy.sample(1024, torch.Generator().manual_seed(0))
    values, mask = policy.true_values(batch).double(), batch["response_mask"].bool()
    assert var == pytest.approx(values[mask].var().item())
    assert noise == pytest.approx((values * (1 - values))[mask].mean().item(), abs=0.06)
    assert noise / var > 1  # counting's returns carry more noise than its values have signal (docs/QUALITY.md)


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--write"], "give it with --report"), (["--noise", "--tasks", "long", "foo"], "unknown tasks ['foo']")],
)
def test_the_drift_bench_refuses_a_lone_write_and_an_unknown_task_before_doing_anything(
    argv, message, monkeypatch, capsys
):
    """`--write` alone would have started a run of hours; `--noise` on an unknown task was a KeyError."""
    bench = bench_script("drift.py")
    monkeypatch.setattr(sys, "argv", ["drift.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        bench.main()
    assert stopped.value.code == 2 and message in capsys.readouterr().err
