"""`ppo-critic bench`'s verl paths run verl 0.7.1's own critic on the same weights and batch as ppo-critic's paths:
the same values (so the speed comparison compares the same work), verl's own update, and the `x verl` report."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from ppo_critic.config.bench import BenchConfig
from ppo_critic.integrations.verl_bench import verls_critic_class
from ppo_critic.throughput import make_worker, resolved, rollouts

TINY = BenchConfig(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, batch=8, prompt=16, response=24, micro=2)
# fp32 forwards of the same weights whose attention sums run in another order (packed vs padded rows, one sequence
# vs a block-diagonal mask): per-element differences of a few ulp of values O(1), far below 1e-5 (FP32_REORDERED)
REORDERED = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def cfg():
    return resolved(TINY)


@pytest.fixture(scope="module")
def batch(cfg):
    return rollouts(cfg.batch, cfg.prompt, cfg.response, 0.5, cfg.vocab, cfg.seed)


@pytest.mark.parametrize("path", ["verl", "verl_packed", "verl+dyn", "verl_packed+dyn"])
def test_verl_paths_compute_ppo_critics_values_with_verls_critic(cfg, batch, path):
    ours = make_worker(cfg, "padded").compute_values(batch)
    verl = make_worker(cfg, path)
    assert type(verl.critic) is verls_critic_class() and verls_critic_class().__module__.startswith("verl.")
    assert verl.critic.use_remove_padding == (path.startswith("verl_packed"))
    torch.testing.assert_close(verl.compute_values(batch), ours, **REORDERED)


def test_verl_path_updates_like_ppo_critic_with_one_micro_batch(cfg, batch):
    """One micro-batch per mini-batch: verl's update and ours are the same step from the same weights (SGD keeps
    the step linear in the gradient, so a different gradient cannot hide behind Adam's normalisation)."""
    one = resolved(BenchConfig(**{**TINY.__dict__, "micro": TINY.batch}))
    ours, verl = make_worker(one, "packed"), make_worker(one, "verl_packed")
    ours.critic.critic_optimizer = torch.optim.SGD(ours.model.parameters(), lr=0.1)
    verl.critic.critic_optimizer = torch.optim.SGD(verl.critic.critic_module.parameters(), lr=0.1)
    before = [p.detach().clone() for p in ours.model.parameters()]
    metrics = verl.update_critic(batch)
    ours.critic.update_critic(batch)
    assert "critic/vf_loss" in metrics and "critic/grad_norm" in metrics  # verl's own metric names
    for p, q, b in zip(verl.critic.critic_module.parameters(), ours.model.parameters(), before, strict=True):
        # gradients of the same fp32 loss summed in another order: relative rounding ~1e-6 of a step of size
        # 0.1·|g| (≤ 0.1 after clipping to norm 1), far below the 1e-3 a different normalisation would make
        torch.testing.assert_close(p - b, q - b, rtol=1e-4, atol=1e-7)
    assert max(float((q.detach() - b).abs().max()) for q, b in zip(ours.model.parameters(), before, strict=True)) > 1e-4


def test_bench_reports_ours_against_the_fastest_verl_path(tmp_path):
    out = tmp_path / "result.json"
    sizes = ("layers", "hidden", "heads", "kv_heads", "vocab", "batch", "prompt", "response", "micro")
    options = [f"{k}={getattr(TINY, k)}" for k in sizes]
    verl_paths = ("verl", "verl_packed+dyn")
    command = [sys.executable, "-m", "ppo_critic", "bench", f"paths=packed+dyn,{','.join(verl_paths)}", *options]
    result = subprocess.run(
        [*command, "repeats=1", "dtype=bfloat16", f"out={out}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())
    verl_best = {k: max(summary["median"][p][k] for p in verl_paths) for k in ("compute_values", "update_critic")}
    for path, ratios in summary["vs_verl"].items():
        for call, ratio in ratios.items():
            assert ratio == summary["median"][path][call] / verl_best[call]
    assert max(summary["vs_verl"][p]["update_critic"] for p in verl_paths) == 1
    assert "ppo-critic's fastest / verl's fastest: compute_values" in result.stdout
    assert "Critic use_remove_padding" not in result.stdout  # verl's print is kept out of the table


def test_verl_paths_refuse_float16(cfg):
    with pytest.raises(ValueError, match=re.escape("dtype=torch.float16: verl's critic computes under bf16 autocast")):
        make_worker(resolved(BenchConfig(**{**TINY.__dict__, "dtype": "float16"})), "verl")
