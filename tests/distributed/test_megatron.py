"""Cross-backend equivalence (torchrun, 4 gloo processes): from the same HF weights (Qwen2, and Llama), the megatron
critic at TP=1/PP=1 (DP=4), TP=2, PP=2, TP=2×PP=2 and PP=4×VPP=2 — and at TP=2 as verl's megatron worker builds
and calls it (no calculate_per_token_loss; update_critic(dataloader=...)) — gives the data-parallel critic's
values, update and metrics (and with `ema_decay` the values after the update), with fixed and with dynamic
micro-batches (the latter under PopArt); the HF -> megatron -> HF round trip is exact; a non-finite gradient skips
the step; the exported critic loads as an HF model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import make_batch, tiny_config, without_timings
from distributed.test_layouts import torchrun
from ppo_critic import build_value_model
from ppo_critic.data.batch import Batch
from ppo_critic.worker import CriticWorker

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
BASE = {
    "strategy": "none",
    "ppo_mini_batch_size": 8,
    "ppo_micro_batch_size_per_gpu": 2,
    "forward_micro_batch_size_per_gpu": 3,
    "grad_clip": 1.0,
    "ppo_max_token_len_per_gpu": 30,
    "ema_decay": 0.5,  # values after the update come from the weights' moving average
    "model": {"override_config": tiny_config("qwen2", num_hidden_layers=8), "value_head_init": "normal:0.3"},
    # Adam with eps far above every gradient entry: the update is lr/eps × gradient, without the first step's
    # sign(gradient) that would turn float noise (e.g. in the key bias, whose true gradient is 0) into ±lr
    "optim": {"lr": 50.0, "eps": 1000.0, "weight_decay": 0.0},
    "megatron": {"use_distributed_optimizer": True},
}
SGD = {"optimizer": "sgd", "lr": 0.05, "weight_decay": 0.0}
LLAMA = {"override_config": tiny_config("llama", num_hidden_layers=8, rope_theta=5e5), "value_head_init": "normal:0.3"}
CONFIGS = {  # Qwen2 + the distributed optimizer (Adam) + fixed micro-batches; Llama + plain SGD + dynamic ones + PopArt
    "fixed": BASE,
    "dynamic": BASE
    | {
        "use_dynamic_bsz": True,
        "value_norm": "popart",  # the head rescaled on the last stage only, the live one and the average's
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "optim": SGD,
        "megatron": {},
        "model": LLAMA,
    },
}


def reference(path: Path, configs: dict = CONFIGS, unit_returns: bool = False) -> dict:
    """The single-process data-parallel critic (strategy none) on the same global batch (`unit_returns`: its
    returns squashed into [0, 1], as bce takes them)."""
    batch = make_batch(16, 7, 6, seed=3)
    if unit_returns:
        batch["returns"] = torch.sigmoid(batch["returns"]) * batch["attention_mask"][:, -6:]
    modes = {}
    for mode, cfg in configs.items():
        worker = CriticWorker(copy.deepcopy(cfg) | {"megatron": {}}, seed=0)
        before = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
        values = worker.compute_values(batch)
        metrics = worker.update_critic(batch)
        after = worker.model.state_dict()
        delta = torch.cat([(after[k] - v).flatten() for k, v in before.items()])
        values_after = worker.compute_values(batch)
        modes[mode] = {"before": before, "values": values, "metrics": metrics, "delta": delta, "after": values_after}
    ref = {"batch": batch, "configs": configs, "modes": modes}
    torch.save(ref, path)
    return ref


def test_megatron_layouts_equal_the_data_parallel_critic(tmp_path):
    ref = reference(tmp_path / "reference.pt")
    out, export = tmp_path / "out.json", tmp_path / "export"
    result = torchrun(str(HERE / "megatron_worker.py"), str(tmp_path / "reference.pt"), str(out), str(export), nproc=4)
    assert result.returncode == 0, result.stderr[-6000:]
    rows = json.loads(out.read_text())
    assert {(r["layout"], r["mode"]) for r in rows} == {
        (layout, mode) for layout in ("tp1pp1", "tp2", "pp2", "tp2pp2", "pp4vpp2", "tp2verl") for mode in CONFIGS
    }
    dp = {"tp1pp1": 4, "tp2": 2, "pp2": 2, "tp2pp2": 1, "pp4vpp2": 1, "tp2verl": 2}
    assert {r["layout"]: r["dp"] for r in rows} == dp
    # megatron-core evaluates the same math with other formulas, not only in another order (its RMSNorm, rotary
    # embedding and attention; TP partial sums reduced over ranks; PP stages): more float32 roundings per op than the
    # data-parallel path, so 10x conftest.FP32_REORDERED; a wrong weight conversion or normalisation is off by > 1e-2.
    # The learning rate is the same float64 number (approx's default rel 1e-6).
    for r in rows:
        assert r["round_trip_exact"], r
        assert r["values_max_abs"] <= 1e-4 and r["values_after_max_abs"] <= 1e-4, r
        assert r["update_rel"] <= 1e-4, r
        assert r["metric_rel"] <= 1e-4, r
        assert r["skipped"] == 0 and r["lr"] == pytest.approx(50.0 if r["mode"] == "fixed" else 0.05), r
    (special,) = [r for r in rows if "nonfinite_skipped" in r]
    assert special["nonfinite_skipped"] == 2 and special["nonfinite_unchanged"], special
    # issue 43 family 6: the four ranks of the TP × PP replica given other tokens refuse alike, nothing moved
    assert "hold different batches (rank 0: " in special["mismatch"] and "differing: input_ids" in special["mismatch"]
    assert special["mismatch_unchanged"], special

    # the TP=2×PP=2 critic exported after its update loads as an ordinary HF critic with the same weights (the
    # moving average of ema_decay, as the data-parallel critic exports)
    exported = build_value_model(str(export))
    worker = CriticWorker(copy.deepcopy(CONFIGS["fixed"]) | {"megatron": {}}, seed=0)
    worker.update_critic(ref["batch"])
    with worker.critic.averaged_weights():
        expected = {k: v.clone() for k, v in worker.model.state_dict().items()}
    for k, v in exported.state_dict().items():  # the update of each, as above: 10x conftest.FP32_REORDERED
        assert (v - expected[k]).norm() <= 1e-4 * expected[k].norm().clamp(min=1e-6), k
    assert Batch.from_any(ref["batch"]).response_length == 6


def test_cli_trains_resumes_and_exports_with_the_megatron_backend(tmp_path):
    """`ppo-critic train backend=megatron` at TP=2: a crashed run resumed with resume=auto ends bit-identical to
    the uninterrupted one (weights and metrics), and `export` writes the same HF weights."""
    from safetensors.torch import load_file

    result = torchrun(str(HERE / "megatron_cli.py"), str(tmp_path), nproc=2)
    assert result.returncode == 0, result.stderr[-6000:]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert "resumed from" in result.stdout and "step_00000002" in result.stdout
    rows = [json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]) for run in (straight, resumed)]
    assert without_timings(rows[0]) == without_timings(rows[1])
    assert rows[0]["step"] == 4
    a, b = load_file(straight / "hf" / "model.safetensors"), load_file(resumed / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    assert a.keys() == b.keys() == exported.keys() and "score.weight" in a
    assert all(torch.equal(a[k], b[k]) and torch.equal(b[k], exported[k]) for k in a)
    config = yaml.safe_load((resumed / "config.yaml").read_text())
    assert config["critic"]["strategy"] == "megatron"
    assert config["critic"]["megatron"]["tensor_model_parallel_size"] == 2


@pytest.mark.cuda
def test_megatron_on_cuda_equals_the_data_parallel_critic(tmp_path):
    """TP=1/PP=1 on one GPU (NCCL, fp32): the same values, update and metrics as the data-parallel critic."""
    configs = {mode: cfg | {"dtype": "float32"} for mode, cfg in CONFIGS.items()}
    reference(tmp_path / "reference.pt", configs)
    out = tmp_path / "out.json"
    env = {"MEGATRON_LAYOUTS": "tp1pp1"}
    result = torchrun(str(HERE / "megatron_worker.py"), str(tmp_path / "reference.pt"), str(out), "-", nproc=1, env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    rows = json.loads(out.read_text())
    assert len(rows) == len(CONFIGS)
    for r in rows:  # as in test_megatron_layouts_equal_the_data_parallel_critic (CUDA: fp32, TF32 off by default)
        assert r["round_trip_exact"] and r["values_max_abs"] <= 1e-4 and r["update_rel"] <= 1e-4, r
        assert r["metric_rel"] <= 1e-4, r
