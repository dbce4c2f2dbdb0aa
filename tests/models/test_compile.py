"""`critic.model.use_torch_compile` and `critic.optim.fused`: levers of the performance issue that must not change
the numbers (their speed is measured by `ppo-critic bench`, paths `+compile` / `+fused`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import FP32_REORDERED, make_batch, tiny_config
from ppo_critic.models.compile import compile_decoder_layers, decoder_layers
from ppo_critic.worker import CriticWorker, worker_config

pytestmark = pytest.mark.usefixtures("one_thread")


def worker(remove_padding=True, compile_=False, fused=None, optimizer="adamw", device="cpu"):
    model = {"override_config": tiny_config("qwen2"), "use_remove_padding": remove_padding}
    config = {
        "strategy": "none",
        "ppo_mini_batch_size": 4,
        "cliprange_value": None,
        "model": {**model, "use_torch_compile": compile_},
        "optim": {"optimizer": optimizer, "lr": 1e-2, "fused": fused},
    }
    return CriticWorker(config, device=device)


def test_compiled_decoder_layers_give_the_eager_numbers():
    """Packed micro-batches of varying length through the compiled layers (dynamic shapes), forward and backward.

    Inductor's fused kernels evaluate the same formulas with other roundings (other reduction orders, vectorised
    exp / rsqrt within a few ulp): the scale of conftest.FP32_REORDERED. SGD, so that the update is lr x the gradient
    and carries the gradient's relative error; Adam's lr·g/(|g| + eps) would turn a rounding-level difference in a
    gradient that cancels to ~0 into a step of up to lr, which no rounding bound covers."""
    compiled, eager = worker(compile_=True, optimizer="sgd"), worker(optimizer="sgd")
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(compiled.model))
    batch = make_batch(8, 6, 5, seed=0)
    values = compiled.compute_values(batch)
    torch.testing.assert_close(values, eager.compute_values(batch), **FP32_REORDERED)
    batch["values"] = values  # the same inputs to both updates
    before = [p.detach().clone() for p in eager.model.parameters()]
    metrics, eager_metrics = compiled.update_critic(batch), eager.update_critic(batch)
    pairs = list(zip(before, compiled.model.parameters(), eager.model.parameters(), strict=True))
    delta = torch.cat([(a.detach() - p0).flatten() for p0, a, _ in pairs])
    eager_delta = torch.cat([(b.detach() - p0).flatten() for p0, _, b in pairs])
    assert eager_delta.norm() > 0
    assert ((delta - eager_delta).norm() / eager_delta.norm()).item() <= FP32_REORDERED["rtol"]  # as DESIGN §6
    assert metrics["critic/vf_loss"] == pytest.approx(eager_metrics["critic/vf_loss"], rel=FP32_REORDERED["rtol"])
    later = make_batch(8, 6, 5, seed=9)  # another shape through the compiled layers after the update
    torch.testing.assert_close(compiled.compute_values(later), eager.compute_values(later), **FP32_REORDERED)
    assert set(compiled.model.state_dict()) == set(worker().model.state_dict())  # names unchanged


# Fused AdamW (one vectorised kernel) and the CPU default (one tensor at a time; torch uses foreach only on
# accelerators) evaluate the same formula with different rounding: FMA or not, vector or scalar code, intermediates
# kept or stored. With u = 2**-24 (float32 unit roundoff), per implementation and step t:
# - the update lr·m̂/(√v̂ + eps) has an error <= (8 + 6t)·u·lr·C_t: the step's own ~7 roundings (casts of the scalars,
#   √, ÷ bias correction, + eps, · step size, ÷) plus, carried in the moments, <= 3 roundings a step in m (lerp)
#   and 4 in v, halved by the √ (old ones are damped by beta, not amplified). C_t bounds |m̂|/√v̂ and also
#   Σ w_k |g_k| / √v̂, which scales the absolute error of m̂ when gradients cancel (Cauchy-Schwarz over the moment
#   weights; 1 at t=1, 1.011 at t=5 for betas (0.9, 0.999)), whatever the gradients are;
# - the parameter is rounded by the decay and by the subtraction: <= 2 ulp(p) <= 4·u·|p|.
# Two implementations may err in opposite directions: their difference is at most twice the sum over the steps.
# This holds on any IEEE-754 CPU as long as both see the same gradients, which is why the tests below keep them equal.
UNIT_ROUNDOFF = 2.0**-24


def update_ratio_bound(betas: tuple[float, float], t: int) -> float:
    """C_t: max |m̂_t| / √v̂_t over all gradient sequences (Cauchy-Schwarz over the bias-corrected moment weights)."""
    b1, b2 = betas
    w1 = [(1 - b1) * b1 ** (t - k) / (1 - b1**t) for k in range(1, t + 1)]
    w2 = [(1 - b2) * b2 ** (t - k) / (1 - b2**t) for k in range(1, t + 1)]
    return sum(a * a / b for a, b in zip(w1, w2, strict=True)) ** 0.5


def adamw_difference_bound(params: torch.Tensor, steps: int, group: dict) -> torch.Tensor:
    """Per element: how far fused and default AdamW may end apart after `steps` steps from the same parameters with
    the same gradients; `params` are the final ones (|p| was at most |p_T| + steps·max update along the way)."""
    lr, betas = group["lr"], group["betas"]
    updates = [lr * update_ratio_bound(betas, t) for t in range(1, steps + 1)]
    update_error = sum(2 * (8 + 6 * t) * UNIT_ROUNDOFF * u for t, u in zip(range(1, steps + 1), updates, strict=True))
    param_error = steps * 2 * 4 * UNIT_ROUNDOFF * (params.abs() + sum(updates))
    return update_error + param_error


def assert_within_adamw_rounding(fused: CriticWorker, default: CriticWorker, steps: int):
    group = fused.optimizer.param_groups[0]
    assert group["lr"] == default.optimizer.param_groups[0]["lr"] > 0
    for (name, a), b in zip(fused.model.named_parameters(), default.model.parameters(), strict=True):
        difference, bound = (a - b).abs(), adamw_difference_bound(b.detach(), steps, group)
        assert (difference <= bound).all(), f"{name}: {(difference / bound).max():.2f} x the rounding bound"
    initial = worker().model.parameters()
    assert any(not torch.equal(a, b) for a, b in zip(fused.model.parameters(), initial, strict=True))  # it moved


def test_fused_adamw_gives_the_default_update_in_update_critic():
    """One `update_critic` step (one mini-batch): both see bit-identical gradients (same weights, same batch, one
    thread), so only the optimizer's rounding may differ."""
    fused, default = worker(fused=True), worker()
    assert fused.optimizer.defaults["fused"] is True and not default.optimizer.defaults["fused"]
    for w in (fused, default):
        batch = make_batch(4, 6, 5, seed=0)
        batch["values"] = w.compute_values(batch)
        w.update_critic(batch)
    assert_within_adamw_rounding(fused, default, steps=1)


def test_fused_adamw_gives_the_default_update_over_steps():
    """Later steps involve betas and bias corrections (step 1 is lr·g/(|g| + eps) whatever they are); the same
    gradients are given to both optimizers, of magnitudes from 1e-9 (below eps) to 1 and of both signs."""
    fused, default = worker(fused=True), worker()
    g = torch.Generator().manual_seed(0)
    steps = 5
    for _ in range(steps):
        for a, b in zip(fused.model.parameters(), default.model.parameters(), strict=True):
            scale = 10 ** (torch.rand(a.shape, generator=g) * 9 - 9)
            a.grad = torch.randn(a.shape, generator=g) * scale
            b.grad = a.grad.clone()
        fused.optimizer.step()
        default.optimizer.step()
    assert_within_adamw_rounding(fused, default, steps)


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


@pytest.mark.cuda
def test_compiled_packed_layers_on_cuda_give_the_eager_values():
    """The GPU path users take with use_torch_compile: packed rows, the CUDA varlen kernel, bf16 autocast, inductor."""
    compiled, eager = worker(compile_=True, device="cuda"), worker(device="cuda")
    batch = make_batch(8, 6, 5, seed=0)
    # both in bf16: inductor fuses the same roundings differently, a few bf16 ulps (2**-9) of values < 0.5
    torch.testing.assert_close(compiled.compute_values(batch), eager.compute_values(batch), rtol=0, atol=1e-2)
    batch["values"] = eager.compute_values(batch)
    assert compiled.update_critic(batch)["critic/skipped_steps"] == 0


@pytest.mark.cuda
def test_fused_adamw_on_cuda_takes_adams_first_step():
    """Adam's first step moves each parameter by lr·m̂/(√v̂ + eps) ≤ lr (plus decoupled decay lr·wd·|p|); CUDA's
    backward is not bit-deterministic, so the fused kernel is checked against Adam's rule, not the default's bits."""
    fused = worker(fused=True, device="cuda")
    before = [p.detach().clone() for p in fused.model.parameters()]
    assert fused.update_critic(make_batch(8, 6, 5, seed=1))["critic/skipped_steps"] == 0
    group = fused.optimizer.param_groups[0]
    assert group["fused"]
    moved = [(p.detach() - p0).abs() for p0, p in zip(before, fused.model.parameters(), strict=True)]
    bound = [group["lr"] * (1 + group["weight_decay"] * p0.abs()) * (1 + 1e-3) for p0 in before]
    assert all(bool((m <= b).all()) for m, b in zip(moved, bound, strict=True))
    assert sum(float(m.sum()) for m in moved) > 0
