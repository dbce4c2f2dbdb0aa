"""verl's FSDP CriticWorker at DP=2 (torchrun, gloo) with ppo-critic's critic installed the way a verl user installs
it (VERL_USE_EXTERNAL_MODULES): values equal verl's own critic's in the same worker, one update equals the
single-process update on the same mini-batches (global normalisation), and a checkpoint round trip keeps the values.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from verl_helpers import make_worker, worker_update, worker_values
from worker_dp2 import SGD

from verl_shared import params, rel_change, rollout

HERE = Path(__file__).resolve().parent
LAYOUT = 1e-5  # DESIGN §6: one update at any layout equals the single-process update to this relative error


def test_verls_worker_at_dp2(single_process, model_dir, tmp_path):
    batch = rollout(16, seed=6)
    torch.save(batch, tmp_path / "batch.pt")
    env = {
        **os.environ,
        "VERL_USE_EXTERNAL_MODULES": "ppo_critic.integrations.verl",
        "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path]),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(HERE / "worker_dp2.py"), str(model_dir), str(tmp_path / "batch.pt"), str(tmp_path / "out.pt")]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    dp2 = torch.load(tmp_path / "out.pt", weights_only=False)

    assert torch.equal(dp2["values"], dp2["verl_values"])  # verl's own critic, same worker, same layout
    assert torch.equal(dp2["values_loaded"], dp2["values_after"])  # verl's checkpoint manager, sharded at DP=2
    # one process; a mini-batch holds the rows both ranks held in that step (rank r's chunk is rows 8r..8r+7)
    order = [*range(0, 4), *range(8, 12), *range(4, 8), *range(12, 16)]
    reference = make_worker(model_dir, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=8, **SGD)
    before = params(reference.critic_module)
    # the same rows in other micro-batches: other padded shapes, fp32 rounding apart
    torch.testing.assert_close(worker_values(reference, batch), dp2["values"], rtol=1e-5, atol=1e-6)
    worker_update(reference, batch.select_idxs(order))
    assert rel_change(dp2["params"], params(reference.critic_module), before) <= LAYOUT
