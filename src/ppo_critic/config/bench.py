"""The options of `ppo-critic bench` (`BenchConfig`) and their parsing, without torch: a mistyped option is
reported in a fraction of a second; `ppo_critic.throughput` measures."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ppo_critic.config.critic import from_mapping

PATHS = ("padded", "packed", "megatron", "verl", "verl_packed")
LEVERS = ("dyn", "fused", "compile", "bf16p")
VERL_PATHS = ("verl", "verl_packed")  # verl 0.7's own critic, padded or remove-padding; only the dyn lever
VERL_SERIES = "0.7."
QWEN25_05B = {"layers": 24, "hidden": 896, "heads": 14, "kv_heads": 2, "intermediate": 4864, "vocab": 151936}


@dataclass
class BenchConfig:
    """What to measure. Model fields of 0 take the device's default shape: Qwen2.5-0.5B on CUDA, a small model on
    CPU; `dtype` null is bf16 on CUDA, fp32 on CPU. Rollouts: prompts ≤ `prompt` (left-padded), responses ≤
    `response` (right-padded), lengths uniform around `fill` of the padded widths."""

    paths: str = "padded,packed"
    """comma-separated paths: padded (the baseline), packed, megatron, and verl 0.7's own critic: verl (padded),
    verl_packed (verl's use_remove_padding); each optionally with levers joined by + (e.g. packed+dyn+fused):
    dyn, fused, compile, bf16p (bf16 parameters with float32 master weights; needs dtype bfloat16) (verl paths: dyn
    only)"""
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
    """also write the report as JSON to this file (rewritten after every measured round); null: print it only"""
    check: bool = False
    """only check the options and print them resolved, measuring nothing (a machine without CUDA checks cuda/auto
    against the CUDA defaults)"""

    def resolved(self, cuda: bool) -> BenchConfig:
        """The config with the defaults of a CUDA or a CPU run filled in (checked); the caller says which the device
        is (`throughput.resolved`), or which to check a command against (`check=true` on a machine without CUDA)."""
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
        if not cfg.path_list() or any(_unknown(p) for p in cfg.path_list()):
            raise ValueError(
                f"paths={self.paths!r}: use a comma-separated list of {PATHS}, each optionally followed by levers "
                f"from {LEVERS} joined with '+' (e.g. packed+dyn+fused; verl paths take dyn only)"
            )
        if any(p.split("+")[0] in VERL_PATHS for p in cfg.path_list()):
            _check_verl(self.paths)
        if any("bf16p" in p.split("+")[1:] for p in cfg.path_list()) and cfg.dtype not in ("bfloat16", "bf16"):
            raise ValueError(
                f"paths={self.paths!r}: the bf16p lever stores the parameters in bf16, which compute in bf16; set "
                f"dtype=bfloat16 (the CUDA default), not {cfg.dtype}"
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


def _unknown(path: str) -> bool:
    base, *levers = path.split("+")
    allowed = ("dyn",) if base in VERL_PATHS else LEVERS
    return base not in PATHS or bool(set(levers) - set(allowed))


def _check_verl(paths: str) -> None:
    """The verl paths run verl 0.7's legacy `DataParallelPPOCritic`: it must be importable in this environment."""
    from importlib import metadata

    try:
        version = metadata.version("verl")
    except metadata.PackageNotFoundError:
        version = None
    if version is None or not version.startswith(VERL_SERIES):
        found = f"verl {version} is installed" if version else "verl is not installed"
        raise ValueError(
            f"paths={paths!r}: the verl paths run verl {VERL_SERIES}x's own critic, and {found}; run the bench in "
            "the environment `bash tests/with_verl/run.sh 0.7.1` builds (.venv-verl-0.7.1/bin/ppo-critic bench "
            "...), or pip install --no-deps verl==0.7.1 and what tests/with_verl/legacy/requirements.txt lists"
        )


def parse_options(overrides: list[str]) -> BenchConfig:
    """`key=value` options (values read as JSON where they parse, text fields as given) into a BenchConfig."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ValueError(f"bench options must look like key=value, got {bad}")
    text_fields = {f.name for f in dataclasses.fields(BenchConfig) if "str" in str(f.type)}
    values = {}
    for key, text in (o.split("=", 1) for o in overrides):
        values[key] = (None if text == "null" else text) if key in text_fields else _parse(text)
    return from_mapping(BenchConfig, values)


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
