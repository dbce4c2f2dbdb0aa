"""Critic-quality ablation on the built-in counting task: each option against the plain (verl-like) critic.

Every configuration trains the same model on the same rollout stream (per seed) for the same number of steps and
is judged on the held-out set every `--eval-every` steps by `eval/ev_true` (explained variance against the true
values). Reported per configuration: steps and training wall time (evaluation excluded) until `eval/ev_true`
first reaches `--target`, and the best `eval/ev_true` within the budget — median over seeds, with every seed's
numbers in the JSON.

    python bench/ablation.py                                  # all configurations, seeds 0 1 2, 200 steps
    python bench/ablation.py --only plain new_default --seeds 0 1 2 3 4
    python bench/ablation.py --only plain --extra critic.optim.lr=1e-3   # explore one change

Runs are in-process and sequential (one configuration at a time, so wall times compare); results are appended
to `--out` (JSON) after every run, and the markdown table is rewritten from all results so far.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from ppo_critic.cli import load_config
from ppo_critic.files import write_file
from ppo_critic.tasks import CountingTask
from ppo_critic.train import TrainConfig, train
from ppo_critic.train_config import DEFAULT_MODEL

# verl's critic defaults (verl/trainer/config/critic/critic.yaml and dp_critic.yaml) wherever they apply to this
# task: one PPO epoch, value clipping at 0.5 around the old values, AdamW with weight decay 0.01 and a constant
# rate without warmup, grad clip 1.0, token-mean, no shuffling, a token-classification head with transformers'
# default init, values from the live weights (every key is pinned: `ppo-critic train`'s own defaults differ).
# `verl_literal` also takes verl's rate 1e-5 and verl's GAE lam 1.0 (algorithm.lam); `plain` and its variants take
# lam 0.95 and the rates of a sweep, since 1e-5 is meant for fine-tuning a pretrained LLM and this model starts
# random: the stricter baseline.
PLAIN = [
    "trainer.rollout_batch_size=192",
    "trainer.lam=0.95",
    "trainer.critic_warmup_steps=0",
    "critic.ppo_mini_batch_size=96",
    "critic.ppo_micro_batch_size_per_gpu=null",  # one micro-batch per mini-batch (96 rows in one process)
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
    "critic.optim.weight_decay=0.01",
    "critic.optim.warmup_style=constant",
    "critic.optim.lr_warmup_steps=-1",
    "critic.optim.min_lr_ratio=null",
]

COSINE = [  # the schedule `ppo-critic train` used before this ablation
    "critic.optim.lr=3e-3",
    "critic.optim.weight_decay=0.0",
    "critic.optim.warmup_style=cosine",
    "critic.optim.lr_warmup_steps=10",
    "critic.optim.min_lr_ratio=0.1",
]
PREVIOUS_DEFAULTS = [
    *PLAIN,
    "critic.ppo_epochs=2",
    "critic.cliprange_value=null",
    "critic.model.value_head_init=zero",
    *COSINE,
]
NORM_WARMUP = [  # the candidate defaults before critic.ema_decay existed
    *PLAIN,
    "critic.value_norm=running",
    "critic.model.value_head_init=zero",
    "critic.cliprange_value=null",
    *COSINE,
    "trainer.lam=0.5",
    "trainer.critic_warmup_steps=50",
]
NEW_DEFAULT = [*PLAIN, "trainer.lam=0.5", "critic.ema_decay=0.9"]  # the defaults of `ppo-critic train`

REWARD_MODEL = "{reward_model}"  # replaced by the directory of the seed's reward model (see `reward_model`)


CONFIGS: dict[str, tuple[str, list[str]]] = {
    "verl_literal": (
        "verl's defaults verbatim (lr 1e-5, GAE lam 1.0)",
        [*PLAIN, "critic.optim.lr=1e-5", "trainer.lam=1.0"],
    ),
    "plain_lr1e-4": ("plain with lr 1e-4 (lr sweep)", [*PLAIN, "critic.optim.lr=1e-4"]),
    "plain_lr3e-4": ("plain with lr 3e-4 (lr sweep)", [*PLAIN, "critic.optim.lr=3e-4"]),
    "plain": ("verl's defaults, lr 1e-3 (best of the sweep)", PLAIN),
    "plain_lr3e-3": ("plain with lr 3e-3 (lr sweep)", [*PLAIN, "critic.optim.lr=3e-3"]),
    "previous_defaults": (
        "`ppo-critic train` before: 2 epochs, no clipping, zero head, lr 3e-3 cosine",
        PREVIOUS_DEFAULTS,
    ),
    "running": ("plain + value_norm=running", [*PLAIN, "critic.value_norm=running"]),
    "popart": ("plain + value_norm=popart", [*PLAIN, "critic.value_norm=popart"]),
    "huber": (
        "plain + vf_loss_type=huber, huber_delta=0.25",
        [*PLAIN, "critic.vf_loss_type=huber", "critic.huber_delta=0.25"],
    ),
    "no_clip": ("plain + cliprange_value=null", [*PLAIN, "critic.cliprange_value=null"]),
    "zero_head": ("plain + value_head_init=zero", [*PLAIN, "critic.model.value_head_init=zero"]),
    "epochs2_shuffle": (
        "plain + ppo_epochs=2, shuffle",
        [*PLAIN, "critic.ppo_epochs=2", "critic.shuffle=true", "critic.data_loader_seed=0"],
    ),
    "cosine": ("plain + lr 3e-3, warmup 10, cosine to 0.1, no weight decay", [*PLAIN, *COSINE]),
    "lam05": ("plain + trainer.lam=0.5", [*PLAIN, "trainer.lam=0.5"]),
    "lam05_cosine": ("plain + trainer.lam=0.5 + the cosine schedule above", [*PLAIN, "trainer.lam=0.5", *COSINE]),
    "critic_warmup": (
        "plain + lam 0.5 after trainer.critic_warmup_steps=50 (Monte-Carlo returns first)",
        [*PLAIN, "trainer.lam=0.5", "trainer.critic_warmup_steps=50"],
    ),
    "from_reward_model": (
        "plain + backbone and head from a reward model of the task (200 steps of outcome regression)",
        [*PLAIN, f"critic.model.value_head_init=from_reward_model:{REWARD_MODEL}"],
    ),
    "from_reward_model_ema95": (
        "from_reward_model + critic.ema_decay=0.95",
        [*PLAIN, f"critic.model.value_head_init=from_reward_model:{REWARD_MODEL}", "critic.ema_decay=0.95"],
    ),
    "lora": ("plain + LoRA rank 8 (alpha 16), lr 3e-3", [*PLAIN, "critic.model.lora_rank=8", "critic.optim.lr=3e-3"]),
    "ema": ("plain + critic.ema_decay=0.9 (values from an average of the weights)", [*PLAIN, "critic.ema_decay=0.9"]),
    "new_default": ("the defaults of `ppo-critic train`: plain + lam 0.5 + critic.ema_decay=0.9", NEW_DEFAULT),
    "lam05_ema95": ("new_default with critic.ema_decay=0.95", [*NEW_DEFAULT, "critic.ema_decay=0.95"]),
    "lam05_ema_lr3e-3": ("new_default with lr 3e-3", [*NEW_DEFAULT, "critic.optim.lr=3e-3"]),
    "lam05_cosine_ema": (
        "lam05_cosine + critic.ema_decay=0.9",
        [*PLAIN, "trainer.lam=0.5", *COSINE, "critic.ema_decay=0.9"],
    ),
    "lam05_cosine_ema95": (
        "lam05_cosine + critic.ema_decay=0.95",
        [*PLAIN, "trainer.lam=0.5", *COSINE, "critic.ema_decay=0.95"],
    ),
    "lam05_cosine_ema95_no_clip": (
        "lam05_cosine_ema95 + cliprange_value=null",
        [*PLAIN, "trainer.lam=0.5", *COSINE, "critic.ema_decay=0.95", "critic.cliprange_value=null"],
    ),
    "norm_warmup": (
        "running value_norm, zero head, no clipping, lr 3e-3 cosine, lam 0.5 after 50 Monte-Carlo warmup steps",
        NORM_WARMUP,
    ),
    "norm_warmup_ema": ("norm_warmup + critic.ema_decay=0.9", [*NORM_WARMUP, "critic.ema_decay=0.9"]),
    "norm_no_warmup": ("norm_warmup without the critic warmup", [*NORM_WARMUP, "trainer.critic_warmup_steps=0"]),
}


def reward_model(seed: int, steps: int, out_dir: Path) -> Path:
    """A reward model of the counting task, for `value_head_init=from_reward_model:`: the critic's architecture as
    `Qwen2ForSequenceClassification(num_labels=1)`, regressed (MSE, AdamW lr 1e-3, batches of 192) onto the
    outcome reward of whole rollouts for `steps` steps, on its own rollout stream (seed + 7919). Its training time
    is not counted in the critic's: in practice the reward model exists before the critic is trained."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = out_dir / f"reward_model_seed{seed}_steps{steps}"
    if (path / "config.json").is_file():
        return path
    task = CountingTask(TrainConfig().task_config())
    fields = {**DEFAULT_MODEL, "vocab_size": task.vocab_size, "num_labels": 1, "pad_token_id": task.pad_token_id}
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(seed + 7919)
    for _ in range(steps):
        batch = task.sample(192, generator)
        score = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits.squeeze(-1)
        loss = ((score - batch["token_level_rewards"].sum(-1)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    return path


def run_one(name: str, overrides: list[str], seed: int, steps: int, eval_every: int, target: float) -> dict:
    """Train one configuration for one seed; the EV curve (step, EV, training seconds so far), steps and training
    seconds to `target`, best and final EV."""
    curve: list[tuple[int, float, float]] = []

    def on_step(step: int, metrics: dict[str, float], train_s: float) -> None:
        if "eval/ev_true" in metrics:
            curve.append((step, metrics["eval/ev_true"], train_s))

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
            ],
        )
        train(cfg, out=io.StringIO(), on_step=on_step)
    hit = next(((s, t) for s, ev, t in curve if ev >= target), (None, None))
    return {
        "config": name,
        "seed": seed,
        "steps_to_target": hit[0],
        "seconds_to_target": hit[1],
        "best_ev": max(ev for _, ev, _ in curve),
        "final_ev": curve[-1][1],
        "train_s": curve[-1][2],
        "curve": curve,
    }


def seconds_per_step(names: list[str], overrides: dict[str, list[str]], steps: int, rounds: int) -> dict[str, float]:
    """Training seconds per step of each configuration, measured side by side: `rounds` rounds, each running every
    configuration for `steps` steps in turn (so machine load hits all alike); the median over rounds."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            run = run_one(name, overrides[name], seed=0, steps=steps, eval_every=steps, target=1.0)
            times[name].append(run["train_s"] / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def _median(xs: list[float | None]) -> float | None:
    """Median (the lower one for an even count) where a run that never reached the target counts as infinitely
    slow; None when the median run did not reach it."""
    ranked = sorted(xs, key=lambda x: float("inf") if x is None else x)
    return ranked[(len(ranked) - 1) // 2]


def first_reach(curve: list[list[float]], target: float) -> tuple[int | None, float | None]:
    """(step, training seconds) of the first evaluation with EV >= `target`, or (None, None)."""
    return next(((int(s), t) for s, ev, t in curve if ev >= target), (None, None))


def table(results: list[dict], targets: tuple[float, ...], timing: dict[str, float] | None = None) -> str:
    """Markdown: one row per configuration; per target the median steps (a run that never reached it counts as
    slower than any that did; "—" when most did not) with every seed's steps, and the seconds to get there: steps ×
    seconds per step (from the side-by-side `timing` when given, else the runs' own median); then best and final
    EV (median over seeds) and the seconds per step."""
    timing = timing or {}
    head = "| configuration | seeds |"
    for target in targets:
        head += f" steps to EV {target} (median; per seed) | s to EV {target} |"
    lines = [
        head + " best EV (median; min) | final EV (median) | s / step |",
        "|---|---|" + "---|---|" * len(targets) + "---|---|---|",
    ]
    for name in dict.fromkeys(r["config"] for r in results):
        rows = [r for r in results if r["config"] == name]
        base = rows[0].get("base", name)
        per_step = timing.get(base, statistics.median(r["train_s"] / r["curve"][-1][0] for r in rows))
        line = f"| {name} | {len(rows)} |"
        for target in targets:
            hits = [first_reach(r["curve"], target)[0] for r in rows]
            steps = _median(hits)
            per_seed = ", ".join("—" if h is None else str(h) for h in hits)
            secs = "—" if steps is None else f"{steps * per_step:.0f}"
            line += f" {'—' if steps is None else steps} ({per_seed}) | {secs} |"
        lines.append(
            line + f" {statistics.median(r['best_ev'] for r in rows):.3f} ({min(r['best_ev'] for r in rows):.3f}) |"
            f" {statistics.median(r['final_ev'] for r in rows):.3f} | {per_step:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", default=list(CONFIGS), help=f"configurations to run, from {list(CONFIGS)}")
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200, help="step budget of every run")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--target", type=float, default=0.95, help="the eval/ev_true to reach")
    p.add_argument("--table-targets", type=float, nargs="*", default=[0.9, 0.95], help="EV targets in the table")
    p.add_argument("--extra", nargs="*", default=[], help="overrides added to every configuration (exploration)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--out", default="ablation.json", help="results (JSON); the table goes beside it as .md")
    p.add_argument("--reward-model-steps", type=int, default=200, help="training steps of the reward model")
    p.add_argument("--label", default=None, help="the name results are stored under (default: the configuration's)")
    p.add_argument("--report", nargs="*", default=None, help="only merge these result files into --out's table")
    p.add_argument("--timing-steps", type=int, default=0, help="only time each configuration (steps per round)")
    p.add_argument("--timing-rounds", type=int, default=3)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    unknown = sorted(set(args.only) - set(CONFIGS))
    if unknown:
        p.error(f"unknown configurations {unknown}; known: {list(CONFIGS)}")
    out = Path(args.out)
    targets = tuple(args.table_targets)
    if args.report is not None:
        files = [json.loads(Path(f).read_text()) for f in args.report]
        order = list(CONFIGS)
        merged = [r for f in files for r in f.get("results", [])]
        merged.sort(key=lambda r: order.index(r["config"]) if r["config"] in order else len(order))
        timing = {k: v for f in files for k, v in f.get("timing", {}).items()}
        write_file(out, json.dumps({"results": merged, "timing": timing, "configs": CONFIGS}, indent=1))
        write_file(out.with_suffix(".md"), table(merged, targets, timing) + "\n")
        print(table(merged, targets, timing))
        return
    if args.timing_steps:
        overrides = {name: _with_reward_model(name, 0, args, out) for name in args.only}
        timing = seconds_per_step(args.only, overrides, args.timing_steps, args.timing_rounds)
        write_file(out, json.dumps({"timing": timing, "timing_steps": args.timing_steps}, indent=1))
        print(json.dumps(timing, indent=1))
        return
    results = json.loads(out.read_text())["results"] if out.exists() else []
    for seed in args.seeds:  # seed-major: a partial run still compares configurations on the same seeds
        for name in args.only:
            overrides = _with_reward_model(name, seed, args, out)
            result = run_one(name, overrides, seed, args.steps, args.eval_every, args.target)
            result["extra"] = args.extra
            result["config"], result["base"] = args.label or name, name
            result["steps_budget"] = args.steps
            results.append(result)
            meta = {
                "steps": args.steps,
                "eval_every": args.eval_every,
                "target": args.target,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "threads": torch.get_num_threads(),
            }
            write_file(out, json.dumps({"meta": meta, "configs": CONFIGS, "results": results}, indent=1))
            write_file(out.with_suffix(".md"), table(results, tuple(args.table_targets)) + "\n")
            print(
                f"{name} seed={seed}: steps to {args.target}={result['steps_to_target']} "
                f"best={result['best_ev']:.3f} final={result['final_ev']:.3f} train_s={result['train_s']:.0f}",
                flush=True,
            )
    print(table(results, tuple(args.table_targets)))


def _with_reward_model(name: str, seed: int, args: argparse.Namespace, out: Path) -> list[str]:
    """The configuration's overrides (+ `--extra`), with the seed's reward model where it needs one."""
    overrides = [*CONFIGS[name][1], *args.extra]
    if any(REWARD_MODEL in o for o in overrides):
        path = reward_model(seed, args.reward_model_steps, out.parent)
        overrides = [o.replace(REWARD_MODEL, str(path)) for o in overrides]
    return overrides


if __name__ == "__main__":
    main()
