"""verl's TrainingWorker with ppo-critic's engine under torchrun (2 gloo processes): at DP=2 and at DP=1 × Ulysses 2
the values, one update and a checkpoint round trip equal ppo-critic's own critic in one process, and every metric the
engine reports equals the engine's own at DP=1 × SP=1 on the same global mini-batches."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import torch
from engine_helpers import SGD, assert_metrics_equal, critic_metrics, reference, train, training_worker
from test_integrations_verl_engine import LAYOUT, VALUES, value_norm_reference

from ppo_critic.config.env import OPTIONS_ENV
from verl_shared import rel_change, rollout

HERE = Path(__file__).resolve().parent


def test_dp2_and_ulysses2_equal_one_process(single_process, model_dir, tmp_path, monkeypatch):
    batch = rollout(16, seed=7)
    torch.save(batch, tmp_path / "batch.pt")
    zeros = copy.deepcopy(batch)
    zeros.batch["returns"] = torch.zeros_like(zeros.batch["returns"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(HERE / "worker_engine_dist.py"), str(model_dir), str(tmp_path / "batch.pt"), str(tmp_path / "out.pt")]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-5000:]
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    assert {"all_reduce", "all_gather", "all_to_all_single"} <= set(results.pop("collectives_checked"))  # DESIGN §8
    # DP=2: a mini-batch of 8 is rank 0's next 4 rows (of 0..7) and rank 1's (of 8..15)
    dp_order = [*range(0, 4), *range(8, 12), *range(4, 8), *range(12, 16)]
    expected = {
        "dp2": reference(model_dir, batch.select_idxs(dp_order), mini_batch_size=8),
        "dp1sp2": reference(model_dir, batch, mini_batch_size=8),
        # the engine merges each global mini-batch's returns before its step: one call of ppo-critic's per mini-batch
        "dp2_popart": popart_reference(model_dir, batch, dp_order),
        # returns without spread leave the statistics the identity: the update without normalisation (issue 39)
        "dp2_running_zeros": reference(model_dir, zeros.select_idxs(dp_order), mini_batch_size=8),
    }
    natural = torch.argsort(torch.tensor(dp_order))  # the DP reference's rows back in batch order
    in_one = {
        "dp2": ("", dp_order, batch),
        "dp1sp2": ("", list(range(16)), batch),
        "dp2_popart": ("value_norm=popart", dp_order, batch),
        "dp2_running_zeros": ("value_norm=running", dp_order, zeros),
    }
    for name, got in results.items():
        options, rows, source = in_one[name]
        monkeypatch.setenv(OPTIONS_ENV, options)
        assert_metrics_equal(got["metrics"], one_process_metrics(model_dir, source.select_idxs(rows)), name)
        want = expected[name]
        rows = torch.arange(16) if name == "dp1sp2" else natural
        torch.testing.assert_close(got["values"], want["values"][rows], **VALUES, msg=name)
        assert rel_change(got["params"], want["after"], want["before"]) <= LAYOUT, name
        torch.testing.assert_close(got["values_after"], want["values_after"][rows], **VALUES, msg=name)
        assert torch.equal(got["values_loaded"], got["values_after"]), name  # verl's checkpoint calls, sharded


def one_process_metrics(model_dir, batch) -> dict[str, float]:
    """The engine's metrics in this one process (DP=1, SP=1) over the same global mini-batches of 8, one row per
    micro-batch (under verl's default token budget the torchrun layouts run each rank's rows of one as one)."""
    batching = {"+fsdp.use_dynamic_bsz": False, "+fsdp.micro_batch_size_per_gpu": 1}
    worker = training_worker(model_dir, **SGD, **batching)
    return critic_metrics(train(worker, batch, mini_batch_size=8))


def popart_reference(model_dir, batch, dp_order: list[int]) -> dict:
    """ppo-critic's own critic under PopArt, one `update_critic` per global mini-batch of the DP layout."""
    minis = [batch.select_idxs(dp_order[:8]), batch.select_idxs(dp_order[8:])]
    return value_norm_reference(model_dir, minis, "popart", probe=batch.select_idxs(dp_order))
