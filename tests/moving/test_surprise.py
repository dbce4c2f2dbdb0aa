"""`trainer.surprise_ratio`: the schedule that reacts to a jump of the loss on fresh rollouts."""

from __future__ import annotations

import io
import json

import pytest

from ppo_critic.cli import load_config
from ppo_critic.moving.surprise import MEMORY, SurpriseSchedule
from ppo_critic.train import train


def test_a_jump_above_ratio_times_the_running_mean_raises_the_rate_for_steps_updates():
    schedule = SurpriseSchedule(ratio=2.0, steps=3, lr_scale=4.0)
    seen = [(schedule.observe(e), schedule.next_lr_scale()) for e in (9.0, 1.0, 1.0)]
    assert seen == [(False, 1.0)] * 3  # the first `steps` batches never surprise (the critic's early fall)
    mean = 9.0 * MEMORY**2 + (1 - MEMORY) * (MEMORY + 1)
    assert schedule.mean == pytest.approx(mean)
    assert schedule.observe(1.99 * mean) is False and schedule.next_lr_scale() == 1.0
    mean = MEMORY * mean + (1 - MEMORY) * 1.99 * mean
    assert schedule.observe(2.01 * mean) is True
    assert schedule.mean == 2.01 * mean  # the new policy's level: the error stays there without surprising again
    level = schedule.mean
    scales = [schedule.next_lr_scale()] + [(schedule.observe(e), schedule.next_lr_scale())[1] for e in (1e9, 1e9)]
    assert scales == [4.0, 4.0, 4.0]  # three raised updates; no second surprise while reacting to the first
    assert schedule.observe(level) is False and schedule.next_lr_scale() == 1.0
    assert schedule.observe(1e12) is True


def test_the_schedule_round_trips_through_its_state():
    schedule = SurpriseSchedule(ratio=1.5, steps=2, lr_scale=2.0)
    for error in (1.0, 1.0, 5.0):
        schedule.observe(error)
    schedule.next_lr_scale()
    json_state = json.loads(json.dumps(schedule.state()))  # a checkpoint's trainer_state.json
    again = SurpriseSchedule(ratio=1.5, steps=2, lr_scale=2.0)
    again.load_state(json_state)
    assert (again.mean, again.seen, again.left) == (schedule.mean, schedule.seen, schedule.left) and again.left == 1
    fresh = SurpriseSchedule(ratio=1.5, steps=2, lr_scale=2.0)
    fresh.load_state({})  # a checkpoint from before the option: nothing scored yet
    assert (fresh.mean, fresh.seen, fresh.left) == (None, 0, 0)


SHORT = [
    "trainer.steps=6",
    "trainer.rollout_batch_size=8",
    "trainer.eval_size=16",
    "trainer.eval_every=3",
    "trainer.save_every=0",
    "trainer.progress=false",
    "trainer.logger=[jsonl]",
    "trainer.export_hf=false",
    "critic.ppo_mini_batch_size=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "critic.model.override_config.hidden_size=32",
    "critic.model.override_config.intermediate_size=64",
]


def test_a_step_of_the_policy_is_a_surprise_the_loop_reacts_to(tmp_path):
    """counting's target probability jumps 0.05 -> 0.95 at step 3: the fresh batch's error jumps with it, and the next
    two updates run at 3× the rate; before it nothing reacts."""
    drift = ["task.drift=step", "task.drift_start=3", "task.target_prob=0.05", "task.drift_to=0.95"]
    surprise = ["trainer.surprise_ratio=2", "trainer.surprise_steps=2", "trainer.surprise_lr_scale=3"]
    cfg = load_config(None, [*SHORT, *drift, *surprise, f"trainer.run_dir={tmp_path}"])
    train(cfg, out=io.StringIO())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["surprise/reacted"] for r in rows] == [0, 0, 0, 1, 0, 0]
    assert [r["surprise/lr_scale"] for r in rows] == [1, 1, 1, 3, 3, 1]
    assert [r["critic/lr"] / cfg.critic.optim.lr for r in rows] == pytest.approx([1, 1, 1, 3, 3, 1])
    assert rows[3]["surprise/error"] > 2 * rows[2]["surprise/error"]
