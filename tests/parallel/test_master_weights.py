"""`critic.param_dtype=bfloat16` (parallel/master_weights.py): bf16 parameters and gradients, float32 master weights
stepped by the optimizer, for strategies none and ddp.

Tolerance against the float32 path: bf16 keeps 8 significant bits, so one rounding moves a number by at most 2**-9
of it and one ulp is at most U = 2**-8 of it. A value of the tiny model passes through a dozen such roundings in
series (each weight, the embedding output, the residual stream after each block, the norms, the head), each of the
size of the activations, partly cancelling: values stay within a few U of the largest value (measured: <= 1.8 U, the
same as bf16 autocast over float32 weights). An SGD update is the gradient, whose backward pass rounds as often: it
stays within a few U of the float32 update in norm (measured: <= 2.0 U). 4 U is the bound; a wrong mask, position or
normaliser moves values by tens of U and the update by ~100 %."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import exported_values, make_batch, tiny_config
from ppo_critic import DataParallelPPOCritic
from ppo_critic.backends.data_parallel.fsdp import clip_grad_norm
from ppo_critic.parallel.master_weights import MasterWeightOptimizer, store_in
from ppo_critic.worker import CriticWorker

pytestmark = pytest.mark.usefixtures("one_thread")

U = 2.0**-8  # bf16's relative precision: one ulp of x is at most U·|x|
BF16_TOL = 4 * U  # values: relative to the largest |value|; updates: relative to the float32 update's norm


def config(**changes) -> dict:
    """A tiny worker's critic section (strategy none, one step per update_critic call, plain SGD)."""
    model = {"override_config": tiny_config("qwen2"), "value_head_init": "normal:0.2"}
    base = {"strategy": "none", "ppo_mini_batch_size": 8, "model": model, "optim": {"optimizer": "sgd", "lr": 1e-3}}
    return {**copy.deepcopy(base), **changes}


def bf16(**changes) -> dict:
    return config(param_dtype="bfloat16", **changes)


def weights(worker: CriticWorker) -> dict[str, torch.Tensor]:
    """The weights a worker trains, by name: each parameter's float32 master where it has one, else the parameter."""
    masters = getattr(worker.optimizer, "masters", {})
    return {n: masters.get(p, p).detach().clone() for n, p in worker.model.named_parameters()}


def update_error(got: dict, expected: dict, before: dict) -> float:
    """‖got − expected‖ / ‖expected − before‖ over all weights: the error relative to the size of the update."""
    error = sum((got[n].float() - expected[n]).pow(2).sum() for n in expected)
    update = sum((expected[n] - before[n]).pow(2).sum() for n in expected)
    return float((error / update).sqrt())


def assert_values_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=0, atol=BF16_TOL * float(expected.detach().abs().max()))


def test_store_in_keeps_the_float32_storage_of_each_trainable_parameter_as_its_master():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    model[1].weight.requires_grad_(False)  # frozen: stored in bf16, no master
    model.register_buffer("freqs", torch.rand(4))
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    head = list(model[2].parameters())
    masters = store_in(model, torch.bfloat16, keep=head)  # a float32 head (value_head_dtype) is stepped as it is
    assert {n: p.dtype for n, p in model.named_parameters()} == {
        "0.weight": torch.bfloat16,
        "0.bias": torch.bfloat16,
        "1.weight": torch.bfloat16,
        "1.bias": torch.bfloat16,
        "2.weight": torch.float32,
        "2.bias": torch.float32,
    }
    assert model.freqs.dtype == torch.float32  # buffers (RoPE's frequencies) keep their dtype
    names = {p: n for n, p in model.named_parameters()}
    assert sorted(names[p] for p in masters) == ["0.bias", "0.weight", "1.bias"]
    for param, master in masters.items():
        assert master.dtype == torch.float32 and torch.equal(master, fp32[names[param]])  # exactly the fp32 weights
        assert torch.equal(param, master.bfloat16())


def test_steps_below_bf16_resolution_accumulate_in_the_masters_and_are_lost_without_them():
    """lr·grad = 1e-4 is far below half a bf16 ulp at 1.0 (2**-9 ≈ 2e-3): stepped directly, a bf16 parameter never
    moves; its float32 master takes every step, and the parameter follows it once it is a rounding away."""
    plain = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    direct = torch.optim.SGD([plain], lr=1e-4)
    mastered = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        mastered.weight.fill_(1.0)
    masters = store_in(mastered, torch.bfloat16)
    wrapped = MasterWeightOptimizer([{"params": [mastered.weight]}], masters, lambda g: torch.optim.SGD(g, lr=1e-4))
    for _ in range(100):
        for param, optimizer in ((plain, direct), (mastered.weight, wrapped)):
            param.grad = torch.ones_like(param)
            optimizer.step()
            optimizer.zero_grad()
    assert torch.equal(plain, torch.ones_like(plain))  # without master weights: all 100 updates lost
    master = masters[mastered.weight]
    # 100 float32 subtractions of 1e-4 from numbers near 1: each rounds by <= 2**-24, 100 of them <= 6e-6
    torch.testing.assert_close(master, torch.full_like(master, 0.99), rtol=0, atol=1e-5)
    assert torch.equal(mastered.weight, master.bfloat16())  # 0.98828125, the bf16 number nearest 0.99
    assert float(mastered.weight.detach()[0, 0]) == 0.98828125


def test_one_update_equals_the_float32_path_within_the_bf16_tolerance():
    batch = make_batch(8, 6, 5, seed=0)
    reference, worker = CriticWorker(config(), device="cpu"), CriticWorker(bf16(), device="cpu")
    assert {p.dtype for p in worker.model.parameters()} == {torch.bfloat16}
    assert worker.critic.compute_dtype == torch.bfloat16  # param_dtype sets the compute dtype when dtype is null
    before = weights(reference)
    assert before.keys() == weights(worker).keys()
    assert all(torch.equal(a, b) for a, b in zip(before.values(), weights(worker).values(), strict=True))
    assert_values_close(worker.compute_values(batch), reference.compute_values(batch))
    got, expected = worker.update_critic(batch), reference.update_critic(batch)
    assert got["critic/skipped_steps"] == 0
    assert got["critic/grad_norm"] == pytest.approx(expected["critic/grad_norm"], rel=BF16_TOL)
    assert update_error(weights(worker), weights(reference), before) <= BF16_TOL
    assert all(torch.equal(p, worker.optimizer.masters[p].bfloat16()) for p in worker.model.parameters())
    assert_values_close(worker.compute_values(batch), reference.compute_values(batch))


def test_many_small_updates_accumulate_like_the_float32_paths_and_a_bf16_model_alone_loses_them():
    """lr = 1e-4: a step moves a weight of ~0.02 by ~1e-5 (lr × a gradient of ~0.1), below half its bf16 ulp (6e-5),
    and far above its float32 ulp (2e-9), so the float32 path keeps each step to ~1e-4 of it."""
    batch = make_batch(8, 6, 5, seed=1)
    small = {"optimizer": "sgd", "lr": 1e-4}
    reference, worker = CriticWorker(config(optim=small), device="cpu"), CriticWorker(bf16(optim=small), device="cpu")
    alone = copy.deepcopy(reference.model).bfloat16()  # the control: bf16 parameters stepped directly
    sgd = torch.optim.SGD(alone.parameters(), lr=1e-4, weight_decay=0.01)
    control = DataParallelPPOCritic(worker.critic.config, alone, sgd)
    before = weights(reference)
    for _ in range(5):
        for critic in (reference, worker, control):
            critic.update_critic(batch)
    assert update_error(weights(worker), weights(reference), before) <= BF16_TOL  # measured: 1.4-2.0 U
    assert fraction_moved(weights(worker), before) > 0.99
    rounded = {n: t.bfloat16() for n, t in before.items()}
    assert fraction_moved({n: p.detach() for n, p in alone.named_parameters()}, rounded) < 0.01  # measured: 0.5 %


def fraction_moved(after: dict, before: dict) -> float:
    """The fraction of the elements of all weights that differ between `after` and `before`."""
    moved = sum(int((after[n] != before[n]).sum()) for n in before)
    return moved / sum(t.numel() for t in before.values())


def test_a_checkpoint_holds_the_float32_masters_and_a_resumed_run_continues_exactly(tmp_path):
    cfg = bf16(optim={"lr": 1e-3})  # AdamW: its moments are resumed too
    worker = CriticWorker(cfg, device="cpu")
    batches = [make_batch(8, 6, 5, seed=s) for s in range(3)]
    worker.update_critic(batches[0])
    path = worker.save_checkpoint(tmp_path / "ckpt")
    resumed = CriticWorker(cfg, device="cpu", seed=1)  # other weights
    resumed.load_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(weights(worker).values(), weights(resumed).values(), strict=True))
    assert all(torch.equal(p, q) for p, q in zip(worker.model.parameters(), resumed.model.parameters(), strict=True))
    for later in batches[1:]:
        assert worker.update_critic(later)["critic/vf_loss"] == resumed.update_critic(later)["critic/vf_loss"]
    assert all(torch.equal(a, b) for a, b in zip(weights(worker).values(), weights(resumed).values(), strict=True))
    # the model entries are the masters: a float32 worker resumes from them as its own weights
    plain = CriticWorker(config(optim={"lr": 1e-3}), device="cpu", seed=2)
    plain.load_checkpoint(path)
    worker.load_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(weights(worker).values(), weights(plain).values(), strict=True))


def test_the_hf_export_writes_the_float32_master_weights(tmp_path):
    worker = CriticWorker(bf16(), device="cpu")
    batch = make_batch(8, 6, 5, seed=2)
    worker.update_critic(batch)
    worker.export_hf(tmp_path / "hf")
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    masters = weights(worker)
    assert {t.dtype for t in exported.values()} == {torch.float32}
    assert all(torch.equal(exported[n], masters[n]) for n in masters)
    assert all(p.dtype == torch.bfloat16 for p in worker.model.parameters())  # the live model is bf16 again
    assert_values_close(worker.compute_values(batch), exported_values(tmp_path / "hf", batch))


def test_the_moving_average_follows_the_masters_in_float32():
    ema = {"ema_decay": 0.5, "ppo_mini_batch_size": 4}  # two steps per update_critic call
    reference, worker = CriticWorker(config(**ema), device="cpu"), CriticWorker(bf16(**ema), device="cpu")
    batch = make_batch(8, 6, 5, seed=3)
    before = weights(reference)
    reference.update_critic(batch), worker.update_critic(batch)
    expected = dict(zip(reference.critic.ema.names, reference.critic.ema.average, strict=True))
    average = {n: a.clone() for n, a in zip(worker.critic.ema.names, worker.critic.ema.average, strict=True)}
    assert {a.dtype for a in average.values()} == {torch.float32}
    assert update_error(average, expected, before) <= BF16_TOL
    live, params = weights(worker), [p.detach().clone() for p in worker.model.parameters()]
    with worker.critic.averaged_weights():  # compute_values' weights: the average, rounded into the parameters
        assert all(torch.equal(p, average[n].bfloat16()) for n, p in worker.model.named_parameters())
    assert all(torch.equal(a, b) for a, b in zip(weights(worker).values(), live.values(), strict=True))
    assert all(torch.equal(p, q) for p, q in zip(worker.model.parameters(), params, strict=True))
    assert_values_close(worker.compute_values(batch), reference.compute_values(batch))


def popart_merged(**changes) -> tuple[CriticWorker, CriticWorker, dict, torch.Tensor, torch.Tensor]:
    """A float32 and a bf16 worker under PopArt (and `changes`) after one merge of returns ~50 ± 10, the batch, its
    returns and the float32 worker's values before the merge."""
    cfg = {"value_norm": "popart", **changes}
    reference, worker = CriticWorker(config(**cfg), device="cpu"), CriticWorker(bf16(**cfg), device="cpu")
    batch = make_batch(8, 6, 5, seed=4)
    returns, mask = 50.0 + 10.0 * batch["returns"], batch["attention_mask"][:, -batch["responses"].shape[1] :]
    values = reference.compute_values(batch)
    for critic in (reference.critic, worker.critic):
        critic.update_value_norm(returns, mask)
    return reference, worker, batch, returns, values


def test_popart_rescales_the_master_copy_of_the_head():
    reference, worker, batch, returns, values = popart_merged()
    head = {n: t for n, t in weights(worker).items() if n.startswith("score.")}
    # the same float32 head, rescaled in float64 and stored in float32 on both sides: the same bits
    assert all(torch.equal(t, weights(reference)[n]) for n, t in head.items())
    assert all(torch.equal(p, worker.optimizer.masters[p].bfloat16()) for p in worker.model.parameters())
    # the raw values are preserved; the bf16 head now outputs (value − μ) / σ, so its roundings are of that size
    mean = float(worker.critic.value_norm.mean)
    assert_values_close(worker.compute_values(batch) - mean, values - mean)
    worker.update_critic({**batch, "returns": returns})  # a step starts from the rescaled masters
    assert all(torch.equal(p, worker.optimizer.masters[p].bfloat16()) for p in worker.model.parameters())


def test_popart_rescales_the_float32_average_of_the_head_under_ema_decay():
    """PopArt + `ema_decay` under bf16 parameters: the average (float32, of the masters) has its head rescaled as the
    float32 path's is, so the values served (the average's, rounded into the bf16 parameters) keep their raw values."""
    reference, worker, batch, _, values = popart_merged(ema_decay=0.9)
    expected = dict(zip(reference.critic.ema.names, reference.critic.ema.average, strict=True))
    average = dict(zip(worker.critic.ema.names, worker.critic.ema.average, strict=True))
    head = [n for n in average if n.startswith("score.")]
    assert head and all(average[n].dtype == torch.float32 for n in head)
    # the same float32 average, rescaled in float64 and stored in float32 on both sides: the same bits; a head left
    # unrescaled would differ by ~σ (10 here)
    assert all(torch.equal(average[n], expected[n]) for n in head)
    mean = float(worker.critic.value_norm.mean)  # the bound of the test above: roundings of (value − μ) / σ's size
    assert_values_close(worker.compute_values(batch) - mean, values - mean)


def test_a_value_head_of_float32_is_stepped_as_it_is():
    worker = CriticWorker(bf16(model={**config()["model"], "value_head_dtype": "float32"}), device="cpu")
    head = [p for n, p in worker.model.named_parameters() if n.startswith("score.")]
    assert head and all(p.dtype == torch.float32 and p not in worker.optimizer.masters for p in head)
    before = [p.detach().clone() for p in head]
    assert worker.update_critic(make_batch(8, 6, 5, seed=5))["critic/skipped_steps"] == 0
    assert all(not torch.equal(p, b) for p, b in zip(head, before, strict=True))


def test_the_clipping_norm_is_taken_in_float32_on_the_masters_gradients():
    model = nn.Linear(64, 64)
    masters = store_in(model, torch.bfloat16)
    optimizer = MasterWeightOptimizer([{"params": list(model.parameters())}], masters, torch.optim.SGD)
    grads = [torch.randn_like(p) for p in model.parameters()]  # bf16 gradients
    for param, grad in zip(model.parameters(), grads, strict=True):
        param.grad = grad.clone()
    norm = clip_grad_norm(model, 0.5, optimizer)
    assert norm.dtype == torch.float32
    assert float(norm) == pytest.approx(float(torch.cat([g.float().flatten() for g in grads]).norm()), rel=1e-6)
    assert all(p.grad is None for p in model.parameters())  # moved into the masters: float32, clipped there
    clipped = torch.cat([m.grad.flatten() for m in masters.values()])
    assert clipped.dtype == torch.float32 and float(clipped.norm()) == pytest.approx(0.5, rel=1e-5)


def test_ddp_reduces_the_bf16_gradients_and_steps_the_masters(one_process_group):
    from torch.nn.parallel import DistributedDataParallel

    batch = make_batch(8, 6, 5, seed=6)
    ddp, plain = CriticWorker(bf16(strategy="ddp"), device="cpu"), CriticWorker(bf16(), device="cpu")
    assert isinstance(ddp.model, DistributedDataParallel)
    assert {p.dtype for p in ddp.model.parameters()} == {torch.bfloat16}
    ddp.update_critic(batch), plain.update_critic(batch)
    # one process: DDP's bf16 all-reduce over one rank changes nothing, the same update
    assert all(torch.equal(a, b) for a, b in zip(weights(ddp).values(), weights(plain).values(), strict=True))


@pytest.mark.cuda
def test_bf16_parameters_on_cuda_match_the_float32_weights_under_autocast():
    batch = make_batch(8, 6, 5, seed=7)
    reference = CriticWorker(config(dtype="bfloat16"), device="cuda")  # today's default on a GPU
    worker = CriticWorker(bf16(), device="cuda")
    assert {p.dtype for p in worker.model.parameters()} == {torch.bfloat16}
    assert all(m.device.type == "cuda" and m.dtype == torch.float32 for m in worker.optimizer.masters.values())
    before = {n: t.cpu() for n, t in weights(reference).items()}
    assert_values_close(worker.compute_values(batch), reference.compute_values(batch))
    worker.update_critic(batch), reference.update_critic(batch)
    got, expected = (({n: t.cpu() for n, t in weights(w).items()}) for w in (worker, reference))
    assert update_error(got, expected, before) <= BF16_TOL
