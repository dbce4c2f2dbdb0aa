"""Value normalisation through verl's `TrainingWorker` on returns without spread (issue 39, item 1): the all-zero
returns of a sparse-reward run's first batch leave the update as without normalisation, and a move of the statistics
clips no token of an unchanged model."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import SGD, critic_metrics, engine_params, infer_values, train, training_worker

from ppo_critic.config.env import OPTIONS_ENV
from verl_shared import rollout


def first_update(model_dir, monkeypatch, mode: str, returns) -> tuple[dict, dict, object]:
    """One update on `rollout(8)` whose old values are the engine's own and whose returns are `returns(batch)`:
    the metrics, the parameters after, and the return statistics."""
    monkeypatch.setenv(OPTIONS_ENV, f"value_norm={mode}")
    worker = training_worker(model_dir, **SGD, cliprange_value=0.5)
    data = rollout(8, seed=3)
    data.batch["values"] = infer_values(worker, data)
    data.batch["returns"] = returns(data.batch)
    metrics = critic_metrics(train(worker, data, mini_batch_size=8))
    return metrics, engine_params(worker), worker.engine.worker.critic.value_norm


@pytest.mark.parametrize("mode", ["running", "popart"])
def test_all_zero_returns_train_as_without_normalisation(single_process, model_dir, monkeypatch, mode):
    """Before the fix: σ floored at 1e-4, vf_loss ~1e5-1e6 with no gradient (running) or a head scaled x1e4."""
    zeros = lambda batch: torch.zeros_like(batch["returns"])  # noqa: E731
    got, params, norm = first_update(model_dir, monkeypatch, mode, zeros)
    want, want_params, _ = first_update(model_dir, monkeypatch, "off", zeros)
    assert norm.count.item() == 0 and norm.std.item() == 1.0 and got["grad_norm"] > 0
    for key in ("critic/vf_loss", "grad_norm", "critic/vf_clipfrac"):
        assert got[key] == want[key], key  # the identity statistics: the same float32 computation, bit for bit
    assert all(torch.equal(value, want_params[name]) for name, value in params.items())


@pytest.mark.parametrize("mode", ["running", "popart"])
def test_a_jump_of_the_statistics_clips_no_token(single_process, model_dir, monkeypatch, mode):
    """Returns around 20 (μ jumps from 0): the old values are the model's own outputs, so none is clipped."""
    metrics, _, norm = first_update(model_dir, monkeypatch, mode, lambda batch: batch["returns"] * 3 + 20)
    assert norm.mean.item() > 10 and metrics["critic/vf_clipfrac"] == 0.0 and metrics["grad_norm"] > 0
