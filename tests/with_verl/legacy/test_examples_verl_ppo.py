"""examples/verl_ppo.py runs as documented: verl's worker builds ppo-critic's critic and prints verl's metrics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "verl_ppo.py"


def test_the_verl_example_runs():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(29600 + os.getpid() % 300)}
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "3"], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.splitlines()  # verl prints lines of its own in between
    assert "verl's CriticWorker runs ppo_critic.integrations.verl.DataParallelPPOCritic" in lines
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split(":")[0] for s in steps] == ["step 1", "step 3"]
    assert steps[0].startswith("step 1: {'critic/grad_norm': ") and "'critic/lr': 0.001" in steps[0]
    assert lines[-1].startswith("explained variance of the true values on 256 held-out rollouts: ")
