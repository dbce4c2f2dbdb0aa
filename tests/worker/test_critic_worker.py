"""CriticWorker: model from config, per-rank sizes, LR schedule, checkpoint round trip."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY, make_batch, state_hash
from ppo_critic.config.critic import CriticConfig, OptimConfig, RankSizes
from ppo_critic.worker import CriticWorker, lr_schedule


def worker_config(**optim) -> dict:
    return {
        "ppo_mini_batch_size": 4,
        "ppo_micro_batch_size_per_gpu": 2,
        "model": {"override_config": {"model_type": "qwen2", **TINY}},
        "optim": {"lr": 1e-2, **optim},
    }


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    f = lr_schedule(OptimConfig(warmup_style="cosine", lr_warmup_steps=4, min_lr_ratio=0.1), total_steps=14)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # float64, the same formula with its cos: a few roundings of 2**-53; approx's default rel=1e-6 is far above
    # that, and a wrong schedule step is off by > 1e-2
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    constant = lr_schedule(OptimConfig(lr_warmup_steps_ratio=0.5), total_steps=10)
    assert [constant(s) for s in (0, 4, 5, 50)] == [0.2, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="total_training_steps"):
        lr_schedule(OptimConfig(warmup_style="cosine"), total_steps=None)


def test_rank_sizes_divide_global_sizes():
    cfg = CriticConfig(ppo_mini_batch_size=16, rollout_n=2, ppo_micro_batch_size=8, forward_micro_batch_size=16)
    rank = RankSizes.over_ranks(cfg, dp_size=4)
    assert rank.mini_batch == 8
    assert (rank.micro_batch, rank.forward_micro_batch) == (2, 4)
    assert (cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size, cfg.forward_micro_batch_size) == (16, 8, 16)  # as set
    with pytest.raises(ValueError, match="not divisible by the 3 data-parallel ranks"):
        RankSizes.over_ranks(CriticConfig(ppo_mini_batch_size=16), dp_size=3)


def test_per_rank_micro_batches_follow_verls_worker():
    """No micro-batch size: one micro-batch per rank's mini-batch, at any DP size that divides the global batch;
    a per-GPU size larger than a rank's share is refused naming the key the user set and the sizes involved."""
    for dp in (1, 2, 4, 8):
        rank = RankSizes.over_ranks(CriticConfig(ppo_mini_batch_size=96), dp)
        assert (rank.micro_batch, rank.forward_micro_batch) == (96 // dp, 96 // dp)
    msg = r"critic.ppo_micro_batch_size_per_gpu=96 does not divide the per-GPU mini-batch of 48 rows .*over 2"
    with pytest.raises(ValueError, match=msg):
        RankSizes.over_ranks(CriticConfig(ppo_mini_batch_size=96, ppo_micro_batch_size_per_gpu=96), dp_size=2)
    with pytest.raises(ValueError, match=r"critic.ppo_micro_batch_size=12 does not divide .* of 8 rows"):
        RankSizes.over_ranks(CriticConfig(ppo_mini_batch_size=16, ppo_micro_batch_size=12), dp_size=2)


def test_each_rank_takes_its_share_of_every_mini_batch_and_of_a_short_last_one():
    """Rows of a global batch of 10 in mini-batches of 4 over 2 ranks: 2 of each full block, 1 of the short one."""
    shares = [CriticWorker._shard(_rank_view(rank, 2), 10, 4).tolist() for rank in (0, 1)]
    assert shares == [[0, 1, 4, 5, 8], [2, 3, 6, 7, 9]]
    assert [CriticWorker._shard(_rank_view(r, 3), 4, 4).tolist() for r in range(3)] == [[0, 1], [2], [3]]
    with pytest.raises(ValueError, match="a batch of 1 rows cannot be split over 2 data-parallel ranks; send at least"):
        CriticWorker._shard(_rank_view(1, 2), 1, 4)


def _rank_view(rank: int, dp_size: int) -> SimpleNamespace:
    """What `CriticWorker._shard` reads of a worker: its DP size and rank."""
    return SimpleNamespace(dp_size=dp_size, layout=SimpleNamespace(dp_rank=rank))


def test_model_needs_a_path_or_a_full_config():
    with pytest.raises(ValueError, match=r"critic\.model\.path is not set"):
        CriticWorker({"ppo_mini_batch_size": 4, "model": {"override_config": {"hidden_size": 64}}})


def test_update_steps_the_schedule_and_reports_the_lr_it_used():
    worker = CriticWorker(worker_config(warmup_style="cosine", lr_warmup_steps=2), total_steps=4)
    batch = make_batch(8, 6, 5)
    lrs = [worker.update_critic(batch)["critic/lr"] for _ in range(4)]
    # lr x the schedule's float64 factor: a few roundings of 2**-53 apart (approx's default rel=1e-6)
    assert lrs == pytest.approx([5e-3, 1e-2, 1e-2, 1e-2 * 0.5 * (1 + math.cos(math.pi * 0.5))])
    assert worker.step == 4


def test_lr_scale_raises_one_updates_rate_and_the_schedule_sets_the_next():
    """`update_critic(lr_scale=...)`: trainer.surprise_lr_scale's raised rate, for that update alone."""
    worker = CriticWorker(worker_config(value_head_lr_ratio=10), total_steps=4)
    batch = make_batch(8, 6, 5)
    assert worker.update_critic(batch, lr_scale=3.0)["critic/lr"] == pytest.approx(3e-2)
    assert [g["lr"] for g in worker.optimizer.param_groups] == pytest.approx([1e-2, 1e-1])  # the schedule's again
    assert worker.update_critic(batch)["critic/lr"] == pytest.approx(1e-2)
    with pytest.raises(ValueError):  # a refused batch leaves the scheduled rates, not the raised ones
        worker.update_critic({k: v for k, v in batch.items() if k != "returns"}, lr_scale=3.0)
    assert [g["lr"] for g in worker.optimizer.param_groups] == pytest.approx([1e-2, 1e-1])


def _head_and_body(worker: CriticWorker) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    head = {id(p) for p in worker.model.score.parameters()}
    params = [p.detach().clone() for p in worker.model.parameters()]
    return (
        [c for p, c in zip(worker.model.parameters(), params, strict=True) if id(p) in head],
        [c for p, c in zip(worker.model.parameters(), params, strict=True) if id(p) not in head],
    )


def test_value_head_lr_ratio_scales_only_the_heads_step():
    # SGD without weight decay: a step is -lr·g, so the same gradient under lr and 10·lr gives steps 10x apart up
    # to roundings: lr·g (rel 2**-24) and the new parameter (abs ulp(p)/2 <= |p|·2**-24); the measured step p1 - p0
    # is then exact (Sterbenz). Compared as fast vs 10·slow: abs error <= 11·max|p|·2**-24, rel 2·2**-24
    configs = {ratio: worker_config(optimizer="sgd", weight_decay=0.0, value_head_lr_ratio=ratio) for ratio in (1, 10)}
    batch = make_batch(8, 6, 5)
    steps = {}
    for ratio, config in configs.items():
        worker = CriticWorker({**config, "ppo_mini_batch_size": 8}, total_steps=4)  # one optimizer step
        head0, body0 = _head_and_body(worker)  # the same init (seed) in both workers
        worker.update_critic(batch)
        head1, body1 = _head_and_body(worker)
        steps[ratio] = (
            [b - a for a, b in zip(head0, head1, strict=True)],
            [b - a for a, b in zip(body0, body1, strict=True)],
        )
        groups = worker.optimizer.param_groups
        assert len(groups) == (1 if ratio == 1 else 2)
        assert groups[-1]["lr"] == pytest.approx(1e-2 * ratio)
    for fast, slow, param in zip(steps[10][0], steps[1][0], head0, strict=True):
        assert slow.abs().max() > 0
        largest = (param.abs() + fast.abs()).max().item()  # bounds |p| before and after either step
        torch.testing.assert_close(fast, 10 * slow, rtol=2 * 2**-24, atol=11 * largest * 2**-24)
    assert all(torch.equal(a, b) for a, b in zip(steps[10][1], steps[1][1], strict=True))  # the body: same step


def test_value_head_lr_ratio_follows_the_schedule_and_a_new_rate():
    worker = CriticWorker(worker_config(value_head_lr_ratio=4.0, lr_warmup_steps=2), total_steps=4)
    batch = make_batch(8, 6, 5)
    body, head = worker.optimizer.param_groups
    assert (body["lr"], head["lr"]) == pytest.approx((5e-3, 2e-2))  # warmup step 1 of 2
    worker.update_critic(batch)
    assert (body["lr"], head["lr"]) == pytest.approx((1e-2, 4e-2))
    worker.set_learning_rate(1e-3)
    assert (body["lr"], head["lr"]) == pytest.approx((1e-3, 4e-3))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"optim": {"value_head_lr_ratio": 0.0}}, "optim.value_head_lr_ratio=0.0 must be a positive"),
        ({"optim": {"value_head_lr_ratio": float("inf")}}, "optim.value_head_lr_ratio=inf must be a positive"),
        ({"strategy": "megatron", "optim": {"value_head_lr_ratio": 2.0}}, "not supported with strategy=megatron"),
    ],
)
def test_value_head_lr_ratio_errors(settings, message):
    config = {**worker_config(), **settings, "optim": {"lr": 1e-2, **settings["optim"]}}
    with pytest.raises(ValueError, match=message):
        CriticConfig.from_any(config, worker=True)


def test_checkpoint_round_trip_restores_everything(tmp_path):
    worker = CriticWorker(worker_config(), total_steps=10)
    batch = make_batch(8, 6, 5)
    worker.update_critic(batch)
    generator = torch.Generator().manual_seed(5)
    path = worker.save_checkpoint(tmp_path, {"data/gen": generator.get_state()}, {"note": "hi"}, keep_last_n=2)
    expected = worker.update_critic(batch)
    after = state_hash(worker.model, worker.optimizer)

    fresh = CriticWorker(worker_config(), total_steps=10, seed=123)
    tensors, state = fresh.load_checkpoint(path, {"data/gen": torch.Generator().get_state()})
    assert fresh.step == 1 and state["note"] == "hi"
    assert torch.equal(tensors["data/gen"], generator.get_state())
    got = fresh.update_critic(batch)
    assert state_hash(fresh.model, fresh.optimizer) == after
    assert got["critic/vf_loss"] == expected["critic/vf_loss"] and got["critic/lr"] == expected["critic/lr"]


def test_keep_last_n_and_failed_writes_leave_the_previous_checkpoint(tmp_path, monkeypatch):
    import ppo_critic.run.checkpoint as ckpt

    worker = CriticWorker(worker_config(), total_steps=10)
    batch = make_batch(8, 6, 5)
    for _ in range(3):
        worker.update_critic(batch)
        worker.save_checkpoint(tmp_path, keep_last_n=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_00000002",
        "step_00000003",
    ]

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    worker.update_critic(batch)
    monkeypatch.setattr(ckpt.dcp, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        worker.save_checkpoint(tmp_path, keep_last_n=2)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("latest")) == [
        "step_00000002",
        "step_00000003",
    ]  # no temporary directory left behind
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000003"
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"


@pytest.mark.parametrize("value_norm", ["running", "popart"])
def test_a_critic_from_a_model_path_exports_its_normalised_head(tmp_path, value_norm):
    """A critic loaded from `model.path` (as a value-pretraining run starts from the SFT model) exports with the return
    statistics folded into its head: the export's values are the critic's raw values (transformers 5 refused to
    build the export's skeleton from the path on the meta device)."""
    from transformers import AutoModelForTokenClassification

    from ppo_critic import build_value_model

    build_value_model({"model_type": "qwen2", **TINY}).save_pretrained(tmp_path / "sft")
    config = worker_config() | {"value_norm": value_norm, "model": {"path": str(tmp_path / "sft")}}
    worker = CriticWorker(config, total_steps=2)
    batch = make_batch()
    batch["returns"] = batch["returns"] * 3 + 5  # statistics far from μ = 0, σ = 1
    worker.update_critic(batch)
    worker.export_hf(tmp_path / "export")
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "export")
    exported_critic = CriticWorker(worker_config() | {"model": {"path": str(tmp_path / "export")}})
    # the same weights and float32 math, the head folded in float64: values of magnitude ~5 agree to float32 rounding
    torch.testing.assert_close(
        exported_critic.compute_values(batch), worker.compute_values(batch), rtol=1e-5, atol=1e-5
    )
    assert exported.config.num_labels == 1
