"""DataParallelPPOCritic, single process: alignment, global normalisation, skips, metrics, bad input."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torch import nn

from conftest import FakeDataProto, edited, make_batch, state_hash, tiny_config, without_timings
from ppo_critic import DataParallelPPOCritic, build_value_model
from ppo_critic.algos import LOSS_AGG_MODES, compute_value_loss, explained_variance, masked_mean
from ppo_critic.config.critic import CriticConfig
from ppo_critic.data.batching import dynamic_micro_batches
from ppo_critic.models.attention import VARLEN
from ppo_critic.parallel.mesh import compute_dtype


class IdsAsValues(nn.Module):
    """Outputs input_ids as the value at every position: values reveal alignment and row order."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        assert use_cache is False
        return SimpleNamespace(logits=(input_ids.float() * self.scale).unsqueeze(-1))


def DataProtoStandIn(tensors: dict, meta_info: dict | None = None) -> FakeDataProto:
    """A verl-DataProto-shaped object holding `tensors`, a per-sample uid and `meta_info`."""
    b = tensors["input_ids"].shape[0]
    uid = {"uid": np.array([f"id{i}" for i in range(b)], dtype=object)}
    return FakeDataProto(TensorDict(tensors, batch_size=[b]), uid, meta_info or {})


def make_critic(model, optimizer=None, **cfg):
    config = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 2, "grad_clip": None, **cfg}
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    return DataParallelPPOCritic(config, model, optimizer)


def numbered_batch(batch_size=6, prompt_len=5, response_len=4):
    batch = make_batch(batch_size, prompt_len, response_len, seed=3)
    t = prompt_len + response_len
    batch["input_ids"] = torch.arange(batch_size * t).view(batch_size, t)
    batch["responses"] = batch["input_ids"][:, -response_len:]
    return batch


@pytest.mark.parametrize("dynamic", [False, True])
def test_values_are_read_at_the_position_before_each_response_token(dynamic):
    batch = numbered_batch()
    b, t = batch["input_ids"].shape
    r = batch["responses"].shape[1]
    critic = make_critic(IdsAsValues(), ppo_micro_batch_size_per_gpu=4, forward_micro_batch_size_per_gpu=4)
    meta = {"use_dynamic_bsz": True, "max_token_len": 12} if dynamic else {}
    values = critic.compute_values(DataProtoStandIn(batch, meta))
    mask = batch["attention_mask"][:, -r:].bool()
    expected = torch.arange(b)[:, None] * t + (t - r - 1) + torch.arange(r)[None, :]
    assert values.dtype == torch.float32 and values.device.type == "cpu"
    torch.testing.assert_close(values[mask], expected[mask].float(), rtol=0, atol=0)  # exact: integers < 2**24, copied
    assert (values[~mask] == 0).all() and (~mask).any()
    if dynamic:  # several micro-batches that are not in row order, yet rows come back in order
        groups = dynamic_micro_batches(batch["attention_mask"].sum(-1), 12)
        assert len(groups) > 2 and [i for g in groups for i in g] != list(range(b))


def one_update_delta(base_model, batch, **cfg):
    model = copy.deepcopy(base_model)
    before = [p.detach().clone() for p in model.parameters()]
    critic = make_critic(model, **cfg)
    metrics = critic.update_critic(batch)
    return torch.cat([(p.detach() - b0).flatten() for p, b0 in zip(model.parameters(), before, strict=True)]), metrics


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_global_normalisation_makes_the_update_independent_of_micro_batching(tiny_qwen2, mode):
    """SGD (not Adam, whose first step hides the gradient's scale) and no clipping: any normalisation error shows."""
    base = tiny_qwen2()
    batch = make_batch(8, 7, 6, seed=1)
    batch["response_mask"] = batch["attention_mask"][:, -6:].clone()
    batch["response_mask"][2] = 0  # a fully masked row
    ref, ref_metrics = one_update_delta(base, batch, ppo_micro_batch_size_per_gpu=8, loss_agg_mode=mode)
    assert ref.norm() > 0
    lens = batch["attention_mask"].sum(-1)
    layouts = [{"ppo_micro_batch_size_per_gpu": 1}, {"ppo_micro_batch_size_per_gpu": 2}]
    for budget in (int(lens.max()), int(lens.max()) * 3):
        assert len(dynamic_micro_batches(lens, budget)) > 1
        layouts.append({"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": budget})
    for layout in layouts:
        delta, metrics = one_update_delta(base, batch, loss_agg_mode=mode, **layout)
        rel = ((delta - ref).norm() / ref.norm()).item()
        # the same gradient summed over other micro-batches: fp32 reordering, conftest.FP32_REORDERED (DESIGN §6)
        assert rel <= 1e-5, (layout, rel)
        assert metrics["critic/vf_loss"] == pytest.approx(ref_metrics["critic/vf_loss"], rel=1e-5)


def test_global_normalisation_differs_from_per_micro_batch_means(tiny_qwen2):
    """The invariance above is not vacuous: averaging per-micro-batch means gives a different gradient."""
    model = tiny_qwen2()
    batch = make_batch(8, 7, 6, seed=1)
    critic = make_critic(model)
    vpreds = torch.cat([critic._forward_micro_batch(critic_batch) for critic_batch in _split(batch, 2)])
    mask = batch["attention_mask"][:, -6:]
    whole, _ = compute_value_loss(vpreds, batch["returns"], batch["values"], mask, 0.5)
    halves = [
        compute_value_loss(
            vpreds[i : i + 2], batch["returns"][i : i + 2], batch["values"][i : i + 2], mask[i : i + 2], 0.5
        )[0]
        for i in range(0, 8, 2)
    ]
    assert abs(whole.item() - torch.stack(halves).mean().item()) > 1e-4  # >> float32 rounding (~1e-7) of O(1) losses


def _split(batch, size):
    from ppo_critic.data.batch import Batch

    return Batch.from_any(batch).split(size)


def test_metrics_follow_their_documented_meaning(tiny_qwen2):
    model = tiny_qwen2()
    batch = make_batch(8, 6, 5, seed=2)
    critic = make_critic(model, ppo_micro_batch_size_per_gpu=4)
    old = critic.compute_values(batch)
    mask = batch["attention_mask"][:, -5:]
    expected_loss, expected_clipfrac = compute_value_loss(old, batch["returns"], batch["values"], mask, 0.5)
    metrics = critic.update_critic(batch)
    # the critic sums the same float32 terms over its micro-batches and steps, the reference over the whole batch:
    # conftest.FP32_REORDERED; abs=1e-7 where the mean may be ~0. Min and max are the same floats: approx's default.
    assert metrics["critic/vf_loss"] == pytest.approx(expected_loss.item(), rel=1e-5)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(expected_clipfrac.item(), rel=1e-5)
    assert metrics["critic/vpred_mean"] == pytest.approx(masked_mean(old, mask).item(), rel=1e-5, abs=1e-7)
    ev = explained_variance(batch["values"], batch["returns"], mask).item()
    assert metrics["critic/vf_explained_var"] == pytest.approx(ev, rel=1e-5)
    valid = batch["values"][mask.bool()]
    assert metrics["critic/values_min"] == pytest.approx(valid.min().item())
    assert metrics["critic/values_max"] == pytest.approx(valid.max().item())
    assert metrics["critic/values_mean"] == pytest.approx(valid.mean().item(), rel=1e-5)
    assert metrics["critic/lr"] == 0.1 and metrics["critic/skipped_steps"] == 0
    assert metrics["critic/grad_norm"] > 0 and metrics["perf/tokens_per_s"] > 0
    assert all(isinstance(v, float) for v in metrics.values())


def test_vf_loss_is_the_mean_over_steps(tiny_qwen2):
    model = tiny_qwen2()
    batch = make_batch(8, 6, 5, seed=2)
    critic = make_critic(copy.deepcopy(model), ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4)
    losses = []
    probe = make_critic(copy.deepcopy(model), ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4)
    for rows in (slice(0, 4), slice(4, 8)):
        losses.append(probe.update_critic({k: v[rows] for k, v in batch.items()})["critic/vf_loss"])
    assert critic.update_critic(batch)["critic/vf_loss"] == pytest.approx(sum(losses) / 2, rel=1e-5)  # FP32_REORDERED


def test_fully_masked_micro_batch_gives_no_nan(tiny_qwen2):
    model = tiny_qwen2()
    batch = make_batch(8, 6, 5, seed=4)
    batch["response_mask"] = batch["attention_mask"][:, -5:].clone()
    batch["response_mask"][:2] = 0  # the first micro-batch has no valid token
    batch["returns"][:2] = float("nan")  # and garbage targets there are ignored
    critic = make_critic(model)
    metrics = critic.update_critic(batch)
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    assert metrics["critic/skipped_steps"] == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fully_masked_batch_is_a_no_op_step(tiny_qwen2):
    model = tiny_qwen2()
    batch = make_batch(8, 6, 5, seed=4)
    batch["response_mask"] = torch.zeros(8, 5, dtype=torch.long)
    before = state_hash(model)
    metrics = make_critic(model).update_critic(batch)
    assert state_hash(model) == before  # zero gradient, SGD without weight decay
    assert metrics["critic/vf_loss"] == 0 and all(np.isfinite(v) for v in metrics.values())


def test_non_finite_gradient_skips_the_step_and_training_continues(tiny_qwen2):
    model = tiny_qwen2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    critic = make_critic(model, optimizer=optimizer)
    batch = make_batch(8, 6, 5, seed=5)
    critic.update_critic(batch)  # optimizer state exists now
    before = state_hash(model, optimizer)
    handle = model.score.weight.register_hook(lambda g: g * float("inf"))
    metrics = critic.update_critic(batch)
    handle.remove()
    assert metrics["critic/skipped_steps"] == 1
    assert state_hash(model, optimizer) == before
    assert all(p.grad is None for p in model.parameters())
    metrics = critic.update_critic(batch)
    assert metrics["critic/skipped_steps"] == 0 and np.isfinite(metrics["critic/grad_norm"])
    assert state_hash(model, optimizer) != before


def test_non_finite_loss_with_a_finite_gradient_skips_the_step(tiny_qwen2):
    """Old values near the float32 limit saturate the clipped error: the loss is inf, its gradient 0."""
    model = tiny_qwen2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    critic = make_critic(model, optimizer=optimizer)
    batch = make_batch(8, 6, 5, seed=5)
    critic.update_critic(batch)
    before = state_hash(model, optimizer)
    saturated = edited(batch, values=torch.full_like(batch["values"], 3e38), returns=torch.zeros_like(batch["returns"]))
    metrics = critic.update_critic(saturated)
    assert metrics["critic/skipped_steps"] == 1 and not np.isfinite(metrics["critic/vf_loss"])
    assert state_hash(model, optimizer) == before
    assert critic.update_critic(batch)["critic/skipped_steps"] == 0


def test_dataproto_meta_info_overrides_forward_settings(tiny_qwen2, monkeypatch):
    model = tiny_qwen2()
    batch = make_batch(8, 6, 5, seed=6)
    critic = make_critic(model, forward_micro_batch_size_per_gpu=8)
    calls = []
    forward = critic._forward_micro_batch
    monkeypatch.setattr(critic, "_forward_micro_batch", lambda mb: calls.append(len(mb)) or forward(mb))
    plain = critic.compute_values(DataProtoStandIn(batch))
    assert calls == [8]
    calls.clear()
    split = critic.compute_values(DataProtoStandIn(batch, {"micro_batch_size": 3}))
    assert calls == [3, 3, 2]
    # other micro-batches, other padded widths: fp32 reordering (conftest.FP32_REORDERED); |values| <= 0.34 here
    torch.testing.assert_close(split, plain, rtol=1e-5, atol=1e-6)
    calls.clear()
    longest = int(batch["attention_mask"].sum(-1).max())
    dynamic = critic.compute_values(DataProtoStandIn(batch, {"use_dynamic_bsz": True, "max_token_len": longest}))
    assert len(calls) == len(dynamic_micro_batches(batch["attention_mask"].sum(-1), longest)) > 1
    torch.testing.assert_close(dynamic, plain, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="budget"):
        critic.compute_values(DataProtoStandIn(batch, {"use_dynamic_bsz": True, "max_token_len": longest - 1}))
    metrics = critic.update_critic(DataProtoStandIn(batch))
    assert metrics["critic/skipped_steps"] == 0


def test_tensordict_and_dict_batches_give_the_same_values(tiny_qwen2):
    model = tiny_qwen2()
    batch = make_batch(4, 6, 5, seed=7)
    critic = make_critic(model, ppo_mini_batch_size=4)
    a, b = critic.compute_values(TensorDict(batch, batch_size=[4])), critic.compute_values(batch)
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # exact: the same tensors through the same code


def test_shuffled_epochs_are_deterministic(tiny_qwen2):
    base = tiny_qwen2()
    batch = make_batch(8, 6, 5, seed=8)
    cfg = {"ppo_mini_batch_size": 4, "ppo_epochs": 2, "shuffle": True, "data_loader_seed": 11}
    a, _ = one_update_delta(base, batch, **cfg)
    b, _ = one_update_delta(base, batch, **cfg)
    c, _ = one_update_delta(base, batch, **{**cfg, "data_loader_seed": 12})
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # exact: the same seed, the same order, the same sums
    assert (a - c).abs().max() > 0


def test_batch_is_moved_to_the_module_device(tiny_qwen2, monkeypatch):
    from ppo_critic.data.batch import Batch

    moved = []
    to = Batch.to
    monkeypatch.setattr(
        Batch, "to", lambda self, device, **kw: moved.append(torch.device(device)) or to(self, device, **kw)
    )
    critic = make_critic(tiny_qwen2())
    critic.update_critic(make_batch(8, 6, 5))
    critic.compute_values(make_batch(8, 6, 5))
    assert moved == [critic.device, critic.device]


@pytest.mark.cuda
def test_cpu_batch_runs_on_a_cuda_critic(tiny_qwen2):
    model = tiny_qwen2().cuda()
    critic = make_critic(model, dtype="float32")
    batch = make_batch(8, 6, 5)
    assert critic.compute_values(batch).device.type == "cpu"
    assert critic.update_critic(batch)["critic/skipped_steps"] == 0
    assert compute_dtype(CriticConfig().torch_dtype_name, torch.device("cuda")) == torch.bfloat16


def test_compute_dtype_defaults_and_overrides():
    assert compute_dtype(CriticConfig().torch_dtype_name, torch.device("cpu")) == torch.float32
    assert compute_dtype(CriticConfig().torch_dtype_name, torch.device("cuda")) == torch.bfloat16
    assert compute_dtype(CriticConfig(dtype="bf16").torch_dtype_name, torch.device("cpu")) == torch.bfloat16
    assert compute_dtype(CriticConfig(dtype="float32").torch_dtype_name, torch.device("cuda")) == torch.float32


def test_bf16_autocast_on_cpu_runs_and_returns_float32(tiny_qwen2):
    critic = make_critic(tiny_qwen2(), dtype="bfloat16")
    values = critic.compute_values(make_batch(8, 6, 5))
    assert values.dtype == torch.float32
    assert critic.update_critic(make_batch(8, 6, 5))["critic/skipped_steps"] == 0


def _bad_batches():
    good = make_batch(8, 6, 5, seed=9)

    def edit(**changes):
        return edited(good, **changes)

    nan_values = good["values"].clone()
    nan_values[0, 0] = float("nan")
    inf_returns = good["returns"].clone()
    inf_returns[1, 0] = float("inf")
    huge = torch.full((8, 5), 1e300, dtype=torch.float64)
    return _bad_model_inputs() | {
        "missing key": (edit(returns=None), "returns"),
        "float input_ids": (edit(input_ids=good["input_ids"].float()), "input_ids"),
        "attention_mask shape": (edit(attention_mask=good["attention_mask"][:, 1:]), "attention_mask"),
        "position_ids shape": (edit(position_ids=good["position_ids"][:4]), "position_ids"),
        "responses too long": (edit(responses=good["input_ids"]), "responses"),
        "responses empty": (edit(responses=good["input_ids"][:, :0]), "responses"),
        "values shape": (edit(values=good["values"][:, :3]), "values"),
        "returns shape": (edit(returns=good["returns"][:7]), "returns"),
        "response_mask shape": (edit(response_mask=good["attention_mask"]), "response_mask"),
        "empty batch": ({k: v[:0] for k, v in good.items()}, "empty"),
        "NaN in values": (edit(values=nan_values), "values"),
        "Inf in returns": (edit(returns=inf_returns), "returns"),
        "not a batch": ([1, 2, 3], "batch"),
        # issue 30: what only update_critic reads
        "meta returns": (edit(returns=good["returns"].to("meta")), r"batch\['returns'\] is on the meta device"),
        "sparse returns": (edit(returns=good["returns"].to_sparse()), r"batch\['returns'\] is a torch.sparse_coo"),
        "returns as numpy": (edit(returns=good["returns"].numpy()), r"batch\['returns'\] is a numpy.ndarray, not a"),
        "response_mask as numpy": (
            edit(response_mask=good["attention_mask"][:, -5:].numpy()),
            r"batch\['response_mask'\] is a numpy.ndarray, not a",
        ),
        "float64 returns of 1e300": (edit(returns=huge), r"batch\['returns'\] holds \d+ value\(s\) beyond ±3.12e\+144"),
        "float64 values of -1e300": (edit(values=-huge), r"batch\['values'\] holds \d+ value\(s\) beyond ±3.12e\+144"),
    }


def _bad_model_inputs():
    """Model inputs that compute_values and update_critic both refuse (issue 30), with what the message says."""
    good = make_batch(8, 6, 5, seed=9)

    def edit(**changes):
        return edited(good, **changes)

    empty_row = good["attention_mask"].clone()
    empty_row[3] = 0
    nan_positions = good["position_ids"].float()
    nan_positions[0, 6] = float("nan")  # the first response token: valid in every row
    return {
        "all-zero attention_mask row": (
            edit(attention_mask=empty_row),
            r"batch\['attention_mask'\] is all 0 in 1 of 8",
        ),
        "all-zero attention_mask": (
            edit(attention_mask=torch.zeros_like(empty_row)),
            r"batch\['attention_mask'\] is all 0 in 8 of 8",
        ),
        "meta input_ids": (edit(input_ids=good["input_ids"].to("meta")), r"batch\['input_ids'\] is on the meta device"),
        "all on meta": ({k: v.to("meta") for k, v in good.items()}, r"batch\['input_ids'\] is on the meta device"),
        "sparse input_ids": (
            edit(input_ids=good["input_ids"].to_sparse()),
            r"batch\['input_ids'\] is a torch.sparse_coo",
        ),
        "sparse attention_mask": (
            edit(attention_mask=good["attention_mask"].to_sparse()),
            r"batch\['attention_mask'\] is a torch.sparse_coo",
        ),
        "NaN in float position_ids": (
            edit(position_ids=nan_positions),
            r"batch\['position_ids'\] must be a torch.long",
        ),
        "int16 position_ids": (
            edit(position_ids=good["position_ids"].short()),
            r"batch\['position_ids'\] must be a torch.long",
        ),
        "input_ids as a list": (edit(input_ids=good["input_ids"].tolist()), r"batch\['input_ids'\] is a list, not a"),
        "0-d input_ids": (edit(input_ids=torch.tensor(3)), r"batch\['input_ids'\] must be \[B, T\], got shape \(\)"),
        "DataProto meta_info a list": (FakeDataProto(good, {}, [("k", 1)]), "the DataProto's meta_info must be a dict"),
    }


@pytest.mark.parametrize("case", list(_bad_batches()))
def test_bad_input_raises_a_named_error_and_changes_nothing(tiny_qwen2, case):
    model = tiny_qwen2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    critic = make_critic(model, optimizer=optimizer)
    critic.update_critic(make_batch(8, 6, 5))
    before = state_hash(model, optimizer)
    batch, name = _bad_batches()[case]
    with pytest.raises((ValueError, TypeError), match=name) as err:
        critic.update_critic(batch)
    assert "\n" not in str(err.value)  # one line
    assert state_hash(model, optimizer) == before


@pytest.mark.parametrize("case", list(_bad_model_inputs()))
def test_compute_values_refuses_bad_model_input_with_a_named_error(tiny_qwen2, case):
    model = tiny_qwen2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    critic = make_critic(model, optimizer=optimizer, ema_decay=0.5)  # compute_values swaps the average in and out
    critic.update_critic(make_batch(8, 6, 5))
    before = state_hash(model, optimizer)
    batch, name = _bad_model_inputs()[case]
    with pytest.raises((ValueError, TypeError), match=name) as err:
        critic.compute_values(batch)
    assert "\n" not in str(err.value)
    assert state_hash(model, optimizer) == before


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"use_dynamic_bsz": "false"}, r"meta_info\['use_dynamic_bsz'\]='false' \(str\) must be True, False or None"),
        ({"use_dynamic_bsz": 1}, r"meta_info\['use_dynamic_bsz'\]=1 \(int\) must be True, False or None"),
        ({"use_dynamic_bsz": torch.tensor(True)}, r"meta_info\['use_dynamic_bsz'\]=tensor\(True\) \(Tensor\)"),
    ],
    ids=["str", "int", "tensor"],
)
def test_compute_values_refuses_a_meta_info_setting_of_the_wrong_type(tiny_qwen2, meta, message):
    """verl's meta_info holds Python bools and ints; `bool("false")` is True, so a string is an error, not a guess."""
    model = tiny_qwen2()
    critic = make_critic(model)
    before = state_hash(model)
    with pytest.raises((TypeError, ValueError), match=message) as err:
        critic.compute_values(DataProtoStandIn(make_batch(8, 6, 5), meta))
    assert "\n" not in str(err.value) and state_hash(model) == before


def test_compute_values_takes_python_and_numpy_bools_and_none_from_meta_info(tiny_qwen2):
    critic = make_critic(tiny_qwen2(), forward_micro_batch_size_per_gpu=8)
    batch = make_batch(8, 6, 5)
    plain = critic.compute_values(batch)
    for flag in (False, np.bool_(False), None):
        meta = {"use_dynamic_bsz": flag, "micro_batch_size": np.int64(8), "max_token_len": None}
        torch.testing.assert_close(critic.compute_values(DataProtoStandIn(batch, meta)), plain, rtol=0, atol=0)


@pytest.mark.cuda
def test_a_batch_whose_tensors_live_on_different_devices_is_accepted(tiny_qwen2):
    """Validation runs on the devices the tensors are on; the critic then moves the whole batch to its own."""
    batch = make_batch(8, 6, 5)
    mixed = {k: v.cuda() if k in ("input_ids", "position_ids", "values") else v for k, v in batch.items()}
    a, b = make_critic(tiny_qwen2()), make_critic(tiny_qwen2())
    torch.testing.assert_close(a.compute_values(mixed), b.compute_values(batch), rtol=0, atol=0)
    assert without_timings(a.update_critic(mixed)) == without_timings(b.update_critic(batch))


def test_sequence_over_the_dynamic_budget_raises_before_any_step(tiny_qwen2):
    model = tiny_qwen2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batch(8, 6, 5, seed=10)
    longest = int(batch["attention_mask"].sum(-1).max())
    critic = make_critic(
        model, optimizer, ppo_mini_batch_size=4, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=longest - 1
    )
    before = state_hash(model, optimizer)
    with pytest.raises(ValueError, match=f"{longest} tokens"):
        critic.update_critic(batch)
    assert state_hash(model, optimizer) == before


@pytest.mark.parametrize(
    ("cfg", "name"),
    [
        ({"loss_agg_mode": "seq-mean"}, "loss_agg_mode"),
        ({"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 3}, "ppo_micro_batch_size_per_gpu"),
        ({"model": {"use_remove_padding": True, "attn_implementation": "sdpa"}}, "attn_implementation"),
    ],
)
def test_bad_config_is_rejected_at_construction(tiny_qwen2, cfg, name):
    model = tiny_qwen2()
    with pytest.raises(ValueError, match=name):
        DataParallelPPOCritic(cfg, model, torch.optim.SGD(model.parameters(), lr=0.1))


def critic_with(model, **model_cfg):
    """A critic of `model` whose `critic.model` section is `model_cfg`."""
    return DataParallelPPOCritic(
        {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 2, "grad_clip": None, "model": model_cfg},
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
    )


def test_auto_packs_an_hf_model_on_cpu(tiny_qwen2):
    model = tiny_qwen2()
    critic = make_critic(model)
    assert CriticConfig().model.use_remove_padding == "auto" and critic.use_remove_padding is True
    assert model.config._attn_implementation == VARLEN


@pytest.mark.parametrize(
    ("build", "model_cfg"),
    [
        (lambda _: IdsAsValues(), {}),  # a custom module: no attention to switch
        (lambda factory: factory(attn_implementation="eager"), {"attn_implementation": "eager"}),
        (lambda _: build_value_model(tiny_config("mistral")), {}),  # sliding-window layers
    ],
    ids=["custom-module", "eager", "sliding-window"],
)
def test_auto_pads_where_packing_is_impossible_and_leaves_the_model_as_it_was(tiny_qwen2, build, model_cfg):
    model = build(tiny_qwen2)
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    critic = critic_with(model, use_remove_padding="auto", **model_cfg)
    assert critic.use_remove_padding is False
    assert getattr(getattr(model, "config", None), "_attn_implementation", None) == attn
    critic.update_critic(make_batch(8, 5, 4, vocab=100))


@pytest.mark.parametrize(
    ("build", "model_cfg", "message"),
    [
        (lambda _: IdsAsValues(), {}, "has no transformers model inside"),
        (lambda factory: factory(), {"attn_implementation": "eager"}, "cannot run packed rows"),
    ],
    ids=["custom-module", "eager"],
)
def test_explicit_true_still_rejects_what_cannot_pack(tiny_qwen2, build, model_cfg, message):
    with pytest.raises(ValueError, match=message):
        critic_with(build(tiny_qwen2), use_remove_padding=True, **model_cfg)


def test_explicit_false_pads_an_hf_model(tiny_qwen2):
    model = tiny_qwen2()
    assert critic_with(model, use_remove_padding=False).use_remove_padding is False
    assert model.config._attn_implementation != VARLEN


def test_the_step_api_gives_the_step_of_update_critic(tiny_qwen2):
    """A loop of its own over the public step calls (what verl ≥ 0.9's engine runs): micro_batches, forward_backward
    with the clipped value loss over the mini-batch's global denominators, optimizer_step. One mini-batch, one epoch:
    the same parameters as `update_critic`, bit for bit (the same operations in the same order)."""
    from ppo_critic.algos import compute_value_loss
    from ppo_critic.data.batch import Batch

    model = tiny_qwen2()
    ours, theirs = make_critic(copy.deepcopy(model)), make_critic(model)
    batch = make_batch(8, 6, 5)
    ours.update_critic(batch)
    data = Batch.from_any(batch)
    tokens = float(data.response_mask.sum())

    def value_loss(micro, rows, token_values):
        vpreds = token_values[:, -micro.response_length - 1 : -1]
        norm = {"batch_num_tokens": tokens, "dp_size": 1}
        return compute_value_loss(vpreds, micro["returns"], micro["values"], micro.response_mask, 0.5, **norm)[0]

    theirs.set_training(True)
    groups = theirs.micro_batches(data, False, theirs.sizes.micro_batch, theirs.sizes.max_token_len)
    assert [len(g) for g in groups] == [2, 2, 2, 2]
    results = theirs.forward_backward(data, groups, value_loss)
    assert [r.rows for r in results] == groups and all(r.values.shape == (2, 11) for r in results)
    norm = theirs.optimizer_step(loss_is_finite=True)
    assert torch.isfinite(norm) and all(p.grad is None for p in model.parameters())
    for a, b in zip(ours.critic_module.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _one_step(critic, batch, loss_is_finite, halves: bool) -> torch.Tensor:
    """Gradients of one mini-batch, then `optimizer_step`, or its two halves with the norm read in between."""
    groups = critic.micro_batches(batch, False, 4, 0)
    critic.forward_backward(batch, groups, lambda micro, rows, values: values[:, :-1].square().mean())
    if not halves:
        return critic.optimizer_step(loss_is_finite)
    norm = critic.clip_gradients(loss_is_finite)
    critic.step_or_skip(bool(torch.isfinite(norm)))
    return norm


@pytest.mark.parametrize(
    "loss_is_finite",
    [True, torch.tensor(True), False, torch.tensor(False)],
    ids=["taken", "taken-device-bool", "skipped", "skipped-device-bool"],
)
def test_clip_gradients_then_step_or_skip_is_optimizer_step(tiny_qwen2, loss_is_finite):
    """`optimizer_step`'s two halves, as an engine that reads the decision with its metrics runs them: the same
    norm, parameters, optimizer state and moving average, bit for bit, for a step taken and one skipped for its loss
    (a host bool or a device bool), after a step that moved AdamW's state and the average; gradients zeroed."""
    from ppo_critic.data.batch import Batch

    model, batch = tiny_qwen2(), Batch.from_any(make_batch(8, 6, 5, seed=7))
    critics, norms, moved = [], [], []
    for halves in (False, True):
        copied = copy.deepcopy(model)
        critic = make_critic(copied, torch.optim.AdamW(copied.parameters(), lr=1e-3), grad_clip=0.5, ema_decay=0.5)
        critic.set_training(True)
        _one_step(critic, batch, True, halves)
        before = state_hash(copied, critic.critic_optimizer)
        norms.append(_one_step(critic, batch, loss_is_finite, halves))
        moved.append(state_hash(copied, critic.critic_optimizer) != before)
        critics.append(critic)
    (whole, halves), finite = critics, bool(loss_is_finite)
    assert _bits(norms[0]) == _bits(norms[1]) and bool(torch.isfinite(norms[0])) == finite
    assert moved == [finite, finite]
    assert state_hash(whole.critic_module, whole.critic_optimizer) == state_hash(
        halves.critic_module, halves.critic_optimizer
    )
    assert {k: _bits(v) for k, v in whole.ema.state_dict().items()} == {
        k: _bits(v) for k, v in halves.ema.state_dict().items()
    }
    assert all(p.grad is None for c in critics for p in c.critic_module.parameters())


def test_an_optimizer_over_another_models_parameters_is_refused():
    """Issue 43 family 10: it trained nothing while every metric looked normal. Refused at the first update, before
    any state changes (a critic that only computes values may hold any optimizer)."""
    model, other = build_value_model(tiny_config()), build_value_model(tiny_config())
    config = {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2}
    critic = DataParallelPPOCritic(config, model, torch.optim.AdamW(other.parameters()))
    batch = make_batch(batch_size=4)
    batch["values"] = critic.compute_values(batch)
    batch["returns"] = torch.ones_like(batch["values"])
    before = state_hash(model)
    with pytest.raises(ValueError, match=r"critic_optimizer holds none of critic_module's parameters"):
        critic.update_critic(batch)
    assert state_hash(model) == before
    critic = DataParallelPPOCritic(config, model, torch.optim.AdamW(model.parameters()))
    critic.update_critic(batch)  # its own: trains
    assert state_hash(model) != before
