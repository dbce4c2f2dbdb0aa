"""`ppo-critic bench`: throughput of `compute_values` and `update_critic` for several critic paths side by side,
on one seeded rollout distribution, against the plain padded HF baseline measured in the same run.

Paths: `padded` (HF model, padded batches: the baseline), `packed` (remove padding), `megatron` (TP=1/PP=1;
CUDA, or CPU with the test-only redirect of bench/megatron_vs_dp.py), each optionally with levers appended:
`+dyn` (token-budget micro-batches of `budget` tokens instead of `micro` rows), `+fused` (fused AdamW), `+compile`
(`torch.compile` per decoder layer), e.g. `packed+dyn+fused`. Each path is a worker built from the same
config and seed (same weights); rounds alternate the paths so machine noise hits all alike; the report holds
median valid tokens/s, MFU (matmul + attention FLOPs over the measured matmul peak of the compute dtype) and
peak memory (CUDA: the peak above what was allocated before the calls, i.e. activations and gradients, since all
paths stay resident; CPU: the process's peak RSS), and the ratio of each path to the baseline. `profile=true`
adds the top operators of one `update_critic` per path (torch.profiler; device time on CUDA).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ppo_critic.config import from_mapping
from ppo_critic.files import write_file
from ppo_critic.parallel.mesh import resolve_device
from ppo_critic.perf import peak_memory_gb

PATHS = ("padded", "packed", "megatron")
LEVERS = ("dyn", "fused", "compile")
QWEN25_05B = {"layers": 24, "hidden": 896, "heads": 14, "kv_heads": 2, "intermediate": 4864, "vocab": 151936}


@dataclass
class BenchConfig:
    """What to measure. Model fields of 0 take the device's default shape: Qwen2.5-0.5B on CUDA, a small model on
    CPU; `dtype` null is bf16 on CUDA, fp32 on CPU. Rollouts: prompts ≤ `prompt` (left-padded), responses ≤
    `response` (right-padded), lengths uniform around `fill` of the padded widths."""

    paths: str = "padded,packed"
    """comma-separated paths: padded (the baseline), packed, megatron; each optionally with levers dyn, fused,
    compile joined by + (e.g. packed+dyn+fused)"""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N"""
    dtype: str | None = None
    """compute dtype (bfloat16, float16, float32); null: bfloat16 on CUDA, float32 on CPU"""
    layers: int = 0
    """decoder layers; 0: 24 on CUDA (Qwen2.5-0.5B), 4 on CPU"""
    hidden: int = 0
    """hidden size; 0: 896 on CUDA, 256 on CPU"""
    heads: int = 0
    """attention heads; 0: 14 on CUDA, 4 on CPU"""
    kv_heads: int = 0
    """key/value heads; 0: 2"""
    intermediate: int = 0
    """MLP size; 0: 4864 on CUDA, 4 × hidden on CPU"""
    vocab: int = 0
    """vocabulary size; 0: 151936 on CUDA, 1024 on CPU"""
    batch: int = 0
    """rollouts per call; 0: 32 on CUDA, 16 on CPU"""
    prompt: int = 0
    """padded prompt width (left-padded); 0: 512 on CUDA, 256 on CPU"""
    response: int = 0
    """padded response width (right-padded); 0: 1024 on CUDA, 512 on CPU"""
    fill: float = 0.5
    """valid lengths are uniform around this fraction of the padded widths, in (0, 1]"""
    micro: int = 0
    """rows per micro-batch; 0: 8 on CUDA, 4 on CPU"""
    budget: int = 0
    """tokens per micro-batch of the dyn lever; 0: twice a fixed micro-batch's padded tokens"""
    repeats: int = 3
    """measured rounds per path after one warm-up round (the report gives medians)"""
    profile: bool = False
    """add the top operators of one update_critic per path (torch.profiler)"""
    seed: int = 0
    """seed of the weights and of the rollouts (the same for every path)"""
    out: str | None = None
    """also write the report as JSON to this file; null: print it only"""

    def resolved(self) -> BenchConfig:
        """The config with the device defaults filled in (checked)."""
        cuda = resolve_device(self.device).type == "cuda"
        shape = QWEN25_05B if cuda else {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "vocab": 1024}
        sizes = {"batch": 32, "prompt": 512, "response": 1024, "micro": 8} if cuda else {}
        sizes = sizes or {"batch": 16, "prompt": 256, "response": 512, "micro": 4}
        cfg = dataclasses.replace(self, dtype=self.dtype or ("bfloat16" if cuda else "float32"))
        for name, value in {**shape, **sizes}.items():
            if getattr(cfg, name) == 0:
                setattr(cfg, name, value)
        if cfg.intermediate == 0:
            cfg.intermediate = 4 * cfg.hidden
        if cfg.budget == 0:  # twice the padded tokens of a fixed micro-batch: ~4x the rows at 50 % fill
            cfg.budget = 2 * cfg.micro * (cfg.prompt + cfg.response)
        unknown = [p for p in cfg.path_list() if p.split("+")[0] not in PATHS or set(p.split("+")[1:]) - set(LEVERS)]
        if unknown or not cfg.path_list():
            raise ValueError(
                f"paths={self.paths!r}: use a comma-separated list of {PATHS}, each optionally followed by levers "
                f"from {LEVERS} joined with '+' (e.g. packed+dyn+fused)"
            )
        if not 0 < cfg.fill <= 1:
            raise ValueError(f"fill={cfg.fill} must be in (0, 1]")
        sizes = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "batch", "prompt", "response")
        bad = [f"{n}={getattr(cfg, n)}" for n in (*sizes, "micro", "budget", "repeats") if getattr(cfg, n) < 1]
        if bad:
            raise ValueError(f"{', '.join(bad)}: sizes must be positive (0 takes the device's default)")
        if cfg.hidden % cfg.heads or cfg.heads % cfg.kv_heads:
            raise ValueError(
                f"hidden={cfg.hidden}, heads={cfg.heads}, kv_heads={cfg.kv_heads}: heads must divide hidden and "
                "kv_heads must divide heads"
            )
        if cfg.batch % cfg.micro:
            raise ValueError(f"batch={cfg.batch} must be a multiple of micro={cfg.micro}")
        return cfg

    def path_list(self) -> list[str]:
        return [p.strip() for p in self.paths.split(",") if p.strip()]


def rollouts(batch: int, prompt: int, response: int, fill: float, vocab: int, seed: int) -> dict[str, Tensor]:
    """Random rollouts whose valid lengths are uniform around `fill` of the padded widths (seeded)."""
    g = torch.Generator().manual_seed(seed)
    t = prompt + response
    low_p, low_r = max(1, int(prompt * (2 * fill - 1))), max(1, int(response * (2 * fill - 1)))
    p_len = torch.randint(low_p, prompt + 1, (batch,), generator=g)
    r_len = torch.randint(low_r, response + 1, (batch,), generator=g)
    pos = torch.arange(t)
    mask = ((pos >= prompt - p_len[:, None]) & (pos < prompt + r_len[:, None])).long()
    ids = torch.randint(0, vocab, (batch, t), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, prompt:],
        "values": torch.randn(batch, response, generator=g) * 0.1,
        "returns": torch.randn(batch, response, generator=g),
    }


def make_worker(cfg: BenchConfig, path: str) -> Any:
    """The worker of one path, from one config and seed (so every path holds the same weights)."""
    from ppo_critic.worker import CriticWorker, MegatronCriticWorker

    base, *levers = path.split("+")
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
            compute_mfu = worker.critic.last_compute_metrics.get("perf/compute_values_mfu", 0.0)
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
    base = medians.get("padded")
    ratios = {p: {k: m[k] / base[k] for k in ("compute_values", "update_critic")} for p, m in medians.items() if base}
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "config": dataclasses.asdict(cfg),
        "valid_tokens": valid,
        "fill": valid / batch["attention_mask"].numel(),
        "median": medians,
        "vs_padded": ratios,
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
    lines = [
        f"{summary['device']}, torch {summary['torch']}, {cfg['dtype']}; {cfg['layers']} layers x {cfg['hidden']}, "
        f"{cfg['batch']} x ({cfg['prompt']} + {cfg['response']}), fill {summary['fill']:.2f}, "
        f"{summary['valid_tokens']} valid tokens",
        "values = compute_values, update = update_critic; tok/s counts valid tokens; x padded = tok/s / padded's",
        f"{'path':10} {'values tok/s':>13} {'update tok/s':>13} {'values MFU':>11} {'update MFU':>11} "
        f"{'peak GiB':>9} {'values x padded':>16} {'update x padded':>16}",
    ]
    for path, m in summary["median"].items():
        ratio = summary["vs_padded"].get(path)
        values_vs, update_vs = (
            (f"{ratio[k]:.2f}x" for k in ("compute_values", "update_critic")) if ratio else ("-", "-")
        )
        lines.append(
            f"{path:10} {m['compute_values']:>13.0f} {m['update_critic']:>13.0f} {m['compute_values_mfu']:>11.3f} "
            f"{m['update_critic_mfu']:>11.3f} {m['peak_gb']:>9.2f} {values_vs:>16} {update_vs:>16}"
        )
    for path, ops in summary.get("profile", {}).items():
        top = "; ".join(f"{o['op']} {o['share']:.0%}" for o in ops[:5])
        lines.append(f"top operators of one update, {path}: {top}")
    return "\n".join(lines)


def main(overrides: list[str]) -> dict[str, Any]:
    """Parse `key=value` options, run, print the table (and write JSON to `out`)."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ValueError(f"bench options must look like key=value, got {bad}")
    text_fields = {f.name for f in dataclasses.fields(BenchConfig) if "str" in str(f.type)}
    values = {}
    for key, text in (o.split("=", 1) for o in overrides):
        values[key] = (None if text == "null" else text) if key in text_fields else _parse(text)
    cfg = from_mapping(BenchConfig, values)
    summary = run(cfg)
    print(report(summary))
    if cfg.out:
        write_file(cfg.out, json.dumps(summary, indent=1))
    return summary


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start
