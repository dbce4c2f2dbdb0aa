"""`critic.ema_decay`: the moving average of the weights that `compute_values`, checkpoints and the export use."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import exported_values, make_batch, state_hash, tiny_config
from ppo_critic import CriticConfig, DataParallelPPOCritic
from ppo_critic.critics.ema import ParameterEMA
from ppo_critic.worker import CriticWorker

pytestmark = pytest.mark.usefixtures("one_thread")

WORKER = {
    "strategy": "none",
    "ppo_mini_batch_size": 4,  # two optimizer steps per update: the average moves twice
    "cliprange_value": None,
    "ema_decay": 0.5,
    "model": {"override_config": tiny_config("qwen2"), "value_head_init": "normal:0.2"},
    "optim": {"lr": 1e-2},
}


LR = WORKER["optim"]["lr"]
EMA_ULPS = 2 * 2.0**-23  # two float32 ulps, relative to the weight (an ulp of x is <= 2**-23·|x|)


def config(**changes):
    return {**copy.deepcopy(WORKER), **changes}


def test_the_average_moves_toward_the_parameters_and_a_double_swap_restores_both():
    layer = nn.Linear(3, 2)
    layer.bias.requires_grad_(False)  # frozen parameters get no average
    ema = ParameterEMA(layer, 0.75)
    assert ema.names == ["weight"] and torch.equal(ema.average[0], layer.weight)
    start = layer.weight.detach().clone()
    with torch.no_grad():
        layer.weight.add_(4.0)
    ema.update()
    # 0.75·w + 0.25·(w + 4): lerp rounds w + 4, the difference and the sum (<= 0.5 ulp of 4, 4 and 1; the first two
    # scaled by 0.25): <= 2e-7, well inside assert_close's float32 default (atol 1e-5, rtol 1.3e-6)
    torch.testing.assert_close(ema.average[0], start + 1.0)
    live, average = layer.weight.detach().clone(), ema.average[0].clone()
    with ema.applied():
        assert torch.equal(layer.weight, average) and torch.equal(ema.average[0], live)
    assert torch.equal(layer.weight, live) and torch.equal(ema.average[0], average)
    assert set(ema.state_dict()) == {"ema/weight"}
    with pytest.raises(ValueError, match=r"critic.ema_decay=1.0 must be in \(0, 1\)"):
        ParameterEMA(layer, 1.0)


def test_restart_starts_the_average_over_from_the_live_weights():
    layer = nn.Linear(3, 2)
    ema = ParameterEMA(layer, 0.9, warmup=True)
    for _ in range(3):
        with torch.no_grad():
            layer.weight.add_(1.0)
        ema.update()
    assert not torch.equal(ema.average[0], layer.weight) and int(ema.updates) == 3
    ema.restart()
    assert torch.equal(ema.average[0], layer.weight) and int(ema.updates) == 0  # warmup's short memory again
    assert ema.current_decay() == pytest.approx(0.1)


def test_the_worker_restarts_the_average_only_under_ema_decay():
    with_ema, without = CriticWorker(config(), device="cpu"), CriticWorker(config(ema_decay=0.0), device="cpu")
    batch = make_batch(8, 6, 5, seed=0)
    with_ema.update_critic(batch)
    with torch.no_grad():
        live = with_ema.critic.compute_values(batch)  # the average's values
    assert with_ema.restart_average() and not without.restart_average()
    with with_ema.critic.live_weights():
        expected = with_ema.compute_values(batch)
    restarted = with_ema.compute_values(batch)
    assert not torch.equal(live, restarted) and torch.equal(restarted, expected)


def test_an_update_while_the_live_weights_serve_still_moves_the_average():
    """`live_weights` changes which weights compute_values runs, not the average: an update inside it moves the
    average as one outside does (the same bits), and values outside come from the average again."""
    inside, outside = CriticWorker(config(), device="cpu"), CriticWorker(config(), device="cpu")
    batch = make_batch(8, 6, 5, seed=1)
    with inside.critic.live_weights():
        inside.update_critic(batch)
        live = inside.compute_values(batch)
    outside.update_critic(batch)
    assert int(inside.critic.ema.updates) == 2  # two optimizer steps (two mini-batches), each averaged
    assert all(torch.equal(a, b) for a, b in zip(inside.critic.ema.average, outside.critic.ema.average, strict=True))
    assert torch.equal(inside.compute_values(batch), outside.compute_values(batch))
    assert not torch.equal(live, outside.compute_values(batch))  # inside, the live weights served


def test_compute_values_uses_the_average_and_training_the_live_weights_is_unchanged():
    with_ema, without = CriticWorker(config(), device="cpu"), CriticWorker(config(ema_decay=0.0), device="cpu")
    batch = make_batch(8, 6, 5, seed=0)
    first = with_ema.compute_values(batch)
    assert torch.equal(first, without.compute_values(batch))  # nothing learnt yet: average == weights
    a, b = with_ema.update_critic(batch), without.update_critic(batch)
    assert state_hash(with_ema.model, with_ema.optimizer) == state_hash(without.model, without.optimizer)
    assert a["critic/vf_loss"] == b["critic/vf_loss"] and a["critic/grad_norm"] == b["critic/grad_norm"]

    # the average after two steps from w0: 0.5·(0.5·w0 + 0.5·w1) + 0.5·w2, computed independently
    live = {n: p.detach().clone() for n, p in with_ema.model.named_parameters()}
    ema = with_ema.critic.ema
    expected_values = _values_with(without, dict(zip(ema.names, ema.average, strict=True)), batch)
    values = with_ema.compute_values(batch)
    assert torch.equal(values, expected_values)
    assert not torch.allclose(values, without.compute_values(batch))  # it is not the live model
    assert all(torch.equal(p, live[n]) for n, p in with_ema.model.named_parameters())  # live weights back


def _values_with(worker, weights, batch):
    model = copy.deepcopy(worker.model)
    model.load_state_dict(weights, strict=False)
    return DataParallelPPOCritic(worker.critic.config, model, None).compute_values(batch)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_the_average_follows_each_optimizer_step():
    worker = CriticWorker(config(ema_decay=0.5), device="cpu")
    names = worker.critic.ema.names
    snapshots = [{n: p.detach().clone() for n, p in worker.model.named_parameters()}]
    step = worker.optimizer.step

    def recording_step(*args, **kwargs):
        out = step(*args, **kwargs)
        snapshots.append({n: p.detach().clone() for n, p in worker.model.named_parameters()})
        return out

    worker.optimizer.step = recording_step
    worker.update_critic(make_batch(8, 6, 5, seed=1))
    assert len(snapshots) == 3
    for name, average in zip(names, worker.critic.ema.average, strict=True):
        w0, w1, w2 = (s[name] for s in snapshots)
        # float32: each side rounds twice at <= 0.5 ulp (the two lerp(·, ·, 0.5) steps; the reference's two sums;
        # the products by 0.5 and 0.25 and lerp's differences of nearby weights are exact), so they differ by
        # <= 2 ulp(|w|) <= 2·2**-23·|w|; the intermediates differ from the final |w| by the two steps (< 2·lr each).
        torch.testing.assert_close(average, 0.25 * w0 + 0.25 * w1 + 0.5 * w2, rtol=EMA_ULPS, atol=EMA_ULPS * 4 * LR)


def test_a_skipped_step_leaves_the_average_alone():
    worker = CriticWorker(config(), device="cpu")
    before = [a.clone() for a in worker.critic.ema.average]
    batch = make_batch(8, 6, 5, seed=0)
    batch["returns"] = torch.full_like(batch["returns"], 3e38)  # overflowing loss: both steps skipped
    metrics = worker.update_critic(batch)
    assert metrics["critic/skipped_steps"] == 2
    assert all(torch.equal(a, b) for a, b in zip(worker.critic.ema.average, before, strict=True))


def test_the_average_survives_checkpoint_resume_and_the_export_gives_its_values(tmp_path):
    cfg = config(value_norm="running")
    worker = CriticWorker(cfg, device="cpu")
    for seed in range(2):
        batch = make_batch(8, 6, 5, seed=seed)
        batch["values"] = worker.compute_values(batch)
        worker.update_critic(batch)
    path = worker.save_checkpoint(tmp_path / "ckpt")
    resumed = CriticWorker(cfg, device="cpu", seed=1)  # other weights, another average
    resumed.load_checkpoint(path)
    for a, b in zip(worker.critic.ema.average, resumed.critic.ema.average, strict=True):
        assert torch.equal(a, b)
    batch = make_batch(8, 6, 5, seed=5)
    batch["values"] = worker.compute_values(batch)
    assert torch.equal(resumed.compute_values(batch), batch["values"])
    worker.update_critic(batch), resumed.update_critic(batch)
    assert torch.equal(resumed.compute_values(batch), worker.compute_values(batch))

    worker.export_hf(tmp_path / "hf")
    got = exported_values(tmp_path / "hf", batch)
    # the HF padded forward of the exported average (value-norm statistics folded into the head: one rounding per
    # weight) vs the critic's own path: the same sums in another order, conftest.FP32_REORDERED; the looser atol
    # is for values near 0 on the de-normalised scale (σ of the returns)
    torch.testing.assert_close(got, worker.compute_values(batch), rtol=1e-5, atol=1e-4)


def test_warmup_ramps_the_decay_up_and_resumes_where_it_was(tmp_path):
    layer = nn.Linear(2, 1, bias=False)
    ema = ParameterEMA(layer, 0.9, warmup=True)
    decays = []
    for _ in range(82):
        decays.append(ema.current_decay())
        ema.update()
    # (1 + k) / (10 + k): 0.1 at the first update, 0.55 at the 11th, ema_decay (0.9) from k = 80 on
    assert decays[:2] == [0.1, 2 / 11] and decays[10] == 0.55 and decays[79] < 0.9 and decays[80:] == [0.9, 0.9]
    start = layer.weight.detach().clone()
    fresh = ParameterEMA(layer, 0.9, warmup=True)
    with torch.no_grad():
        layer.weight.add_(10.0)
    fresh.update()  # the first update moves 90 % of the way (without warmup: 10 %)
    torch.testing.assert_close(fresh.average[0], start + 9.0)  # a few float32 roundings of numbers <= 20: ~1e-6
    assert set(fresh.state_dict()) == {"ema/weight", "ema/_updates"} and int(fresh.updates) == 1
    assert set(ParameterEMA(layer, 0.9).state_dict()) == {"ema/weight"}  # without warmup: no counter

    cfg = config(ema_warmup=True)
    worker = CriticWorker(cfg, device="cpu")
    worker.update_critic(make_batch(8, 6, 5, seed=0))  # two optimizer steps
    path = worker.save_checkpoint(tmp_path / "ckpt")
    resumed = CriticWorker(cfg, device="cpu", seed=1)
    resumed.load_checkpoint(path)
    assert int(resumed.critic.ema.updates) == 2 and resumed.critic.ema.current_decay() == 3 / 12
    batch = make_batch(8, 6, 5, seed=5)
    worker.update_critic(batch), resumed.update_critic(batch)
    assert torch.equal(resumed.compute_values(batch), worker.compute_values(batch))


def test_a_lora_critic_averages_only_what_it_trains():
    pytest.importorskip("peft")
    worker = CriticWorker(config(model={**WORKER["model"], "lora_rank": 4}), device="cpu")
    names = worker.critic.ema.names
    assert names and all("lora_" in n or n.endswith(("score.weight", "score.bias")) for n in names)
    worker.update_critic(make_batch(8, 6, 5, seed=0))
    values = worker.compute_values(make_batch(8, 6, 5, seed=3))
    assert torch.isfinite(values).all()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"ema_decay": 1.0}, r"ema_decay=1.0 must be a number in \[0, 1\)"),
        ({"ema_decay": -0.1}, r"ema_decay=-0.1 must be a number in \[0, 1\)"),
        ({"ema_decay": "0.9x"}, r"ema_decay='0.9x' must be a number"),
        ({"ema_decay": True}, r"ema_decay=True must be a number"),
        ({"ema_decay": 0.9, "strategy": "fsdp"}, r"ema_decay > 0 is not supported with strategy=fsdp"),
        ({"ema_warmup": True}, r"ema_warmup=true needs ema_decay > 0"),
        ({"ema_decay": 0.9, "ema_warmup": "yes"}, r"ema_warmup='yes' must be true or false"),
    ],
)
def test_bad_ema_settings_name_the_key_and_the_fix(changes, message):
    with pytest.raises(ValueError, match=message):
        CriticConfig.from_any({"ppo_mini_batch_size": 4, **changes})


def test_an_fsdp1_module_is_refused_before_anything_changes(monkeypatch):
    import torch.distributed.fsdp as fsdp

    class FakeFSDP1(nn.Linear):  # what the critic checks is the class; a real FSDP1 module needs a process group
        pass

    monkeypatch.setattr(fsdp, "FullyShardedDataParallel", FakeFSDP1)
    module = FakeFSDP1(2, 1)
    before = state_hash(module)
    with pytest.raises(ValueError, match="ema_decay > 0 is not supported with FSDP1"):
        DataParallelPPOCritic({"ppo_mini_batch_size": 4, "ema_decay": 0.9}, module, None)
    assert state_hash(module) == before
