"""The built-in tasks' policy schedule (`task.drift*`): the parameter's value per iteration, the task of an iteration
(`at`) equal to the task built with that value, its truth exact (Monte-Carlo), and the options' validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ppo_critic.config.tasks import DriftOptions
from ppo_critic.tasks import TASKS, DenseTask, DenseTaskConfig
from ppo_critic.tasks.common import monte_carlo_value

SMALL = {  # fast variants of the heavier tasks (the drift is the same code for all)
    "long": {"min_response_len": 20, "max_response_len": 24},
    "lengths": {"max_response_len": 24},
}


def config_of(name: str, **drift) -> DriftOptions:
    return TASKS[name][1](**SMALL.get(name, {}), **drift)


def moved(config: DriftOptions) -> object:
    return getattr(config, config.drift_field)


@pytest.mark.parametrize("name", list(TASKS))
def test_no_drift_is_the_task_itself_at_every_iteration(name):
    task = TASKS[name][0](config_of(name))
    assert all(task.at(step) is task for step in (0, 1, 99, 10_000))


def test_a_ramp_moves_linearly_over_drift_steps_from_drift_start_and_a_step_jumps():
    ramp = config_of("counting", drift="ramp", drift_start=2, drift_steps=4, drift_to=0.65)
    assert [moved(ramp.at(s)) for s in range(8)] == pytest.approx([0.25, 0.25, 0.35, 0.45, 0.55, 0.65, 0.65, 0.65])
    assert ramp.at(1) is ramp and ramp.at(5).target_prob == 0.65  # exactly drift_to at the end
    step = config_of("counting", drift="step", drift_start=3, drift_to=0.6)
    assert [moved(step.at(s)) for s in range(5)] == [0.25, 0.25, 0.25, 0.6, 0.6]


def test_a_moved_task_has_no_drift_of_its_own():
    config = config_of("counting", drift="step", drift_start=0).at(5)
    assert config.drift == "none" and config.at(1_000) is config


def test_tuples_move_entry_by_entry():
    config = config_of("long", drift="ramp", drift_start=0, drift_steps=2, drift_to=(0.55, 0.6, 0.65))
    assert moved(config.at(0)) == pytest.approx((0.5, 0.55, 0.6))
    assert moved(config.at(1)) == (0.55, 0.6, 0.65)


@pytest.mark.parametrize("name", list(TASKS))
@pytest.mark.parametrize("drift", ["ramp", "step"])
def test_the_task_of_an_iteration_is_the_task_built_with_that_value(name, drift):
    cls, _ = TASKS[name]
    task = cls(config_of(name, drift=drift, drift_start=1, drift_steps=3))
    for step in (0, 2, 5):
        value = moved(task.config.at(step))
        direct = cls(dataclasses.replace(task.config, drift="none", **{task.config.drift_field: value}))
        here = task.at(step)
        batch = here.sample(64, torch.Generator().manual_seed(step))
        assert all(torch.equal(v, direct.sample(64, torch.Generator().manual_seed(step))[k]) for k, v in batch.items())
        assert torch.equal(here.true_values(batch, 0.9), direct.true_values(batch, 0.9))
    assert task.at(0) is task and moved(task.at(5).config) == task.config.drift_to


@pytest.mark.parametrize("name", list(TASKS))
def test_the_moved_policy_changes_the_rollouts(name):
    cls, _ = TASKS[name]
    task = cls(config_of(name, drift="step", drift_start=1))
    before, after = (task.at(s).sample(256, torch.Generator().manual_seed(0)) for s in (0, 1))
    assert not torch.equal(before["token_level_rewards"], after["token_level_rewards"])


@pytest.mark.parametrize("name", list(TASKS))
def test_the_truth_of_a_moved_task_matches_monte_carlo(name):
    task = TASKS[name][0](config_of(name, drift="step", drift_start=0)).at(0)
    generator = torch.Generator().manual_seed(1)
    batch = task.sample(4, generator)
    for row, t in ((0, 0), (1, 1)):
        mean, stderr = monte_carlo_value(task, batch, row, t, 0.95, 4000, generator)
        exact = task.true_values(batch, 0.95)[row, t].item()
        assert abs(mean - exact) <= 4 * stderr + 1e-3, (name, row, t, mean, exact)


def test_dense_liked_prob_sets_how_often_a_fresh_draw_is_the_liked_symbol():
    task = DenseTask(DenseTaskConfig(liked_prob=0.5, stay_prob=0.0))
    batch = task.sample(2000, torch.Generator().manual_seed(0))
    liked = batch["input_ids"][:, task.prompt_width - 2]
    share = (batch["responses"][:, 0] == liked).float().mean().item()
    assert share == pytest.approx(0.5, abs=0.04)


def test_dense_at_its_uniform_liked_prob_has_the_values_of_the_default():
    default, uniform = DenseTask(), DenseTask(DenseTaskConfig(liked_prob=1 / 6))
    batch = default.sample(64, torch.Generator().manual_seed(0))
    torch.testing.assert_close(uniform.true_values(batch, 0.9), default.true_values(batch, 0.9))


@pytest.mark.parametrize(
    ("name", "drift", "field"),
    [
        ("counting", {"drift": "rmp"}, "drift"),
        ("counting", {"drift": "ramp", "drift_steps": 0}, "drift_steps"),
        ("counting", {"drift": "step", "drift_start": -1}, "drift_start"),
        ("counting", {"drift": "step", "drift_to": 1.5}, "drift_to"),
        ("recall", {"drift": "step", "drift_to": 0.0}, "drift_to"),
        ("dense", {"drift": "ramp", "drift_to": 1.0}, "drift_to"),
        ("long", {"drift": "ramp", "drift_to": (0.5, 0.6)}, "drift_to"),
        ("lengths", {"drift": "ramp", "drift_to": (0.1, 1.2)}, "drift_to"),
        ("scale", {"drift": "ramp", "drift_to": float("nan")}, "drift_to"),
    ],
)
def test_bad_drift_options_name_the_option(name, drift, field):
    config = config_of(name, **drift)
    with pytest.raises(ValueError, match=rf"^{type(config).__name__}\.{field} "):
        config.validate()


def test_drift_to_is_not_checked_without_a_drift():
    config_of("long", drift_to=(0.5,)).validate()
