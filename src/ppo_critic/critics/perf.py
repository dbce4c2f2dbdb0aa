"""Performance accounting: phase timers that never sync the hot loop, model FLOPs of a batch, the device's
measured matmul peak, and the `perf/*` metrics both critics report.

FLOPs count matmuls and attention (causal: half the score matrix), ×3 for a training step (backward = 2×
forward); MFU is those FLOPs over the elapsed time and the measured peak of the compute dtype on every device.
"""

from __future__ import annotations

import contextlib
import functools
import math
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


class PhaseTimer:
    """Wall time per named phase. On CUDA, events are recorded around each span and read once in `seconds()`
    (a single synchronisation after the work), so timing does not stall the micro-batch loop."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list[Any]] = defaultdict(list)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans[phase].append((start, end))
        else:
            start_s = time.perf_counter()
            yield
            self.spans[phase].append(time.perf_counter() - start_s)

    def seconds(self) -> dict[str, float]:
        if self.cuda and self.spans:
            torch.cuda.synchronize()
        return {
            phase: sum(s.elapsed_time(e) / 1000 for s, e in spans) if self.cuda else sum(spans)
            for phase, spans in self.spans.items()
        }


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs of a decoder-only transformer depend on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    gated: bool = True  # SwiGLU: three MLP matrices

    @classmethod
    def from_hf(cls, config: Any) -> ModelShape | None:
        """From a transformers config (its text config for multimodal models); None when fields are missing."""
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        try:
            heads = c.num_attention_heads
            return cls(
                hidden=c.hidden_size,
                layers=c.num_hidden_layers,
                heads=heads,
                kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                ffn=c.intermediate_size,
                gated=getattr(c, "hidden_act", "silu") in ("silu", "swiglu"),
            )
        except AttributeError:
            return None

    @classmethod
    def from_megatron(cls, tf: Any) -> ModelShape:
        return cls(
            hidden=tf.hidden_size,
            layers=tf.num_layers,
            heads=tf.num_attention_heads,
            kv_heads=tf.num_query_groups or tf.num_attention_heads,
            head_dim=tf.kv_channels,
            ffn=tf.ffn_hidden_size,
            gated=tf.gated_linear_unit,
        )

    def forward_flops(self, seq_lens: Tensor) -> float:
        """Forward FLOPs of sequences of `seq_lens` valid tokens (each attends causally to itself only)."""
        h, d = self.hidden, self.head_dim
        per_layer = h * self.heads * d * 2 + 2 * h * self.kv_heads * d + (3 if self.gated else 2) * h * self.ffn
        lens = seq_lens.double()
        tokens, squares = float(lens.sum()), float((lens * lens).sum())
        matmul = 2 * (self.layers * per_layer + h) * tokens  # + the value head
        attention = self.layers * 2 * self.heads * d * squares  # QK^T and PV, half of each (causal)
        return matmul + attention


@functools.cache
def peak_flops(device_type: str, dtype: torch.dtype) -> float:
    """Measured matmul FLOP/s of the current device in `dtype` (best of a few rounds of square matmuls; cached per
    process). On CUDA three 4096² operands (96 MiB in bf16), ten matmuls a round between synchronisations; where even
    that does not fit (the first metrics come after a full update) the peak is NaN, and so is MFU: never an OOM."""
    cuda = device_type == "cuda"
    n, per_round = (4096, 10) if cuda else (512, 1)
    try:
        a, b = (torch.randn(n, n, device=device_type, dtype=dtype) for _ in range(2))
        out = torch.empty_like(a)
    except torch.OutOfMemoryError:
        return math.nan
    best = math.inf
    for _ in range(4):  # the first round warms up
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(per_round):
            torch.matmul(a, b, out=out)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / per_round)
    return 2 * n**3 / max(best, 1e-12)


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated device memory (CUDA), else the process's peak resident set size, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def perf_metrics(
    prefix: str,
    seconds: dict[str, float],
    elapsed_s: float,
    tokens: float,
    flops: float | None,
    world_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, float]:
    """`perf/*` metrics: time per phase, valid tokens/s, MFU (when FLOPs are known) and peak memory.

    `elapsed_s` is the slowest rank's, `tokens` and `flops` are summed over the data-parallel ranks.
    """
    metrics = {f"perf/{prefix}time_{phase}_s": s for phase, s in sorted(seconds.items())}
    metrics[f"perf/{prefix}time_total_s"] = elapsed_s
    metrics[f"perf/{prefix}tokens_per_s"] = tokens / max(elapsed_s, 1e-9)
    if flops is not None:
        metrics[f"perf/{prefix}mfu"] = flops / max(elapsed_s, 1e-9) / (world_size * peak_flops(device.type, dtype))
    metrics[f"perf/{prefix}max_memory_gb"] = peak_memory_gb(device)
    return metrics
