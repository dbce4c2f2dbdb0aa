"""The CPU grid of the performance issue: in every cell ppo-critic's fastest path against verl 0.7.1's fastest,
measured side by side in one `ppo-critic bench` run (same weights, batch and micro-batching; rounds alternate).

Cells: padded width {short 32, medium 384, long 2048} × fill {0.3, 0.5, 0.9} × {fixed micro-batches, dynamic
token budget} × {float32, bfloat16 autocast}. Each cell runs ours (padded, packed) and verl's (verl, verl_packed),
with `+dyn` in the dynamic cells, then profiles one update of ours-best and verl-best and splits its time into
matmuls, attention, the optimizer, other operators, and what no operator accounts for (Python and framework
overhead). One JSON per cell in bench/results/cpu_grid/ (a finished cell is not rerun); the table is printed
from them. verl must be importable: run it in the environment `bash tests/with_verl/run.sh 0.7.1` builds.

    OMP_NUM_THREADS=1 .venv-verl-0.7.1/bin/python bench/cpu_grid.py --shard 0/2 &   # one process per core
    OMP_NUM_THREADS=1 .venv-verl-0.7.1/bin/python bench/cpu_grid.py --shard 1/2
    .venv-verl-0.7.1/bin/python bench/cpu_grid.py --table                          # the markdown table
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from ppo_critic.config.bench import VERL_PATHS, BenchConfig
from ppo_critic.run.files import write_file
from ppo_critic.throughput import make_worker, resolved, rollouts, run

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_grid"
# fp32: the CPU bench model; padded width -> prompt, response, rollouts, rows per fixed micro-batch (~8k padded
# tokens per call). bf16: this machine has no bf16 matmul instructions (AVX2 only): a bf16 matmul runs ~50x
# slower than fp32 here, so its cells use a model of 1/8 the matmul work and 1/4 of the tokens
MODEL = {
    "float32": {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "vocab": 1024},
    "bfloat16": {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "vocab": 1024},
}
LENGTHS = {
    "float32": {"short": (8, 24, 256, 32), "medium": (128, 256, 24, 4), "long": (512, 1536, 4, 2)},
    "bfloat16": {"short": (8, 24, 64, 8), "medium": (128, 256, 8, 2), "long": (512, 1536, 2, 1)},
}
FILLS = (0.3, 0.5, 0.9)
BATCHING = {"fixed": "", "dynamic": "+dyn"}
DTYPES = ("float32", "bfloat16")
CATEGORIES = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
    "attention": ("scaled_dot_product", "flash_attention", "_efficient_attention", "aten::softmax", "_softmax"),
    "optimizer": ("adam", "_foreach", "Optimizer"),
}


def cells() -> list[tuple[str, float, str, str]]:
    """(width, fill, batching, dtype) in table order."""
    return [(w, f, b, d) for d, w, f, b in itertools.product(DTYPES, LENGTHS["float32"], FILLS, BATCHING)]


def cell_name(length: str, fill: float, batching: str, dtype: str) -> str:
    return f"{length}_fill{fill}_{batching}_{dtype}"


def measure(length: str, fill: float, batching: str, dtype: str, repeats: int) -> dict:
    prompt, response, batch, micro = LENGTHS[dtype][length]
    lever = BATCHING[batching]
    paths = ",".join(p + lever for p in ("padded", "packed", *VERL_PATHS))
    cfg = BenchConfig(
        paths=paths, **MODEL[dtype], prompt=prompt, response=response, batch=batch, micro=micro, fill=fill, dtype=dtype
    )
    summary = run(BenchConfig(**{**cfg.__dict__, "repeats": repeats}))
    update = {p: m["update_critic"] for p, m in summary["median"].items()}
    ours = max((p for p in update if p.split("+")[0] not in VERL_PATHS), key=update.get)
    verl = max((p for p in update if p.split("+")[0] in VERL_PATHS), key=update.get)
    options = resolved(cfg)
    data = rollouts(options.batch, options.prompt, options.response, fill, options.vocab, options.seed)
    summary["bounds"] = {p: bounds(make_worker(options, p), data) for p in (ours, verl)}
    return summary


def bounds(worker, batch) -> dict[str, float]:
    """Shares of one `update_critic`'s wall time: operator self time by category, and the rest (no operator)."""
    worker.update_critic(batch)  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter_ns()
        worker.update_critic(batch)
        wall = time.perf_counter_ns() - start
    totals = dict.fromkeys([*CATEGORIES, "other ops"], 0.0)
    for event in prof.key_averages():
        kind = next((k for k, keys in CATEGORIES.items() if any(key in event.key for key in keys)), "other ops")
        totals[kind] += event.self_cpu_time_total * 1e3  # us -> ns
    shares = {k: v / wall for k, v in totals.items()}
    shares["no operator"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def table() -> str:
    """Markdown, a row per finished cell. MFU counts the useful FLOPs (valid tokens, each sequence attending to
    itself), the same for every path, so verl's MFU is ours × its speed / ours; the ceiling, 1 / verl-best's update
    MFU, is the largest update ratio anything doing those FLOPs at the measured matmul peak could reach."""
    rows = [
        "| width | fill | batching | dtype | rollouts, per micro-batch | update: ours / verl (best of each) | values: "
        "ours / verl | update MFU: ours / verl | ceiling | ours-best, verl-best (update) | what bounds ours / verl "
        "(share of one update) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells():
        path = RESULTS / f"{cell_name(*cell)}.json"
        if not path.exists():
            continue
        s = json.loads(path.read_text())
        best = {}
        for call in ("update_critic", "compute_values"):
            ours = max(m[call] for p, m in s["median"].items() if p.split("+")[0] not in VERL_PATHS)
            verl = max(m[call] for p, m in s["median"].items() if p.split("+")[0] in VERL_PATHS)
            best[call] = ours / verl
        winners = list(s["bounds"])
        bound = " / ".join(_top(s["bounds"][p]) for p in winners)
        ours_mfu = s["median"][winners[0]]["update_critic_mfu"]
        verl_mfu = ours_mfu / best["update_critic"]
        length, fill, batching, dtype = cell
        c = s["config"]
        per_micro = f"{c['budget']} tokens" if batching == "dynamic" else f"{c['micro']} rows"
        size = f"{c['batch']} × ({c['prompt']} + {c['response']}), {per_micro}"
        rows.append(
            f"| {length} | {fill} (measured {s['fill']:.2f}) | {batching} | {dtype} | {size} "
            f"| **{best['update_critic']:.2f}×** | {best['compute_values']:.2f}× | {ours_mfu:.2f} / {verl_mfu:.2f} "
            f"| {1 / verl_mfu:.1f}× | {', '.join(winners)} | {bound} |"
        )
    return "\n".join(rows)


def _top(shares: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th cell starting at i")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", default=None, help="run the cells whose name contains this text")
    parser.add_argument("--table", action="store_true", help="print the table of the finished cells")
    args = parser.parse_args()
    if args.table:
        print(table())
        return
    index, count = (int(x) for x in args.shard.split("/"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    for cell in cells()[index::count]:
        name = cell_name(*cell)
        out = RESULTS / f"{name}.json"
        if out.exists() or (args.only and args.only not in name):
            continue
        summary = measure(*cell, repeats=args.repeats)
        write_file(out, json.dumps(summary, indent=1))
        print(f"{name}: {_top(summary['bounds'][next(iter(summary['bounds']))])}", flush=True)


if __name__ == "__main__":
    main()
