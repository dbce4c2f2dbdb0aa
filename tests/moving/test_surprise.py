"""`trainer.surprise_z`: the schedule that reacts when the fresh rollouts' residual jumps (the policy moved)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from ppo_critic.cli import load_config
from ppo_critic.moving.surprise import MEMORY, SurpriseSchedule, row_residuals
from ppo_critic.train import train


def test_row_residuals_average_each_rows_valid_tokens_then_the_rows():
    targets = torch.tensor([[1.0, 3.0, 9.0], [2.0, 2.0, 2.0], [0.0, 0.0, 0.0]])
    values = torch.zeros(3, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    mean, error = row_residuals(targets, values, mask)
    rows = torch.tensor([2.0, 2.0, 0.0])  # the padded 9 is not a residual
    assert mean == pytest.approx(rows.mean().item()) and error == pytest.approx(rows.std().item() / 3**0.5)


def test_a_jump_of_more_than_z_standard_errors_reacts_for_steps_updates():
    schedule = SurpriseSchedule(z=4.0, steps=3, lr_scale=2.0)
    seen = [(schedule.observe(r, 0.1), schedule.reacting()) for r in (5.0, 0.0, 0.0)]
    assert seen == [(False, False)] * 3  # the first `steps` batches never surprise (the critic's own early learning)
    mean = 5.0 * MEMORY**2
    assert schedule.mean == pytest.approx(mean)
    assert schedule.score(mean - 0.39, 0.1) == pytest.approx(3.9)
    assert schedule.observe(mean - 0.39, 0.1) is False and not schedule.reacting()
    mean = MEMORY * mean + (1 - MEMORY) * (mean - 0.39)
    assert schedule.observe(mean - 0.41, 0.1) is True  # either way: values too high or too low
    level = schedule.mean
    assert level == pytest.approx(mean - 0.41)  # the new policy's level
    reacting = [schedule.reacting()] + [(schedule.observe(r, 0.1), schedule.reacting())[1] for r in (-9.0, 9.0)]
    assert reacting == [True, True, True]  # three reacting updates; no second surprise while reacting to the first
    assert schedule.mean == 9.0  # meanwhile the mean follows the residual (the critic learning the new policy)
    assert schedule.observe(9.3, 0.1) is False and not schedule.reacting()
    assert schedule.observe(schedule.mean + 1.0, 0.1) is True


def test_a_batch_whose_rows_agree_does_not_make_a_small_move_look_large():
    schedule = SurpriseSchedule(z=4.0, steps=1, lr_scale=2.0)
    for _ in range(5):
        schedule.observe(0.0, 0.1)
    assert schedule.score(0.2, 1e-6) == pytest.approx(2.0)  # 0.2 over the running 0.1, not over the batch's 1e-6
    assert schedule.score(0.2, 0.01) == pytest.approx(2.0) and schedule.score(0.2, 0.2) == pytest.approx(1.0)


def test_the_schedule_round_trips_through_its_state():
    schedule = SurpriseSchedule(z=3.0, steps=2, lr_scale=2.0)
    for residual in (0.0, 0.0, 5.0):
        schedule.observe(residual, 0.1)
    schedule.reacting()
    json_state = json.loads(json.dumps(schedule.state()))  # a checkpoint's trainer_state.json
    again = SurpriseSchedule(z=3.0, steps=2, lr_scale=2.0)
    again.load_state(json_state)
    assert (again.mean, again.seen, again.left) == (schedule.mean, schedule.seen, schedule.left) and again.left == 1
    fresh = SurpriseSchedule(z=3.0, steps=2, lr_scale=2.0)
    fresh.load_state({})  # a checkpoint from before the option: nothing scored yet
    assert (fresh.mean, fresh.seen, fresh.left) == (None, 0, 0)


SHORT = [
    "trainer.steps=6",
    "trainer.rollout_batch_size=32",
    "trainer.eval_size=16",
    "trainer.eval_every=3",
    "trainer.save_every=0",
    "trainer.progress=false",
    "trainer.logger=[jsonl]",
    "trainer.export_hf=false",
    "critic.ppo_mini_batch_size=16",
    "critic.ppo_micro_batch_size_per_gpu=16",
    "critic.model.override_config.hidden_size=32",
    "critic.model.override_config.intermediate_size=64",
]
STEP = ["task.drift=step", "task.drift_start=3", "task.target_prob=0.05", "task.drift_to=0.95"]
SURPRISE = ["trainer.surprise_z=5", "trainer.surprise_steps=2", "trainer.surprise_lr_scale=3"]


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_step_of_the_policy_is_a_surprise_the_loop_reacts_to(tmp_path):
    """counting's target probability jumps 0.05 -> 0.95 at step 3: the fresh rows' residual jumps many standard
    errors (the rewards rise, the values have not), and the next two updates run at 3× the rate; nothing before."""
    cfg = load_config(None, [*SHORT, *STEP, *SURPRISE, f"trainer.run_dir={tmp_path}"])
    train(cfg, out=io.StringIO())
    rows = rows_of(tmp_path)
    assert [r["surprise/reacted"] for r in rows] == [0, 0, 0, 1, 0, 0]
    assert rows[3]["surprise/z"] > 10 and max(r["surprise/z"] for r in rows[:3]) < 5
    assert [r["surprise/reacting"] for r in rows] == [0, 0, 0, 1, 1, 0]
    assert [r["critic/lr"] / cfg.critic.optim.lr for r in rows] == pytest.approx([1, 1, 1, 3, 3, 1])


def test_monte_carlo_targets_while_reacting(tmp_path, monkeypatch):
    """Under surprise_mc_targets the reacting updates regress on λ-1 returns; the others on the trainer's λ."""
    from ppo_critic import train as train_mod

    asked = []
    original = train_mod.critic_returns

    def recording(batch, values, t, step, monte_carlo=False):
        asked.append(monte_carlo)
        return original(batch, values, t, step, monte_carlo)

    monkeypatch.setattr(train_mod, "critic_returns", recording)
    extra = [*STEP, *SURPRISE, "trainer.surprise_mc_targets=true", f"trainer.run_dir={tmp_path}"]
    train(load_config(None, [*SHORT, *extra]), targets=recording, out=io.StringIO())
    reacting = [bool(r["surprise/reacting"]) for r in rows_of(tmp_path)]
    assert reacting[:5] == [False, False, False, True, True]  # the step at 3, then two updates
    assert asked == [call for react in reacting for call in ([False, True] if react else [False])]
