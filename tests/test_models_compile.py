"""`critic.model.use_torch_compile` and `critic.optim.fused`: levers of the performance issue that must not change
the numbers (their speed is measured by `ppo-critic bench`, paths `+compile` / `+fused`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import make_batch, tiny_config
from ppo_critic.models.compile import compile_decoder_layers, decoder_layers
from ppo_critic.worker import CriticWorker, worker_config

pytestmark = pytest.mark.usefixtures("one_thread")


def worker(remove_padding=True, compile_=False, fused=None):
    model = {"override_config": tiny_config("qwen2"), "use_remove_padding": remove_padding}
    config = {
        "strategy": "none",
        "ppo_mini_batch_size": 4,
        "cliprange_value": None,
        "model": {**model, "use_torch_compile": compile_},
        "optim": {"lr": 1e-2, "fused": fused},
    }
    return CriticWorker(config, device="cpu")


def trained(w):
    metrics = []
    for seed in range(2):
        batch = make_batch(8, 6, 5, seed=seed)
        batch["values"] = w.compute_values(batch)
        metrics.append(w.update_critic(batch))
    return w.compute_values(make_batch(8, 6, 5, seed=9)), metrics


def test_compiled_decoder_layers_give_the_eager_numbers():
    """Packed micro-batches of varying length through the compiled layers (dynamic shapes), forward and backward."""
    compiled = worker(compile_=True)
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(compiled.model))
    eager_values, eager_metrics = trained(worker())
    values, metrics = trained(compiled)
    torch.testing.assert_close(values, eager_values, rtol=1e-4, atol=1e-5)
    for a, b in zip(metrics, eager_metrics, strict=True):
        assert a["critic/vf_loss"] == pytest.approx(b["critic/vf_loss"], rel=1e-4)
    assert set(compiled.model.state_dict()) == set(worker().model.state_dict())  # names unchanged


def test_fused_adamw_gives_the_foreach_update():
    fused = worker(fused=True)
    assert fused.optimizer.defaults["fused"] is True
    values, _ = trained(fused)
    torch.testing.assert_close(values, trained(worker())[0], rtol=1e-5, atol=1e-6)


def test_a_model_without_a_layer_stack_is_named():
    with pytest.raises(ValueError, match="use_torch_compile: no decoder-layer list"):
        compile_decoder_layers(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"optim": {"fused": "yes"}}, "optim.fused='yes' must be true or false"),
        ({"optim": {"fused": True, "optimizer": "sgd"}}, "optim.fused=true applies to AdamW"),
        ({"strategy": "megatron", "optim": {"fused": True}}, "optim.fused=true applies to AdamW"),
        ({"strategy": "megatron", "model": {"use_torch_compile": True}}, "use_torch_compile is not supported with"),
    ],
)
def test_bad_lever_settings_name_the_key(changes, message):
    with pytest.raises(ValueError, match=message):
        worker_config({"ppo_mini_batch_size": 4, **changes})
