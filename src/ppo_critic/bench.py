"""`ppo-critic bench`: throughput of `compute_values` and `update_critic` for several critic paths side by side,
on one seeded rollout distribution, against the plain padded HF baseline measured in the same run.

Paths: `padded` (HF model, padded batches: the baseline), `packed` (remove padding), `megatron` (TP=1/PP=1;
CUDA, or CPU with the test-only redirect of bench/megatron_vs_dp.py), and verl 0.7's own critic, `verl` and
`verl_packed` (its use_remove_padding; `ppo_critic.integrations.verl_bench`), each optionally with levers appended:
`+dyn` (token-budget micro-batches of `budget` tokens instead of `micro` rows), `+fused` (fused AdamW), `+compile`
(`torch.compile` per decoder layer), e.g. `packed+dyn+fused`. Each path is a worker built from the same
config and seed (same weights); rounds alternate the paths so machine noise hits all alike; the report holds
median valid tokens/s, MFU (matmul + attention FLOPs over the measured matmul peak of the compute dtype) and
peak memory (CUDA: the peak above what was allocated before the calls, i.e. activations and gradients, since all
paths stay resident; CPU: the process's peak RSS), the ratio of each path to the baseline and, when verl paths
run, to the fastest verl path of each call (`x verl`). `profile=true`
adds the top operators of one `update_critic` per path (torch.profiler; device time on CUDA).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
from typing import Any

import torch
from torch import Tensor

from ppo_critic.bench_config import VERL_PATHS, BenchConfig, parse_options
from ppo_critic.files import write_file
from ppo_critic.parallel.mesh import resolve_device
from ppo_critic.perf import peak_memory_gb


def rollouts(batch: int, prompt: int, response: int, fill: float, vocab: int, seed: int) -> dict[str, Tensor]:
    """Random rollouts whose valid lengths are uniform around `fill` of the padded widths (seeded)."""
    g = torch.Generator().manual_seed(seed)
    t = prompt + response
    p_len, r_len = (torch.randint(*_length_range(width, fill), (batch,), generator=g) for width in (prompt, response))
    pos = torch.arange(t)
    mask = ((pos >= prompt - p_len[:, None]) & (pos < prompt + r_len[:, None])).long()
    ids = torch.randint(0, vocab, (batch, t), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, prompt:],
        "response_mask": mask[:, prompt:],
        "values": torch.randn(batch, response, generator=g) * 0.1,
        "returns": torch.randn(batch, response, generator=g),
    }


def _length_range(width: int, fill: float) -> tuple[int, int]:
    """`randint` bounds of lengths in [1, width] whose mean is about `fill` × width: the top of the range for
    fill > 0.5, the bottom for fill ≤ 0.5."""
    if fill > 0.5:
        return max(1, int(width * (2 * fill - 1))), width + 1
    return 1, max(1, round(2 * fill * width)) + 1


def make_worker(cfg: BenchConfig, path: str) -> Any:
    """The worker of one path, from one config and seed (so every path holds the same weights)."""
    from ppo_critic.worker import CriticWorker, MegatronCriticWorker

    base, *levers = path.split("+")
    if base in VERL_PATHS:
        from ppo_critic.integrations.verl_bench import VerlBenchPath

        ours = make_worker(cfg, "padded")  # the same weights and optimizer settings as every other path
        return VerlBenchPath(
            ours.model,
            ours.optimizer,
            mini_batch=cfg.batch,
            micro=cfg.micro,
            budget=cfg.budget,
            dynamic="dyn" in levers,
            packed=base == "verl_packed",
            dtype=getattr(torch, cfg.dtype),
        )
    model = {
        "override_config": {
            "model_type": "qwen2",
            "hidden_size": cfg.hidden,
            "intermediate_size": cfg.intermediate,
            "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads,
            "num_key_value_heads": cfg.kv_heads,
            "vocab_size": cfg.vocab,
            "max_position_embeddings": cfg.prompt + cfg.response,
        },
        "use_remove_padding": base == "packed",
        "use_torch_compile": "compile" in levers,
    }
    critic = {
        "strategy": "megatron" if base == "megatron" else "none",
        "ppo_mini_batch_size": cfg.batch,
        "ppo_micro_batch_size_per_gpu": cfg.micro,
        "use_dynamic_bsz": "dyn" in levers,
        "ppo_max_token_len_per_gpu": cfg.budget,
        "dtype": cfg.dtype,
        "model": model,
        "optim": {"lr": 1e-6, "fused": True if "fused" in levers else None},
    }
    cls = MegatronCriticWorker if base == "megatron" else CriticWorker
    return cls(critic, device=cfg.device, seed=cfg.seed)


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Measure every path; returns the summary that `main` prints and writes."""
    cfg = cfg.resolved()
    device = resolve_device(cfg.device)
    workers = {path: make_worker(cfg, path) for path in cfg.path_list()}
    batch = rollouts(cfg.batch, cfg.prompt, cfg.response, cfg.fill, cfg.vocab, cfg.seed)
    valid = int(batch["attention_mask"].sum())
    keys = ("compute_values", "update_critic", "compute_values_mfu", "update_critic_mfu", "peak_gb")
    runs: dict[str, dict[str, list[float]]] = {p: {k: [] for k in keys} for p in workers}
    for repeat in range(cfg.repeats + 1):  # the first round warms up and is not counted
        for path, worker in workers.items():
            held = 0.0
            if device.type == "cuda":  # every path's weights and optimizer state stay resident: count the increment
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                held = torch.cuda.memory_allocated(device) / 2**30
            forward = _timed(lambda w=worker: w.compute_values(batch), device)
            compute_mfu = getattr(worker.critic, "last_compute_metrics", {}).get("perf/compute_values_mfu", 0.0)
            metrics: dict[str, float] = {}
            update = _timed(lambda w=worker, m=metrics: m.update(w.update_critic(batch)), device)
            if repeat:
                row = runs[path]
                row["compute_values"].append(valid / forward)
                row["update_critic"].append(valid / update)
                row["compute_values_mfu"].append(compute_mfu)
                row["update_critic_mfu"].append(metrics.get("perf/mfu", 0.0))
                row["peak_gb"].append(peak_memory_gb(device) - held)
    profiles = {path: profile(worker, batch, device) for path, worker in workers.items()} if cfg.profile else {}
    medians = {p: {k: statistics.median(v) for k, v in r.items()} for p, r in runs.items()}
    calls = ("compute_values", "update_critic")
    base = medians.get("padded")
    ratios = {p: {k: m[k] / base[k] for k in calls} for p, m in medians.items() if base}
    verl = [m for p, m in medians.items() if p.split("+")[0] in VERL_PATHS]
    best_verl = {k: max(m[k] for m in verl) for k in calls} if verl else None
    vs_verl = {p: {k: m[k] / best_verl[k] for k in calls} for p, m in medians.items() if best_verl}
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "config": dataclasses.asdict(cfg),
        "valid_tokens": valid,
        "fill": valid / batch["attention_mask"].numel(),
        "median": medians,
        "vs_padded": ratios,
        "vs_verl": vs_verl,
        "runs": runs,
        "profile": profiles,
    }


def profile(worker: Any, batch: dict[str, Tensor], device: torch.device, top: int = 12) -> list[dict[str, Any]]:
    """The operators taking the most time in one `update_critic` (self time: device time on CUDA, else CPU)."""
    from torch.profiler import ProfilerActivity

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch.profiler.profile(activities=activities) as prof:
        worker.update_critic(batch)
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) or 1.0
    return [
        {"op": e.key, "ms": getattr(e, key) / 1e3, "share": getattr(e, key) / total, "calls": e.count}
        for e in events[:top]
    ]


def report(summary: dict[str, Any]) -> str:
    """The table `ppo-critic bench` prints."""
    cfg = summary["config"]
    vs_verl = summary.get("vs_verl") or {}
    ratio_columns = {"x padded": summary["vs_padded"], **({"x verl": vs_verl} if vs_verl else {})}
    head = "".join(f" {f'{call} {name}':>16}" for name in ratio_columns for call in ("values", "update"))
    width = max(18, *(len(p) for p in summary["median"]))
    lines = [
        f"{summary['device']}, torch {summary['torch']}, {cfg['dtype']}; {cfg['layers']} layers x {cfg['hidden']}, "
        f"{cfg['batch']} x ({cfg['prompt']} + {cfg['response']}), fill {summary['fill']:.2f}, "
        f"{summary['valid_tokens']} valid tokens",
        "values = compute_values, update = update_critic; tok/s counts valid tokens; x padded = tok/s / padded's"
        + ("; x verl = tok/s / the fastest verl path's" if vs_verl else ""),
        f"{'path':{width}} {'values tok/s':>13} {'update tok/s':>13} {'values MFU':>11} {'update MFU':>11} "
        f"{'peak GiB':>9}{head}",
    ]
    for path, m in summary["median"].items():
        verl = path.split("+")[0] in VERL_PATHS  # verl reports no FLOPs
        mfu = ("-", "-") if verl else (f"{m['compute_values_mfu']:.3f}", f"{m['update_critic_mfu']:.3f}")
        ratios = "".join(
            f" {f'{ratios[path][call]:.2f}x' if path in ratios else '-':>16}"
            for ratios in ratio_columns.values()
            for call in ("compute_values", "update_critic")
        )
        lines.append(
            f"{path:{width}} {m['compute_values']:>13.0f} {m['update_critic']:>13.0f} {mfu[0]:>11} {mfu[1]:>11} "
            f"{m['peak_gb']:>9.2f}{ratios}"
        )
    if vs_verl and len(vs_verl) > sum(p.split("+")[0] in VERL_PATHS for p in vs_verl):
        best = {
            call: max((p for p in vs_verl if p.split("+")[0] not in VERL_PATHS), key=lambda p, c=call: vs_verl[p][c])
            for call in ("compute_values", "update_critic")
        }
        lines.append(
            "ppo-critic's fastest / verl's fastest: "
            + ", ".join(f"{call} {vs_verl[p][call]:.2f}x ({p})" for call, p in best.items())
        )
    for path, ops in summary.get("profile", {}).items():
        top = "; ".join(f"{o['op']} {o['share']:.0%}" for o in ops[:5])
        lines.append(f"top operators of one update, {path}: {top}")
    return "\n".join(lines)


def main(overrides: list[str]) -> dict[str, Any]:
    """Parse `key=value` options, run, print the table (and write JSON to `out`)."""
    return run_and_report(parse_options(overrides))


def run_and_report(cfg: BenchConfig) -> dict[str, Any]:
    """Run `cfg`, print the table (and write JSON to `out`)."""
    summary = run(cfg)
    print(report(summary))
    if cfg.out:
        write_file(cfg.out, json.dumps(summary, indent=1))
    return summary


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start
