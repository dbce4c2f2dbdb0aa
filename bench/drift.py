"""Critic quality under a moving policy (issue 41): the default recipe of `ppo-critic train`, verl's critic at each
rate of its sweep (the best one marked) and the exact-value ceiling, trained on a task whose policy drifts.

Every run is `bench/ablation.py`'s `run_one` (the same configurations, the suite task's overrides) with the task's
`task.drift*` options added; the ceiling regresses on the exact values of the policy of each step's rollouts. Each
evaluation draws the held-out set from the policy of its step. Reported per configuration (median over seeds, every
seed in the JSON): tracking EV (mean `eval/ev_true` from `drift_start` on), worst EV from then, and after a
`--drift step` the iterations until EV is back at 0.9 (`ppo_critic.train.tracking_metrics`).

    OMP_NUM_THREADS=1 python bench/drift.py --tasks counting --seeds 0 --drift step   # one core
    OMP_NUM_THREADS=1 python bench/drift.py --tasks dense --seeds 0 --drift none      # the same window, no drift
    python bench/drift.py --report                                                    # the tables, from the files

Runs are in-process and sequential; each finished run is appended to `bench/results/drift/<task>_<drift>.json` at
once, under a lock (processes on one task may run side by side), and a run already there (same configuration, seed
and schedule) is not run again.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import platform
import statistics
import sys
from pathlib import Path

import torch

from ppo_critic.train import tracking_metrics

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results" / "drift"


def _ablation():
    """bench/ablation.py as the module `ablation` (its configurations, suite and `run_one`), loaded once."""
    if "ablation" in sys.modules:
        return sys.modules["ablation"]
    spec = importlib.util.spec_from_file_location("ablation", BENCH / "ablation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ablation"] = module  # its dataclass resolves annotations through its module
    spec.loader.exec_module(module)
    return module


ablation = _ablation()
SUITE = ablation.SUITE
VERL = tuple(f"verl_lr{lr}" for lr in ablation.BASELINE_LRS)
CEILING = "truth_default"  # the default recipe regressed on the current exact values (ablation's truth_targets)
CONFIGURATIONS = (ablation.DEFAULT, *VERL, CEILING)


def schedule(drift: str, start: int, ramp_steps: int, to: str | None) -> list[str]:
    """The `task.drift*` overrides of a schedule (`to`: drift_to as the command line writes it; None: the task's);
    "none" keeps the policy fixed: the control, tracked over the same iterations."""
    if drift == "none":
        return ["task.drift=none"]
    overrides = [f"task.drift={drift}", f"task.drift_start={start}", f"task.drift_steps={ramp_steps}"]
    return overrides + ([f"task.drift_to={to}"] if to is not None else [])


def measure(config: str, task: str, seed: int, drift: list[str], steps: int, start: int, abrupt: bool) -> dict:
    """One run of `config` on `task` under the `drift` overrides: `run_one`'s record plus its tracking metrics."""
    run = ablation.run_one(config, [*ablation.overrides_of(config, task), *drift], seed, steps, SUITE[task].eval_every)
    curve = [(step, ev) for step, ev, _ in run["curve"]]
    tracked = tracking_metrics(curve, warmup=start, changed_at=start if abrupt else None)
    if "curve_live" in run:  # the live weights under ema_decay: the average as a target network only
        live = tracking_metrics(run["curve_live"], warmup=start, changed_at=start if abrupt else None)
        tracked |= {f"{key}_live": value for key, value in live.items()}
    return run | tracked | {"task": task, "drift": drift, "steps_budget": steps}


def verl_best(runs: dict[str, list[dict]]) -> str | None:
    """verl's configuration with the highest median tracking EV; None when none ran."""
    sweep = [name for name in runs if name in VERL]
    return max(sweep, key=lambda name: median(runs[name], "tracking_ev")) if sweep else None


def median(rows: list[dict], key: str) -> float:
    """The median of `key` over seeds (inf counts as the slowest; nan when no seed has it)."""
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else math.nan


def table(runs: dict[str, list[dict]]) -> str:
    """Markdown: a row per configuration, tracking EV, worst EV and iterations to recover EV 0.9 (median; per seed)."""
    lines = [
        "| configuration | seeds | tracking EV (median; per seed) | worst EV | iterations to EV 0.9 after the step |",
        "|---|---|---|---|---|",
    ]
    best = verl_best(runs)
    for name in sorted(runs, key=lambda n: CONFIGURATIONS.index(n) if n in CONFIGURATIONS else len(CONFIGURATIONS)):
        rows = runs[name]
        label = name + (" (verl-best)" if name == best else " (ceiling)" if name == CEILING else "")
        seeds = ", ".join(f"{r['tracking_ev']:.3f}" for r in rows)
        recover = median(rows, "recover_steps")
        recovered = "—" if math.isnan(recover) else "never" if math.isinf(recover) else f"{recover:.0f}"
        lines.append(
            f"| {label} | {len(rows)} | {median(rows, 'tracking_ev'):.3f} ({seeds}) | "
            f"{median(rows, 'worst_ev'):.3f} | {recovered} |"
        )
    return "\n".join(lines)


def by_config(results: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for r in sorted(results, key=lambda r: r["seed"]):
        grouped.setdefault(r["config"], []).append(r)
    return grouped


def report(paths: list[Path]) -> str:
    """A table per task and schedule (a result file holds one task under one kind of drift), titled with it."""
    parts = []
    for path in paths:
        schedules: dict[tuple, list[dict]] = {}
        for r in ablation.read_results(path):
            schedules.setdefault((r["task"], *r["drift"], r["steps_budget"]), []).append(r)
        for (task, *drift, steps), results in schedules.items():
            parts += [f"### {task}, {' '.join(drift)}, {steps} iterations", "", table(by_config(results)), ""]
    return "\n".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="*", default=["counting"], help=f"tasks to run, from {list(SUITE)}")
    p.add_argument("--only", nargs="*", default=list(CONFIGURATIONS), help="configurations (of bench/ablation.py)")
    p.add_argument("--seeds", nargs="*", type=int, default=[0])
    p.add_argument("--drift", choices=("ramp", "step", "none"), default="ramp", help="none: the fixed-policy control")
    p.add_argument("--start", type=int, default=200, help="task.drift_start: iterations on the fixed policy first")
    p.add_argument("--ramp-steps", type=int, default=300, help="task.drift_steps (drift=ramp)")
    p.add_argument("--to", default=None, help="task.drift_to (default: the task's)")
    p.add_argument("--steps", type=int, default=700, help="iterations of every run")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--report", action="store_true", help="only print the tables of bench/results/drift/")
    args = p.parse_args()
    if args.report:
        print(report(sorted(RESULTS.glob("*.json"))))
        return
    torch.set_num_threads(args.threads)
    if unknown := sorted(set(args.tasks) - set(SUITE)):
        p.error(f"unknown tasks {unknown}; known: {list(SUITE)}")
    if unknown := sorted(set(args.only) - set(ablation.CONFIGS)):
        p.error(f"unknown configurations {unknown}; bench/ablation.py's: {list(ablation.CONFIGS)}")
    if args.steps <= args.start:
        p.error(f"--steps {args.steps} must exceed --start {args.start}: tracking is measured from the drift's start")
    RESULTS.mkdir(parents=True, exist_ok=True)
    drift = schedule(args.drift, args.start, args.ramp_steps, args.to)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads()}
    for task in args.tasks:
        path = RESULTS / f"{task}_{args.drift}.json"
        for seed in args.seeds:
            for name in args.only:
                done = [
                    r
                    for r in ablation.read_results(path)
                    if (r["config"], r["seed"], r["drift"]) == (name, seed, drift)
                ]
                if done and done[0]["steps_budget"] == args.steps:
                    continue
                run = measure(name, task, seed, drift, args.steps, args.start, args.drift == "step")
                ablation.append_result(path, run, meta)
                recover = run.get("recover_steps", "—")
                print(
                    f"{task} {name} seed={seed}: tracking EV {run['tracking_ev']:.3f} worst {run['worst_ev']:.3f} "
                    f"recover {recover} train_s {run['train_s']:.0f}",
                    flush=True,
                )
        print(report([path]))


if __name__ == "__main__":
    main()
