"""perf: FLOPs of a batch against torch's own FLOP counter, phase timers, and the `perf/*` metrics of critics."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import make_batch, tiny_config
from ppo_critic import DataParallelPPOCritic, build_value_model
from ppo_critic.critics.perf import ModelShape, PhaseTimer, peak_flops


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_forward_flops_match_torch_flop_counter(model_type):
    """Eager attention computes the whole score matrix: torch counts our causal half twice. The rotary embedding's
    frequencies (a matmul in transformers < 5.24, a broadcast product since) are not model FLOPs: left out."""
    model = build_value_model(tiny_config(model_type, num_hidden_layers=3), attn_implementation="eager")
    shape = ModelShape.from_hf(model.config)
    lens = [7, 12]
    counted = 0
    for n in lens:
        with FlopCounterMode(display=False) as counter:
            model(input_ids=torch.randint(0, 100, (1, n)), use_cache=False)
        counted += counter.get_total_flops() - sum(
            sum(ops.values()) for name, ops in counter.get_flop_counts().items() if name.endswith("rotary_emb")
        )
    causal_attention = shape.layers * 2 * shape.heads * shape.head_dim * sum(n * n for n in lens)
    assert shape.forward_flops(torch.tensor(lens)) + causal_attention == counted


def test_phase_timer_sums_each_phase():
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(2):
        with timer("a"):
            time.sleep(0.01)
    with timer("b"):
        pass
    seconds = timer.seconds()
    assert seconds.keys() == {"a", "b"} and 0.02 <= seconds["a"] < 0.5 and seconds["b"] < 0.01


def test_peak_flops_is_measured_and_cached():
    first = peak_flops("cpu", torch.float32)
    assert first > 1e6 and peak_flops("cpu", torch.float32) == first


def test_the_cuda_peak_probe_allocates_two_4096_squares_and_an_oom_gives_nan(monkeypatch):
    """Near-full GPU memory (the first metrics come after a whole update) must not turn into an OOM in the probe."""
    shapes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch, "matmul", lambda a, b, out: None)
    monkeypatch.setattr(torch, "randn", lambda *shape, device, dtype: shapes.append((shape, device)) or torch.empty(0))
    assert peak_flops.__wrapped__("cuda", torch.bfloat16) > 0
    assert shapes == [((4096, 4096), "cuda")] * 2  # + one output like them: 96 MiB in bf16

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 MiB")

    monkeypatch.setattr(torch, "randn", out_of_memory)
    assert math.isnan(peak_flops.__wrapped__("cuda", torch.bfloat16))


@pytest.mark.cuda
def test_peak_flops_on_cuda_is_a_plausible_bf16_rate():
    assert 1e13 < peak_flops("cuda", torch.bfloat16) < 1e16  # any datacenter GPU since V100: 10 TFLOP/s .. 10 PFLOP/s


def test_critics_report_where_time_goes():
    model = build_value_model(tiny_config())
    critic = DataParallelPPOCritic(
        {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2}, model, torch.optim.AdamW(model.parameters())
    )
    batch = make_batch(8)
    critic.compute_values(batch)
    values = critic.last_compute_metrics
    assert values["perf/compute_values_tokens_per_s"] > 0 and 0 < values["perf/compute_values_mfu"] <= 1
    metrics = critic.update_critic(batch)
    phases = [f"perf/time_{p}_s" for p in ("forward", "backward", "optimizer", "collective")]
    assert all(metrics[k] >= 0 for k in phases) and metrics["perf/time_forward_s"] > 0
    assert sum(metrics[k] for k in phases) <= metrics["perf/time_total_s"] * 1.01
    tokens = int(batch["attention_mask"].sum())
    assert metrics["perf/tokens_per_s"] == tokens / metrics["perf/time_total_s"]  # exact: the same float64 quotient
    assert 0 < metrics["perf/mfu"] <= 1 and metrics["perf/max_memory_gb"] > 0


def test_a_module_without_a_transformers_config_reports_no_mfu():
    from test_hf import TrlStyleCritic

    model = TrlStyleCritic()  # no `config` attribute: its FLOPs are unknown
    critic = DataParallelPPOCritic({"ppo_mini_batch_size": 8}, model, torch.optim.SGD(model.parameters(), lr=0.1))
    metrics = critic.update_critic(make_batch(8))
    assert "perf/mfu" not in metrics and metrics["perf/tokens_per_s"] > 0
