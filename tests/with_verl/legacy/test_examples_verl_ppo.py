"""examples/verl_ppo.py runs as documented: verl's worker builds ppo-critic's critic and prints verl's metric dict."""

from __future__ import annotations

from verl_shared import run_example


def test_the_verl_example_runs():
    steps = run_example("verl_ppo.py", runs="ppo_critic.integrations.verl.DataParallelPPOCritic")
    assert steps[0].startswith("step 1: {'critic/grad_norm': ") and "'critic/lr': 0.001" in steps[0]
