"""Layout invariance at DP=2 (torchrun, gloo): every wrapping × micro-batching × padding × loss mode gives the
single-process update (rel ≤ 1e-5) and the same metrics, also when the batch ends with a short mini-batch (verl's
rule) and when a rank has no share of it; compute_values under DP equals the reference."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from conftest import make_batch, tiny_config
from cuda_contract import FSDP_GATHERS
from ppo_critic import DataParallelPPOCritic, build_value_model

HERE = Path(__file__).resolve().parent
MODES = ("token-mean", "seq-mean-token-mean")


# global batch rows: full mini-batches of 8; a short last one (8 + 4: one step of 4 rows); and one whose last row
# leaves rank 1 without a share (8 + 1: rank 1 steps with an empty mini-batch to keep rank 0's collectives company)
CASES = {"full": 8, "short": 12, "uneven": 9}
PADDED = {"use_remove_padding": False}  # the reference is the plain padded run (DESIGN §6), and `base` stays padded


def reference(path: Path) -> None:
    """Single-process reference: one update on the whole global batch (mini-batch 8 = 2 ranks × 4), per case."""
    torch.manual_seed(0)
    base = build_value_model(tiny_config("qwen2"))
    cases = {}
    for case, rows in CASES.items():
        batch = make_batch(rows, 7, 6, seed=1)
        updates = {}
        for mode in MODES:
            model = copy.deepcopy(base)
            before = {k: v.detach().clone() for k, v in model.state_dict().items()}
            critic = DataParallelPPOCritic(
                {"ppo_mini_batch_size": 8, "grad_clip": None, "loss_agg_mode": mode, "model": PADDED},
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
            )
            metrics = critic.update_critic(batch)
            after = model.state_dict()
            delta = torch.cat([(after[k] - v).flatten() for k, v in before.items()])
            updates[mode] = {"before": before, "delta": delta, "metrics": metrics}
        cases[case] = {"batch": batch, "updates": updates}
    critic = DataParallelPPOCritic(
        {"ppo_mini_batch_size": 8, "model": PADDED}, base, torch.optim.SGD(base.parameters(), lr=0.1)
    )
    values = critic.compute_values(cases["full"]["batch"])
    torch.save({"model": base, "cases": cases, "values": values}, path)


def torchrun(
    *argv: str, nproc: int = 2, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=N <argv>` (a script path, or `-m module`), gloo on CPU."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), *sys.path]),
        **(env or {}),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def test_layout_invariance_at_dp2(tmp_path):
    ref = tmp_path / "reference.pt"
    out = tmp_path / "out.json"
    reference(ref)
    result = torchrun(str(HERE / "layouts_worker.py"), str(ref), str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    # DESIGN §8: every tensor a collective was handed lay on a device its backend takes (cuda_contract)
    checked = set(report["collectives_checked"])
    assert {"all_reduce", "all_gather"} <= checked and FSDP_GATHERS & checked
    layouts = report["layouts"]
    assert len(layouts) == len(MODES) * 4 * (4 * 2 + 2 * 2)  # full: every layout; short, uneven: two each
    assert {r["case"] for r in layouts} == set(CASES)
    # DESIGN §6: the same sums over other ranks, micro-batches and shards, fp32 rounding apart (conftest.FP32_REORDERED)
    bad = [r for r in layouts if not (r["rel"] <= 1e-5 and r["metric_rel"] <= 1e-5)]
    assert not bad, bad
    assert report["values_max_abs"] <= 1e-5
