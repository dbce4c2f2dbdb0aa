"""examples/verl_engine_ppo.py runs as documented: verl's TrainingWorker runs ppo-critic's engine and prints verl's
reduced metrics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "verl_engine_ppo.py"


def test_the_verl_engine_example_runs():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(29700 + os.getpid() % 200)}
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "3"], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.splitlines()  # verl prints lines of its own in between
    assert "verl's TrainingWorker runs ppo_critic.integrations.verl_engine.PPOCriticEngine" in lines
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split(":")[0] for s in steps] == ["step 1", "step 3"]
    assert "'critic/vf_loss': " in steps[0] and "'lr': 0.001" in steps[0] and "'grad_norm': " in steps[0]
    assert lines[-1].startswith("explained variance of the true values on 256 held-out rollouts: ")
