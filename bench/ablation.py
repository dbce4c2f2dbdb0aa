"""Critic-quality ablation over the built-in task suite: every configuration on every task, several seeds.

Every run trains the model of `ppo-critic train` on one task's rollout stream (fixed by the seed, the same for every
configuration) for the task's iteration budget, and is judged every `eval_every` iterations by `eval/ev_true`:
explained variance of `compute_values` against the task's exact values on its held-out rollouts. Reported per task
and configuration: iterations until EV first reaches 0.9 and 0.95 and the best EV within the budget (median over
seeds, every seed's numbers in the JSON), and seconds per iteration measured side by side (`--timing`).

    python bench/ablation.py --tasks counting dense long           # every configuration, seeds 0 1 2 (one core)
    python bench/ablation.py --tasks recall lengths scale          # the other half (the other core)
    python bench/ablation.py --timing                              # seconds per iteration, side by side
    python bench/ablation.py --report                              # the tables of docs/QUALITY.md

Runs are in-process and sequential, seed-major (a partial run still compares configurations on the same seeds);
each finished run is appended to `bench/results/suite/<task>.json` at once, and a run already there is not run
again, so an interrupted ablation continues where it stopped.
"""

from __future__ import annotations

import argparse
import fcntl
import io
import json
import platform
import re
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ppo_critic.cli import load_config
from ppo_critic.run.files import write_file
from ppo_critic.tasks import TASKS
from ppo_critic.train import Targets, critic_returns, train

RESULTS = Path(__file__).resolve().parent / "results" / "suite"
QUALITY = Path(__file__).resolve().parents[1] / "docs" / "QUALITY.md"
BEGIN, END = "<!-- suite tables: bench/ablation.py --report -->", "<!-- end of suite tables -->"
TARGETS = (0.9, 0.95)
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class SuiteTask:
    """A task of the suite: what it stresses, the overrides that select it (the same for every configuration), its
    iteration budget and how often it is evaluated."""

    stresses: str
    overrides: tuple[str, ...]
    steps: int
    eval_every: int = 10


SUITE = {
    "counting": SuiteTask("a sparse 0/1 terminal reward on a count (the default job)", ("task.name=counting",), 400),
    "dense": SuiteTask(
        "a reward on many tokens, discounted (γ = 0.9)", ("task.name=dense", "trainer.gamma=0.9"), 800, 20
    ),
    "long": SuiteTask(
        "256–288-token responses, one reward at the very end",
        ("task.name=long", "trainer.rollout_batch_size=96", "trainer.eval_size=256"),
        200,
    ),
    "recall": SuiteTask(
        "the value hinges on a prompt token 34+ tokens back",
        ("task.name=recall", "trainer.rollout_batch_size=96"),
        600,
        20,
    ),
    "lengths": SuiteTask("response lengths 8–96 (12× spread), the end unannounced", ("task.name=lengths",), 600, 20),
    "scale": SuiteTask("rewards in [−30, 50] around 10: value normalisation", ("task.name=scale",), 400),
}

# verl's critic as verl configures it (verl/trainer/config/critic/critic.yaml, dp_critic.yaml, algorithm.lam 1.0):
# one PPO epoch, value clipping 0.5 around the old values, AdamW with weight decay 0.01 at a constant rate without
# warmup, grad clip 1.0, token-mean, no shuffling, a token-classification head with transformers' init, no return
# normalisation, values from the live weights, GAE lam 1. Every key is pinned, so the defaults of `ppo-critic train`
# cannot leak in. The batch sizes are those of `ppo-critic train` (one micro-batch of 96 rows per mini-batch).
VERL = [
    "trainer.rollout_batch_size=192",
    "trainer.lam=1.0",
    "trainer.length_adaptive_alpha=null",
    "trainer.length_adaptive_scope=response",  # what every α configuration before the batch scope ran with
    "trainer.critic_warmup_steps=0",
    "trainer.replay_rows=0",
    "critic.ppo_mini_batch_size=96",
    "critic.ppo_micro_batch_size_per_gpu=null",
    "critic.value_norm=off",
    "critic.ema_decay=0.0",
    "critic.vf_loss_type=mse",
    "critic.ppo_epochs=1",
    "critic.cliprange_value=0.5",
    "critic.grad_clip=1.0",
    "critic.loss_agg_mode=token-mean",
    "critic.shuffle=false",
    "critic.model.value_head_init=default",
    "critic.optim.lr=1e-3",
    "critic.optim.value_head_lr_ratio=1.0",
    "critic.optim.weight_decay=0.01",
    "critic.optim.warmup_style=constant",
    "critic.optim.lr_warmup_steps=-1",
    "critic.optim.min_lr_ratio=null",
]
BASELINE_LRS = ("3e-4", "1e-3", "3e-3")  # verl's 1e-5 is for a pretrained LLM; this model starts random
PREVIOUS = [*VERL, "trainer.lam=0.5", "critic.ema_decay=0.9"]  # the defaults of `ppo-critic train` before the suite

RECIPE = [*VERL, "critic.ema_decay=0.9", "critic.value_norm=running"]  # λ 1 + weight averaging + running statistics
ALPHA05 = [*RECIPE, "trainer.length_adaptive_alpha=0.5", "critic.optim.lr=3e-4"]  # the default recipe
BATCH = [*ALPHA05, "critic.optim.lr=5e-4", "trainer.length_adaptive_scope=batch"]  # α 0.5 from ALPHA05
LAM1, NOEMA, POPART = "trainer.length_adaptive_alpha=null", "critic.ema_decay=0.0", "critic.value_norm=popart"
VND99, NOCLIP = ["critic.value_norm_decay=0.99"], "critic.cliprange_value=null"
REPLAY96, REPLAY192, SURPRISE = "trainer.replay_rows=96", "trainer.replay_rows=192", "trainer.surprise_z=5"
LR1 = "trainer.surprise_lr_scale=1"
SURPRISE_MC = [SURPRISE, LR1, "trainer.surprise_mc_targets=true"]
COSINE = ["critic.optim.warmup_style=cosine", "critic.optim.min_lr_ratio=0.1"]  # over trainer.steps, the budget
CONFIGS: dict[str, tuple[str, list[str]]] = {
    **{f"verl_lr{lr}": (f"verl's critic at lr {lr}", [*VERL, f"critic.optim.lr={lr}"]) for lr in BASELINE_LRS},
    "previous": ("λ 0.5 + EMA 0.9 (the defaults of `ppo-critic train` before the suite)", PREVIOUS),
    "ema": ("verl + critic.ema_decay=0.9", [*VERL, "critic.ema_decay=0.9"]),
    "running": ("verl + critic.value_norm=running", [*VERL, "critic.value_norm=running"]),
    "ema_running": ("verl + EMA 0.9 + value_norm=running", RECIPE),
    "lam05_running": ("ema_running with the critic's λ 0.5", [*RECIPE, "trainer.lam=0.5"]),
    "adaptive_running": (
        "ema_running with length-adaptive λ = 1 − 1/(0.2·l)",
        [*RECIPE, "trainer.length_adaptive_alpha=0.2"],
    ),
    "mc_warmup": (
        "lam05_running after 50 iterations of Monte-Carlo returns (value pretraining)",
        [*RECIPE, "trainer.lam=0.5", "trainer.critic_warmup_steps=50"],
    ),
    "head_lr10": ("ema_running + value_head_lr_ratio=10", [*RECIPE, "critic.optim.value_head_lr_ratio=10"]),
    "ema_running_lr3e-4": ("ema_running at lr 3e-4", [*RECIPE, "critic.optim.lr=3e-4"]),
    "lam05_running_lr3e-4": ("lam05_running at lr 3e-4", [*RECIPE, "trainer.lam=0.5", "critic.optim.lr=3e-4"]),
    "adaptive_running_lr3e-4": (
        "adaptive_running at lr 3e-4",
        [*RECIPE, "trainer.length_adaptive_alpha=0.2", "critic.optim.lr=3e-4"],
    ),
    **{
        f"alpha{a}_running_lr3e-4": (
            f"adaptive_running_lr3e-4 with α = {a} (λ closer to 1 on short responses)",
            [*RECIPE, f"trainer.length_adaptive_alpha={a}", "critic.optim.lr=3e-4"],
        )
        for a in ("0.5", "0.7", "1")
    },
    "alpha0.5_running_lr5e-4": ("alpha0.5_running_lr3e-4 at lr 5e-4", [*ALPHA05, "critic.optim.lr=5e-4"]),
    **{
        f"alpha0.5_{name}_lr3e-4": (f"alpha0.5_running_lr3e-4 with {what}", [*ALPHA05, override])
        for name, what, override in (
            ("zerohead", "a zero value head (first outputs: the running mean)", "critic.model.value_head_init=zero"),
            ("noclip", "no value clipping", "critic.cliprange_value=null"),
        )
    },
    **{
        f"batch_alpha{a}_lr5e-4{suffix}": (
            f"alpha0.5_running_lr5e-4 with α = {a}, λ by the batch's mean length{what}",
            [*BATCH, f"trainer.length_adaptive_alpha={a}", *extra],
        )
        for a, suffix, what, extra in (
            ("0.5", "", "", []),
            ("1", "", "", []),
            ("0.5", "_noclip", ", no value clipping", ["critic.cliprange_value=null"]),
        )
    },
    # the default's variants screened on `lengths`, the one task whose bar it misses with room left under the ceiling
    **{
        f"batch_alpha0.5_lr5e-4_{suffix}": (f"batch_alpha0.5_lr5e-4 (the default): {what}", [*BATCH, *extra])
        for suffix, what, extra in (
            ("alpha0.2", "α 0.2 (λ ≈ 0.78 there)", ["trainer.length_adaptive_alpha=0.2"]),
            ("lam0.5", "a fixed λ 0.5", ["trainer.length_adaptive_alpha=null", "trainer.lam=0.5"]),
            ("mb48", "mini-batches of 48 (4 steps per iteration)", ["critic.ppo_mini_batch_size=48"]),
            ("mb24", "mini-batches of 24 (8 steps per iteration)", ["critic.ppo_mini_batch_size=24"]),
            ("lr7e-4", "at lr 7e-4", ["critic.optim.lr=7e-4"]),
            ("cosine", "the rate cosine-decayed to 0.1× over the budget", COSINE),
            ("cosine_lr1e-3", "lr 1e-3 cosine-decayed to 0.1×", [*COSINE, "critic.optim.lr=1e-3"]),
            ("beta2_0.99", "AdamW β2 0.99", ["critic.optim.betas=[0.9,0.99]"]),
            ("ema0.95", "EMA 0.95", ["critic.ema_decay=0.95"]),
            ("nonorm", "no return normalisation", ["critic.value_norm=off"]),
            ("seqmean", "every response weighted alike", ["critic.loss_agg_mode=seq-mean-token-mean"]),
        )
    },
    # levers for a moving policy (issue 41, bench/drift.py), each on the default
    **{
        f"batch_alpha0.5_lr5e-4_{suffix}": (f"batch_alpha0.5_lr5e-4 (the default): {what}", [*BATCH, *extra])
        for suffix, what, extra in (
            ("vnd0.9", "return statistics that forget, decay 0.9", ["critic.value_norm_decay=0.9"]),
            ("vnd0.99", "return statistics that forget, decay 0.99", ["critic.value_norm_decay=0.99"]),
            ("noema", "no weight average", ["critic.ema_decay=0.0"]),
            ("ema0.5", "EMA 0.5", ["critic.ema_decay=0.5"]),
            ("epochs2", "2 passes over each batch (2× the critic's work)", ["critic.ppo_epochs=2"]),
            ("lr1e-3", "at lr 1e-3", ["critic.optim.lr=1e-3"]),
            ("lam1", "Monte-Carlo targets (λ 1: no bootstrap from a lagging critic)", [LAM1]),
            ("lam1_noema", "λ 1 and no weight average", [LAM1, "critic.ema_decay=0.0"]),
            ("nonorm_lam1", "no return normalisation, λ 1", ["critic.value_norm=off", LAM1]),
            ("nonorm_noema", "no return normalisation, no weight average", ["critic.value_norm=off", NOEMA]),
            ("popart", "PopArt (outputs kept while the statistics move; no weight average)", [POPART, NOEMA]),
            ("popart_ema", "PopArt with the weight average (both heads rescaled when the statistics move)", [POPART]),
            ("vnd0.99_noclip", "statistics that forget (0.99), no value clipping", [*VND99, NOCLIP]),
            ("replay96", "96 rows of the last 4 batches replayed per update (1.5× the critic's work)", [REPLAY96]),
            ("replay192", "192 rows of the last 4 batches replayed per update (2× the critic's work)", [REPLAY192]),
            ("surprise5", "on a jump of the fresh residual (z 5): the average restarted, 2× lr for 20", [SURPRISE]),
            ("surprise5_lr1", "on a surprise (z 5) the average restarted only", [SURPRISE, LR1]),
            (
                "surprise5_mc",
                "on a surprise (z 5) the average restarted, 20 updates on Monte-Carlo targets",
                SURPRISE_MC,
            ),
            ("popart_ema_replay96", "PopArt with the weight average, 96 rows replayed per update", [POPART, REPLAY96]),
            (
                "nonorm_replay96",
                "no return normalisation, 96 rows replayed per update",
                ["critic.value_norm=off", REPLAY96],
            ),
        )
    },
    # groups of responses (issue 41 item 3): n per prompt at the same rollouts and the same 96-row mini-batches,
    # plain, and with the returns of the states a group shares averaged (trainer.shared_prefix_returns)
    **{
        f"batch_alpha0.5_lr5e-4_n{n}{suffix}": (
            f"batch_alpha0.5_lr5e-4 (the default): {n} responses per prompt{what}",
            [*BATCH, f"critic.rollout_n={n}", f"critic.ppo_mini_batch_size={96 // n}", *extra],
        )
        for n in (4, 8)
        for suffix, what, extra in (
            ("", "", []),
            ("_spr", ", the returns of shared states averaged", ["trainer.shared_prefix_returns=true"]),
        )
    },
    "adaptive_ema_lr3e-4": (
        "adaptive_running_lr3e-4 without value_norm",
        [*VERL, "critic.ema_decay=0.9", "trainer.length_adaptive_alpha=0.2", "critic.optim.lr=3e-4"],
    ),
    "adaptive_norm_lr3e-4": (
        "adaptive_running_lr3e-4 without EMA",
        [*VERL, "critic.value_norm=running", "trainer.length_adaptive_alpha=0.2", "critic.optim.lr=3e-4"],
    ),
    "head_lr10_lr3e-4": (
        "ema_running at lr 3e-4, the head at 10× (3e-3)",
        [*RECIPE, "critic.optim.lr=3e-4", "critic.optim.value_head_lr_ratio=10"],
    ),
    **{
        f"alpha0.5_ema99w_lr{lr}": (
            f"alpha0.5_running at lr {lr} with EMA 0.99 after timm's warmup (an average over ever more steps)",
            [*ALPHA05, "critic.ema_decay=0.99", "critic.ema_warmup=true", f"critic.optim.lr={lr}"],
        )
        for lr in ("3e-4", "1e-3")
    },
    **{
        f"truth_lr{lr}": (
            f"a ceiling: verl's critic at lr {lr} regressed on the true values",
            [*VERL, f"critic.optim.lr={lr}"],
        )
        for lr in BASELINE_LRS
    },
}
DEFAULT = "batch_alpha0.5_lr5e-4_popart_ema_replay96"  # `ppo-critic train`'s defaults (tests/test_quality.py)
# the default from 2026-12-03 to 2026-12-05 (running statistics, no replay): the `*_default` configurations below
# and the second model size were measured with it, and keep its recipe under their names
RUNNING_DEFAULT = "batch_alpha0.5_lr5e-4"
CONFIGS["truth_default"] = (
    "a ceiling: the default recipe until 2026-12-05 regressed on the true values",
    CONFIGS[RUNNING_DEFAULT][1],
)
# what the noise of the returns costs alone: GAE bootstraps from the exact values instead of the critic's, so the
# targets carry the outcome noise of their λ and no bootstrap error (unbiased at any λ; λ 0 is the least noisy)
CONFIGS["exactboot_default"] = (
    "the default until 2026-12-05, its GAE bootstrapped from the exact values",
    CONFIGS[RUNNING_DEFAULT][1],
)
CONFIGS["exactboot_lam0"] = (
    "the default until 2026-12-05 at λ 0, bootstrapped from the exact values (one-step targets: the least noise)",
    [*CONFIGS[RUNNING_DEFAULT][1], "trainer.length_adaptive_alpha=null", "trainer.lam=0.0"],
)
# the second model size: verl's sweep, the default and its ceiling on hidden 128 × 4 layers (4× the parameters of the
# body), so that the recipe is not tuned to one model; reported in a table of their own
LARGER = "@128x4"
LARGER_MODEL = [
    "critic.model.override_config.hidden_size=128",
    "critic.model.override_config.intermediate_size=512",
    "critic.model.override_config.num_hidden_layers=4",
]
for _name in [*(f"verl_lr{lr}" for lr in BASELINE_LRS), RUNNING_DEFAULT, "truth_default"]:
    CONFIGS[_name + LARGER] = (f"{CONFIGS[_name][0]}, hidden 128 × 4 layers", [*CONFIGS[_name][1], *LARGER_MODEL])
TRUTH = {name for name in CONFIGS if name.startswith("truth_")}  # targets: the task's exact values, not returns


def size_of(name: str) -> str:
    """The model size a configuration names after `@` ("" for the suite's model)."""
    return name.partition("@")[2]


def base_of(name: str) -> str:
    """The configuration a sized one reruns on another model (itself for the suite's model)."""
    return name.partition("@")[0]


def task_of(cfg):
    """The built-in task `cfg` trains on, for its exact values (`true_values`)."""
    return TASKS[cfg.task.get("name", "counting")][0](cfg.task_config())


def truth_targets(task) -> Targets:
    """The exact values as the regression targets (no return noise, no bootstrap bias): how fast the model and the
    rate allow a critic to learn the task at all; under `task.drift` those of the policy of the step's rollouts."""
    return lambda batch, values, trainer, step: task.at(step).true_values(batch, trainer.gamma)


def exact_bootstrap_targets(task) -> Targets:
    """The returns bootstrapped from the task's exact values (the old values of the clipped loss stay the critic's):
    the return noise of the configuration's λ without its bootstrap error."""
    return lambda batch, values, trainer, step: critic_returns(
        batch, task.at(step).true_values(batch, trainer.gamma), trainer, step
    )


def targets_of(name: str, cfg) -> Targets:
    """What a configuration regresses on: `critic_returns` (the trainer's default) but for the ceilings' and the
    exact-bootstrap configurations'."""
    if base_of(name) in TRUTH:
        return truth_targets(task_of(cfg))
    return exact_bootstrap_targets(task_of(cfg)) if name.startswith("exactboot_") else critic_returns


def run_one(
    name: str, overrides: list[str], seed: int, steps: int, eval_every: int, watch: Callable[[int], None] | None = None
) -> dict:
    """Train one configuration for one seed: the EV curve [(iteration, EV, training seconds so far)], the best and
    the final EV, and the training seconds (evaluation excluded); `watch(step)`, if given, after every step."""
    curve: list[tuple[int, float, float]] = []
    live: list[tuple[int, float]] = []  # under ema_decay, the live weights' EV beside the average's
    surprises: list[int] = []  # the steps trainer.surprise_z reacted at

    def on_step(step: int, metrics: dict[str, float], train_s: float) -> None:
        if "eval/ev_true" in metrics:
            curve.append((step, metrics["eval/ev_true"], train_s))
        if "eval/ev_true_live" in metrics:
            live.append((step, metrics["eval/ev_true_live"]))
        if metrics.get("surprise/reacted"):
            surprises.append(step)
        if watch is not None:
            watch(step)

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(
            None,
            [
                *overrides,
                f"trainer.steps={steps}",
                f"trainer.eval_every={eval_every}",
                f"trainer.seed={seed}",
                f"trainer.run_dir={run_dir}",
                "trainer.resume=never",
                "trainer.save_every=0",
                "trainer.progress=false",
                "trainer.logger=[console,jsonl]",
                "trainer.export_hf=false",
                "trainer.eval_live_weights=true",  # the live weights beside the average (bench/drift.py)
            ],
        )
        train(cfg, out=io.StringIO(), on_step=on_step, targets=targets_of(name, cfg))
    return (
        {
            "config": name,
            "seed": seed,
            "best_ev": max(ev for _, ev, _ in curve),
            "final_ev": curve[-1][1],
            "train_s": curve[-1][2],
            "curve": curve,
        }
        | ({"curve_live": live} if live else {})
        | ({"surprises": surprises} if "surprise_z" in str(overrides) else {})
    )


def overrides_of(config: str, task: str) -> list[str]:
    """The configuration's overrides, then the task's (which never touch what the configurations vary)."""
    return [*CONFIGS[config][1], *SUITE[task].overrides]


def first_reach(curve: list, target: float) -> int | None:
    """The iteration of the first evaluation with EV >= `target`, or None."""
    return next((int(s) for s, ev, _ in curve if ev >= target), None)


def median_reach(runs: list[dict], target: float) -> int | None:
    """Median iterations to `target` over seeds (the lower median for an even count), where a run that never reached
    it counts as slower than any that did; None when the median run did not reach it."""
    ranked = sorted((first_reach(r["curve"], target) for r in runs), key=lambda x: float("inf") if x is None else x)
    return ranked[(len(ranked) - 1) // 2]


def verl_best(runs: dict[str, list[dict]], size: str = "") -> str | None:
    """The baseline configuration of the sweep (on the model `size`) that reaches EV 0.95 in the fewest median
    iterations, ties (and a sweep that never reaches it) broken by the higher median best EV; None when none ran."""

    def key(name: str) -> tuple[float, float]:
        reach = median_reach(runs[name], TARGETS[-1])
        return (float("inf") if reach is None else reach, -statistics.median(r["best_ev"] for r in runs[name]))

    sweep = [n for n in runs if n.startswith("verl_lr") and size_of(n) == size]
    return min(sweep, key=key) if sweep else None


def task_table(task: str, runs: dict[str, list[dict]], timing: dict[str, float]) -> str:
    """Markdown: a row per configuration; per target the median iterations (every seed's in brackets, — for never),
    then best and final EV (median; min over seeds) and seconds per iteration (side by side when timed)."""
    head = "| configuration | seeds |" + "".join(f" iterations to EV {t} (median; per seed) |" for t in TARGETS)
    lines = [
        head + " best EV (median; min) | final EV (median) | s / iteration |",
        "|---|---|" + "---|" * len(TARGETS) + "---|---|---|",
    ]
    best = {verl_best(runs, size_of(name)) for name in runs}
    for name, rows in runs.items():
        label = f"**{name}** (verl-best)" if name in best else f"**{name}**" if name == DEFAULT else name
        label += " (the default until 2026-12-05)" if base_of(name) == RUNNING_DEFAULT else ""
        label += " (ceiling)" if base_of(name) in TRUTH else ""
        line = f"| {label} | {len(rows)} |"
        for target in TARGETS:
            reach = median_reach(rows, target)
            seeds = ", ".join("—" if x is None else str(x) for x in (first_reach(r["curve"], target) for r in rows))
            line += f" {'—' if reach is None else reach} ({seeds}) |"
        per_step = timing.get(name, statistics.median(r["train_s"] / r["curve"][-1][0] for r in rows))
        lines.append(
            line + f" {statistics.median(r['best_ev'] for r in rows):.3f} ({min(r['best_ev'] for r in rows):.3f}) |"
            f" {statistics.median(r['final_ev'] for r in rows):.3f} | {per_step:.3f} |"
        )
    return "\n".join(lines)


def ceiling(runs: dict[str, list[dict]], size: str = "") -> tuple[str, int] | None:
    """The exact-value ceiling on the model `size`: of the configurations regressed on the true values, the one
    reaching EV 0.95 in the fewest median iterations, and that number (None when none ran or none reached it)."""
    ran = [name for name in runs if base_of(name) in TRUTH and size_of(name) == size]
    reached = [(reach, name) for name in ran if (reach := median_reach(runs[name], TARGETS[-1]))]
    return min(reached)[::-1] if reached else None


RATIO_BAR, EV_BAR, WORK_BAR = 1.5, 0.98, 1.05  # issue 33: iterations / ceiling, best EV, work / verl-best's


def summary_table(
    results: dict[str, dict[str, list[dict]]], work: dict[str, dict[str, float]], size: str = "", ours: str = DEFAULT
) -> str:
    """Markdown: per task, the recipe `ours` (on the model `size`) against verl-best and the exact-value ceiling,
    and whether it meets the bar: iterations to EV 0.95 within RATIO_BAR of the ceiling's, best EV at least EV_BAR,
    neither worse than verl-best's, and operator time per iteration (`--work`) within WORK_BAR of verl-best's."""
    ours_name = ours + (f"@{size}" if size else "")
    lines = [
        f"| task | verl-best | its iterations to 0.95 / best EV | {ours_name}: iterations to 0.95 / best EV | "
        "exact-value ceiling: iterations to 0.95 | default / ceiling | work per iteration: default / verl-best | "
        "bar met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for task, runs in results.items():
        best = verl_best(runs, size)
        if ours_name not in runs or best is None:
            continue
        ours, theirs = median_reach(runs[ours_name], TARGETS[-1]), median_reach(runs[best], TARGETS[-1])
        ev_ours = statistics.median(r["best_ev"] for r in runs[ours_name])
        ev_theirs = statistics.median(r["best_ev"] for r in runs[best])
        top = ceiling(runs, size)
        ratio = ours / top[1] if ours is not None and top else None
        times = work.get(task, {})
        work_ratio = None
        if ours_name in times and best in times:
            work_ratio = times[ours_name]["seconds"] / times[best]["seconds"]
        misses = [
            what
            for what, failed in (
                (f"> {RATIO_BAR}× the ceiling", ratio is None or ratio > RATIO_BAR),
                (f"best EV < {EV_BAR}", ev_ours < EV_BAR),
                ("slower than verl-best", theirs is not None and (ours is None or ours > theirs)),
                ("best EV below verl-best's", ev_ours < ev_theirs),
                (f"work > {WORK_BAR}× verl-best's", work_ratio is not None and work_ratio > WORK_BAR),
            )
            if failed
        ]
        verdict = "yes" if not misses else "**no**: " + ", ".join(misses)
        lines.append(
            f"| {task} | {best} | {theirs or '—'} / {ev_theirs:.3f} | {ours or '—'} / {ev_ours:.3f} | "
            f"{f'{top[1]} ({top[0]})' if top else '—'} | {'—' if ratio is None else f'{ratio:.2f}'} | "
            f"{'—' if work_ratio is None else f'{work_ratio:.3f}'} | {verdict} |"
        )
    return "\n".join(lines)


def bounds_table(results: dict[str, dict[str, list[dict]]]) -> str:
    """Markdown: per task, iterations to EV 0.95 as multiples of the exact-value ceiling's: the default; the fastest
    configuration trained on returns, by median over 3 seeds and at seed 0 alone (the screen, every configuration);
    and the exact-bootstrap runs, which keep the return noise of their λ without the critic's bootstrap error."""
    lines = [
        "| task | ceiling | default | fastest on returns, 3 seeds | fastest on returns, seed 0 | exactboot_default | "
        "exactboot_lam0 |",
        "|---|---|---|---|---|---|---|",
    ]

    def times(reach: int | None, top: int) -> str:
        return "never" if reach is None else f"{reach} ({reach / top:.2f}×)"

    def fastest(runs: dict[str, list[dict]], names: list[str], top: int, seed0: bool) -> str:
        def reach(name: str) -> int | None:
            rows = [r for r in runs[name] if r["seed"] == 0] if seed0 else runs[name]
            return median_reach(rows, TARGETS[-1]) if rows else None

        reached = [(n_reach, n) for n in names if (n_reach := reach(n)) is not None]
        if not reached:
            return "—"
        iterations, name = min(reached)
        return f"{name}: {times(iterations, top)}"

    def exact(runs: dict[str, list[dict]], name: str, top: int) -> str:
        if name not in runs:
            return "—"
        count = len(runs[name])
        return f"{times(median_reach(runs[name], TARGETS[-1]), top)}, {count} seed{'s' * (count > 1)}"

    for task, runs in results.items():
        top = ceiling(runs)
        if top is None or DEFAULT not in runs:
            continue
        trained = [n for n in runs if not size_of(n) and n not in TRUTH and not n.startswith("exactboot_")]
        three = [n for n in trained if len(runs[n]) >= len(SEEDS)]
        lines.append(
            f"| {task} | {top[1]} ({top[0]}) | {times(median_reach(runs[DEFAULT], TARGETS[-1]), top[1])} | "
            f"{fastest(runs, three, top[1], False)} | {fastest(runs, trained, top[1], True)} | "
            f"{exact(runs, 'exactboot_default', top[1])} | {exact(runs, 'exactboot_lam0', top[1])} |"
        )
    return "\n".join(lines)


def load(task: str) -> list[dict]:
    return read_results(RESULTS / f"{task}.json")


def read_results(path: Path) -> list[dict]:
    """The runs of a result file ({"meta", "results"}); none while it does not exist."""
    return json.loads(path.read_text())["results"] if path.exists() else []


def append_result(path: Path, run: dict, meta: dict) -> None:
    """Add a finished run to a result file, read and rewritten under a lock (`.<name>.lock` beside it): benches running
    side by side on the same file (other seeds or configurations) each keep every run of the others."""
    with open(path.with_name(f".{path.stem}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        write_file(path, json.dumps({"meta": meta, "results": [*read_results(path), run]}, indent=1))


def append(task: str, run: dict, meta: dict) -> None:
    """Add a finished run to the task's result file (`append_result`)."""
    append_result(RESULTS / f"{task}.json", run, meta)


def by_config(results: list[dict]) -> dict[str, list[dict]]:
    """Runs grouped by configuration, in CONFIGS order (then any others, e.g. `--label`ed explorations)."""
    order = {name: i for i, name in enumerate(CONFIGS)}
    grouped: dict[str, list[dict]] = {}
    for r in sorted(results, key=lambda r: (order.get(r["config"], len(order)), r["seed"])):
        grouped.setdefault(r["config"], []).append(r)
    return grouped


def timing_rounds(task: str, names: list[str], steps: int, rounds: int) -> dict[str, float]:
    """Training seconds per iteration of each configuration on `task`, side by side: `rounds` rounds, each running
    every configuration for `steps` iterations in turn (so machine load hits all alike); the median over rounds."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            run = run_one(name, overrides_of(name, task), seed=0, steps=steps, eval_every=steps)
            times[name].append(run["train_s"] / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def counted(prof: torch.profiler.profile) -> dict[str, float]:
    """What torch.profiler counted of all operators: their summed self time (`seconds`: the work without the
    interpreter's overhead or the host's idle time), their floating-point operations as the profiler estimates them
    (`flops`: matrix products) and the operator calls (`calls`)."""
    events = prof.key_averages()
    return {
        "seconds": sum(e.self_cpu_time_total for e in events) / 1e6,
        "flops": float(sum(e.flops for e in events)),
        "calls": float(sum(e.count for e in events)),
    }


def profile_steps(first: int, last: int, measured: list[dict[str, float]]) -> Callable[[int], None]:
    """A `run_one` watch that appends what `counted` counts of each iteration `first`..`last` to `measured`: each
    profiled from the end of the step before it to its own end (its logging does no tensor work)."""
    running: list[torch.profiler.profile] = []

    def watch(step: int) -> None:
        if running:
            prof = running.pop()
            prof.stop()
            measured.append(counted(prof))
        if first <= step + 1 <= last:
            running.append(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True))
            running[0].start()

    return watch


def work_rounds(task: str, names: list[str], steps: int, rounds: int) -> dict[str, dict[str, float]]:
    """What `counted` counts of one iteration of each configuration on `task`, side by side: `rounds` rounds, each
    running every configuration for `steps` iterations in turn; per configuration the median over every iteration
    but each run's first two (warm-up) and its last (it evaluates)."""
    measured: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            watch = profile_steps(3, steps - 1, measured[name])
            run_one(name, overrides_of(name, task), seed=0, steps=steps, eval_every=steps, watch=watch)
    return {name: {k: statistics.median(m[k] for m in rows) for k in rows[0]} for name, rows in measured.items()}


def report() -> str:
    """The suite's tables (summary, the second model size's, then one per task), from the result files."""
    work_path = RESULTS / "work.json"
    work = json.loads(work_path.read_text()) if work_path.exists() else {}
    timing_path = RESULTS / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    results = {task: by_config(load(task)) for task in SUITE}
    results = {task: runs for task, runs in results.items() if runs}
    parts = ["### Summary: the default recipe against verl at its best and the exact-value ceiling", ""]
    parts += [summary_table(results, work), "", "The default until 2026-12-05 (running statistics, no replay):", ""]
    parts += [summary_table(results, work, ours=RUNNING_DEFAULT)]
    parts += ["", "### What bounds it: iterations to EV 0.95 as multiples of the exact-value ceiling", ""]
    parts += [bounds_table(results)]
    parts += ["", f"### The second model size (hidden 128 × 4 layers, `{LARGER}`)", ""]
    parts += [f"With the default until 2026-12-05 (`{RUNNING_DEFAULT}`):", ""]
    parts += [summary_table(results, work, LARGER[1:], ours=RUNNING_DEFAULT)]
    for task, runs in results.items():
        s = SUITE[task]
        title = f"### {task}: {s.stresses} ({s.steps} iterations, EV every {s.eval_every}; `{' '.join(s.overrides)}`)"
        parts += ["", title, "", task_table(task, runs, timing.get(task, {}))]
    return "\n".join(parts)


def write_report(text: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace a block of docs/QUALITY.md (between its markers; by default the suite tables) with `text`."""
    doc = QUALITY.read_text()
    block = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not block.search(doc):
        raise SystemExit(f"{QUALITY} has no block between {begin!r} and {end!r}")
    write_file(QUALITY, block.sub(lambda _: f"{begin}\n{text}\n{end}", doc))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="*", default=list(SUITE), help=f"tasks to run, from {list(SUITE)}")
    p.add_argument("--only", nargs="*", default=list(CONFIGS), help=f"configurations to run, from {list(CONFIGS)}")
    p.add_argument("--seeds", nargs="*", type=int, default=list(SEEDS))
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--timing", action="store_true", help="only time every configuration on every task (side by side)")
    p.add_argument("--timing-steps", type=int, default=20)
    p.add_argument("--timing-rounds", type=int, default=2)
    p.add_argument("--work", action="store_true", help="only profile every configuration's operator time per iteration")
    p.add_argument("--report", action="store_true", help="rewrite docs/QUALITY.md's suite tables from the results")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for kind, given, known in (("tasks", args.tasks, SUITE), ("configurations", args.only, CONFIGS)):
        if unknown := sorted(set(given) - set(known)):
            p.error(f"unknown {kind} {unknown}; known: {list(known)}")
    if args.report:
        text = report()
        write_report(text)
        print(text)
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.timing or args.work:
        path = RESULTS / ("work.json" if args.work else "timing.json")
        measure = work_rounds if args.work else timing_rounds
        for task in args.tasks:
            measured = measure(task, args.only, args.timing_steps, args.timing_rounds)
            timing = json.loads(path.read_text()) if path.exists() else {}  # read late: another process's tasks
            timing[task] = measured
            write_file(path, json.dumps(timing, indent=1))
            print(task, json.dumps(timing[task]), flush=True)
        return
    meta = {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads()}
    for seed in args.seeds:  # seed-major: a partial ablation still compares configurations on the same seeds
        for task in args.tasks:
            s = SUITE[task]
            for name in args.only:
                if any(r["config"] == name and r["seed"] == seed for r in load(task)):
                    continue
                run = run_one(name, overrides_of(name, task), seed, s.steps, s.eval_every)
                run |= {"task": task, "steps_budget": s.steps, "overrides": overrides_of(name, task)}
                append(task, run, meta)
                print(
                    f"{task} {name} seed={seed}: to 0.95 {first_reach(run['curve'], 0.95)} best {run['best_ev']:.3f} "
                    f"final {run['final_ev']:.3f} train_s {run['train_s']:.0f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
