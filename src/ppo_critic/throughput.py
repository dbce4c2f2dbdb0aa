"""`ppo-critic bench`: throughput of `compute_values` and `update_critic` for several critic paths side by side,
on one seeded rollout distribution, against the plain padded HF baseline measured in the same run.

Paths: `padded` (HF model, padded batches: the baseline), `packed` (remove padding), `megatron` (TP=1/PP=1;
CUDA, or CPU with the test-only redirect of bench/megatron_vs_dp.py), and verl 0.7's own critic, `verl` and
`verl_packed` (its use_remove_padding; `ppo_critic.integrations.verl_bench`), each optionally with levers appended:
`+dyn` (token-budget micro-batches of `budget` tokens instead of `micro` rows), `+fused` (fused AdamW), `+compile`
(`torch.compile` per decoder layer), `+bf16p` (`param_dtype=bfloat16`: bf16 parameters, float32 master weights in the
optimizer), e.g. `packed+dyn+fused`. Each path is a worker built from the same
config and seed (same weights); rounds alternate the paths so machine noise hits all alike; the report holds
median valid tokens/s, MFU (matmul + attention FLOPs over the measured matmul peak of the compute dtype) and
peak memory (CUDA: the peak above what was allocated before the calls, i.e. activations and gradients, since all
paths stay resident; CPU: the process's peak RSS), the ratio of each path to the baseline and, when verl paths
run, to the fastest verl path of each call (`x verl`). `profile=true`
adds the top operators of one `update_critic` per path (torch.profiler; device time on CUDA).

Paths are isolated: one that fails to build or run (an OOM, a missing package, a kernel error) is reported as a row
`error: <one line>` (its traceback goes to stderr) and the others go on. `out` is rewritten after every measured round,
so a run stopped early (bench/gpu/run.sh's time box) leaves the medians of the rounds it finished. `check=true` only
checks the options (bench/gpu/run.sh --dry-run).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ppo_critic.config.bench import VERL_PATHS, BenchConfig, parse_options
from ppo_critic.critics.perf import peak_memory_gb
from ppo_critic.parallel.mesh import resolve_device
from ppo_critic.run.files import write_file


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
    from ppo_critic.worker import CriticWorker

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
        "param_dtype": "bfloat16" if "bf16p" in levers else None,
        "model": model,
        "optim": {"lr": 1e-6, "fused": True if "fused" in levers else None},
    }
    return CriticWorker(critic, device=cfg.device, seed=cfg.seed)


KEYS = ("compute_values", "update_critic", "compute_values_mfu", "update_critic_mfu", "peak_gb")
CALLS = ("compute_values", "update_critic")


def resolved(cfg: BenchConfig) -> BenchConfig:
    """`cfg` with the defaults of the device it names (auto: CUDA where there is one) filled in."""
    return cfg.resolved(cuda=resolve_device(cfg.device).type == "cuda")


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Measure every path, each isolated (a failing one becomes an error row); returns what `main` prints and writes
    (also written to `out` after every measured round)."""
    cfg = resolved(cfg)
    device = resolve_device(cfg.device)
    batch = rollouts(cfg.batch, cfg.prompt, cfg.response, cfg.fill, cfg.vocab, cfg.seed)
    errors: dict[str, str] = {}
    workers = {}
    for path in cfg.path_list():
        worker = _isolated(path, "building", lambda p=path: make_worker(cfg, p), errors)
        if path not in errors:
            workers[path] = _keep_cache(worker)
    runs: dict[str, dict[str, list[float]]] = {p: {k: [] for k in KEYS} for p in workers}
    _write(cfg, _summary(cfg, device, batch, runs, errors, rounds=0))  # the build errors, even if nothing else ends
    for repeat in range(cfg.repeats + 1):  # the first round warms up and is not counted
        for path, worker in list(workers.items()):
            stage = "measuring" if repeat else "warming up"
            sample = _isolated(path, stage, lambda w=worker: _measure(w, batch, device), errors)
            if path in errors:
                del workers[path], runs[path], worker
                gc.collect()
            elif repeat:
                for key, value in sample.items():
                    runs[path][key].append(value)
        _write(cfg, _summary(cfg, device, batch, runs, errors, rounds=repeat))
    profiles, profile_errors = {}, {}
    for path, worker in workers.items() if cfg.profile else ():
        ops = _isolated(path, "profiling", lambda w=worker: profile(w, batch, device), profile_errors)
        if path not in profile_errors:
            profiles[path] = ops
    summary = _summary(cfg, device, batch, runs, errors, rounds=cfg.repeats)
    return summary | {"profile": profiles, "profile_errors": profile_errors}


def _measure(worker: Any, batch: dict[str, Tensor], device: torch.device) -> dict[str, float]:
    """One `compute_values` and one `update_critic` call: valid tokens/s, MFU and peak memory of the two."""
    valid = int(batch["attention_mask"].sum())
    held = 0.0
    if device.type == "cuda":  # every path's weights and optimizer state stay resident: count the increment
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated(device) / 2**30
    forward = _timed(lambda: worker.compute_values(batch), device)
    compute_mfu = getattr(worker.critic, "last_compute_metrics", {}).get("perf/compute_values_mfu", 0.0)
    metrics: dict[str, float] = {}
    update = _timed(lambda: metrics.update(worker.update_critic(batch)), device)
    return {
        "compute_values": valid / forward,
        "update_critic": valid / update,
        "compute_values_mfu": compute_mfu,
        "update_critic_mfu": metrics.get("perf/mfu", 0.0),
        "peak_gb": peak_memory_gb(device) - held,
    }


def _isolated(path: str, stage: str, fn: Callable[[], Any], errors: dict[str, str]) -> Any:
    """`fn()`, or None with `errors[path]` set to one line (the traceback to stderr) when it raises: one path's
    failure (an OOM, a missing package, a kernel error) must not cost the other paths' numbers."""
    try:
        return fn()
    except Exception as err:  # any failure of one path is that path's result
        print(f"ppo-critic bench: path {path} failed while {stage}:", file=sys.stderr)
        traceback.print_exc()
        first = (str(err).strip().splitlines() or [""])[0]
        errors[path] = f"error: {type(err).__name__}: {first[:200]} (while {stage})"
    gc.collect()  # outside the except block: the traceback's frames, and the tensors they hold, are gone
    return None


def _keep_cache(worker: Any) -> Any:
    """`worker` with its critic's release of the CUDA cache after each call turned off (the megatron critic's, as
    verl's): an emptied cache makes the next measured call, of any path, pay fresh cudaMallocs. No path empties it in
    the run; what a failed path held stays cached for the next (the allocator frees its cache itself before an OOM)."""
    critic = getattr(worker, "critic", None)
    if getattr(critic, "release_cache", False):
        critic.release_cache = False
    return worker


def _summary(cfg: BenchConfig, device, batch, runs, errors, rounds: int) -> dict[str, Any]:
    """Medians over the measured rounds, the ratios to the padded baseline and to the fastest verl path."""
    valid = int(batch["attention_mask"].sum())
    medians = {p: {k: statistics.median(v) for k, v in r.items()} for p, r in runs.items() if r["update_critic"]}
    base = medians.get("padded")
    ratios = {p: {k: m[k] / base[k] for k in CALLS} for p, m in medians.items() if base}
    verl = [m for p, m in medians.items() if p.split("+")[0] in VERL_PATHS]
    best_verl = {k: max(m[k] for m in verl) for k in CALLS} if verl else None
    vs_verl = {p: {k: m[k] / best_verl[k] for k in CALLS} for p, m in medians.items() if best_verl}
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "config": dataclasses.asdict(cfg),
        "valid_tokens": valid,
        "fill": valid / batch["attention_mask"].numel(),
        "rounds": rounds,
        "median": medians,
        "errors": {p: errors[p] for p in cfg.path_list() if p in errors},
        "vs_padded": ratios,
        "vs_verl": vs_verl,
        "runs": runs,
        "profile": {},
        "profile_errors": {},
    }


def _write(cfg: BenchConfig, summary: dict[str, Any]) -> None:
    if cfg.out:
        write_file(cfg.out, json.dumps(summary, indent=1))


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
    width = max(18, *(len(p) for p in [*summary["median"], *(summary.get("errors") or {})]))
    lines = [
        f"{summary['device']}, torch {summary['torch']}, {cfg['dtype']}; {cfg['layers']} layers x {cfg['hidden']}, "
        f"{cfg['batch']} x ({cfg['prompt']} + {cfg['response']}), fill {summary['fill']:.2f}, "
        f"{summary['valid_tokens']} valid tokens",
        "values = compute_values, update = update_critic; tok/s counts valid tokens; x padded = tok/s / padded's"
        + ("; x verl = tok/s / the fastest verl path's" if vs_verl else ""),
        f"{'path':{width}} {'values tok/s':>13} {'update tok/s':>13} {'values MFU':>11} {'update MFU':>11} "
        f"{'peak GiB':>9}{head}",
    ]
    errors = summary.get("errors") or {}
    no_base = "padded" in errors  # the baseline was asked for and failed: no path has a ratio to it
    asked = [p.strip() for p in str(cfg.get("paths", "")).split(",") if p.strip()]  # the rows in the order asked
    rows = [p for p in asked if p in summary["median"] or p in errors]
    for path in [*rows, *(p for p in [*summary["median"], *errors] if p not in rows)]:
        if path in errors:
            lines.append(f"{path:{width}} {errors[path]}")
            continue
        m = summary["median"][path]
        verl = path.split("+")[0] in VERL_PATHS  # verl reports no FLOPs
        mfu = ("-", "-") if verl else (f"{m['compute_values_mfu']:.3f}", f"{m['update_critic_mfu']:.3f}")
        ratios = "".join(
            f" {_ratio_cell(ratios, path, call, no_base and name == 'x padded'):>16}"
            for name, ratios in ratio_columns.items()
            for call in ("compute_values", "update_critic")
        )
        lines.append(
            f"{path:{width}} {m['compute_values']:>13.0f} {m['update_critic']:>13.0f} {mfu[0]:>11} {mfu[1]:>11} "
            f"{m['peak_gb']:>9.2f}{ratios}"
        )
    if no_base:
        lines.append(f"x padded: none, the padded baseline failed ({errors['padded']})")
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
    for path, error in (summary.get("profile_errors") or {}).items():
        lines.append(f"top operators of one update, {path}: {error}")
    return "\n".join(lines)


def _ratio_cell(ratios: dict[str, dict[str, float]], path: str, call: str, no_base: bool) -> str:
    """A path's ratio to a reference path; 'no baseline' when the reference failed, '-' when it did not run."""
    if path in ratios:
        return f"{ratios[path][call]:.2f}x"
    return "no baseline" if no_base else "-"


def main(overrides: list[str]) -> dict[str, Any]:
    """Parse `key=value` options, run, print the table (and write JSON to `out`)."""
    return run_and_report(parse_options(overrides))


def run_and_report(cfg: BenchConfig) -> dict[str, Any]:
    """Run `cfg`, print the table (and write JSON to `out`); with `check`, only check the options."""
    if cfg.check:
        return check(cfg)
    summary = run(cfg)
    print(report(summary))
    _write(cfg, summary)
    return summary


def check(cfg: BenchConfig) -> dict[str, Any]:
    """The options resolved (printed as JSON) without building or measuring anything: where this machine has no
    CUDA, a CUDA device (cuda, cuda:N, or auto) is checked against the CUDA defaults it would run with."""
    if torch.cuda.is_available() or cfg.device == "cpu":
        plain = dataclasses.asdict(resolved(cfg))
    else:
        try:
            cuda = cfg.device == "auto" or torch.device(cfg.device).type == "cuda"
        except RuntimeError as err:
            raise ValueError(f"device={cfg.device!r} is not a torch device name (auto, cpu, cuda or cuda:N)") from err
        plain = dataclasses.asdict(cfg.resolved(cuda=cuda))
    print(json.dumps({"check": "ok", "paths": cfg.path_list(), "resolved": plain}))
    return plain


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start
