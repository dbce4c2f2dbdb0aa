"""examples/verl_engine_ppo.py runs as documented: verl's TrainingWorker runs ppo-critic's engine and prints verl's
reduced metrics."""

from __future__ import annotations

from verl_shared import run_example


def test_the_verl_engine_example_runs():
    steps = run_example("verl_engine_ppo.py", runs="ppo_critic.integrations.verl_engine.PPOCriticEngine")
    assert "'critic/vf_loss': " in steps[0] and "'lr': 0.001" in steps[0] and "'grad_norm': " in steps[0]
