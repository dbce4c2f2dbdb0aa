"""Remove padding: pack/unpack, varlen attention, and packed == padded for values and one update."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_batch, tiny_config
from multimodal import add_images, tiny_qwen2_vl
from ppo_critic import DataParallelPPOCritic, build_value_model
from ppo_critic.data.packing import compact, pack
from ppo_critic.models.attention import VARLEN, varlen_attention
from test_hf import TrlStyleCritic


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.data())
def test_pack_then_unpack_is_the_identity_on_valid_tokens(b, t, data):
    mask = torch.tensor(
        data.draw(st.lists(st.lists(st.integers(0, 1), min_size=t, max_size=t), min_size=b, max_size=b))
    )
    ids = torch.arange(b * t).view(b, t)
    packed = pack(ids, mask, ids)
    assert packed.input_ids.shape == (1, int(mask.sum()))
    assert packed.cu_seqlens.tolist() == [0, *mask.sum(-1).cumsum(0).tolist()]
    assert packed.max_seqlen == int(mask.sum(-1).max())
    torch.testing.assert_close(packed.unpack(packed.input_ids.unsqueeze(-1)).squeeze(-1), ids * mask)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.integers(1, 4), st.data())
def test_host_lengths_give_the_same_packing_and_ulysses_pads_it(b, t, sp, data):
    """`lengths` (`Batch.lengths()`) only spare the reads of the mask: the same row, bounds and token positions as
    `nonzero`'s. For `sp` Ulysses ranks the row is padded to a multiple of sp, the padding a sequence of its own."""
    mask = torch.tensor(
        data.draw(st.lists(st.lists(st.integers(0, 1), min_size=t, max_size=t), min_size=b, max_size=b))
    )
    ids = torch.arange(b * t).view(b, t)
    read, given = pack(ids, mask, ids), pack(ids, mask, ids, mask.sum(-1).tolist())
    assert torch.equal(given.indices, mask.flatten().nonzero().squeeze(1))
    for key in ("input_ids", "position_ids", "cu_seqlens", "indices"):
        assert torch.equal(getattr(read, key), getattr(given, key))
    assert read.max_seqlen == given.max_seqlen == int(mask.sum(-1).max()) and type(given.max_seqlen) is int
    nnz, pad = int(mask.sum()), -int(mask.sum()) % sp
    ranks = [given.model_kwargs(sp, r) for r in range(sp)]
    bounds = ranks[0]["cu_seq_lens_q"]
    assert bounds.dtype == torch.int32 and bounds.tolist() == read.cu_seqlens.tolist() + ([nnz + pad] if pad else [])
    assert torch.equal(torch.cat([k["input_ids"] for k in ranks], 1)[:, :nnz], given.input_ids)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.data())
def test_compact_moves_valid_tokens_first_and_expand_undoes_it(b, t, data):
    mask = torch.tensor(
        data.draw(st.lists(st.lists(st.integers(0, 1), min_size=t, max_size=t), min_size=b, max_size=b))
    )
    ids = torch.arange(b * t).view(b, t) + 1
    c = compact(ids, mask, ids * 10)
    lens = mask.sum(-1)
    assert c.input_ids.shape == (b, max(int(lens.max()), 1))
    for i in range(b):  # any mask, not only left/right padding: the valid tokens in order, then padding
        n = int(lens[i])
        assert c.input_ids[i, :n].tolist() == ids[i][mask[i].bool()].tolist()
        assert c.position_ids[i, :n].tolist() == (ids[i][mask[i].bool()] * 10).tolist()
        assert c.valid[i].tolist() == [True] * n + [False] * (c.valid.shape[1] - n)
    outputs = c.input_ids.double().requires_grad_()
    expanded = c.expand(outputs)
    torch.testing.assert_close(expanded, (ids * mask).double(), rtol=0, atol=0)  # exact: integers, copied
    expanded.sum().backward()  # differentiable, and padding slots get no gradient
    torch.testing.assert_close(outputs.grad, c.valid.double(), rtol=0, atol=0)  # exact: gradients 1 and 0


def test_compact_rejects_mrope_position_ids():
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"position_ids \[B, T\]"):
        compact(ids, ids, torch.ones(2, 3, 3, dtype=torch.long))


def test_mrope_position_ids_pack_to_three_rows():
    ids = torch.arange(8).view(2, 4)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    pos = torch.stack([ids * 10, ids * 100, ids * 1000], dim=1)  # [B, 3, T]
    packed = pack(ids, mask, pos)
    assert packed.position_ids.shape == (3, 1, 5)
    assert packed.position_ids[:, 0].tolist() == [[v * k for v in (1, 2, 3, 4, 5)] for k in (10, 100, 1000)]


def test_varlen_attention_needs_packed_inputs():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        varlen_attention(torch.nn.Module(), q, q, q, None)


MODELS = {
    "qwen2": lambda: build_value_model(tiny_config("qwen2")),
    "llama": lambda: build_value_model(tiny_config("llama", num_key_value_heads=4)),
    "generic": lambda: build_value_model(tiny_config("olmo2")),
    "trl": lambda: build_value_model(TrlStyleCritic()),
}


def critic_pair(name, **cfg):
    torch.manual_seed(0)
    base = MODELS[name]()
    config = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4, "grad_clip": None, **cfg}
    critics = []
    for packed in (False, True):
        model = copy.deepcopy(base)
        c = {**config, "model": {"use_remove_padding": packed}}
        critics.append(DataParallelPPOCritic(c, model, torch.optim.SGD(model.parameters(), lr=0.1)))
    return critics


def edge_batch(kind):
    if kind == "varied":
        return make_batch(8, 7, 6, seed=3)
    if kind == "response-1":
        return make_batch(8, 5, 1, seed=4)
    if kind == "no-padding-row":
        batch = make_batch(8, 5, 4, seed=5)
        batch["attention_mask"][0] = 1
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        return batch
    if kind == "equal-lengths":
        batch = make_batch(8, 5, 4, seed=6)
        batch["attention_mask"][:] = 1
        batch["attention_mask"][:, :2] = 0
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        return batch
    raise KeyError(kind)


def assert_same_values_and_update(padded, packed, batch):
    # the same sums in another order (one packed row, varlen attention): fp32 rounding, conftest.FP32_REORDERED;
    # absolute, as these untrained values are all of magnitude <~ 1
    torch.testing.assert_close(packed.compute_values(batch), padded.compute_values(batch), rtol=0, atol=1e-5)
    before = [p.detach().clone() for p in padded.critic_module.parameters()]
    padded.update_critic(batch)
    packed.update_critic(batch)
    pairs = zip(before, padded.critic_module.parameters(), packed.critic_module.parameters(), strict=True)
    deltas = [((a.detach() - p0).flatten(), (b.detach() - p0).flatten()) for p0, a, b in pairs]
    delta_a = torch.cat([a for a, _ in deltas])
    delta_b = torch.cat([b for _, b in deltas])
    assert delta_a.norm() > 0
    # SGD: the update is lr x the gradient, a float32 sum over the mini-batch's tokens and the layers' dot products
    # in another order: norm-relative ~√n·u ~ 1e-6 (conftest.FP32_REORDERED), 1e-5 as DESIGN §6
    assert ((delta_a - delta_b).norm() / delta_a.norm()).item() <= 1e-5


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
def test_packed_equals_padded(name, dynamic):
    cfg = {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 24} if dynamic else {}
    padded, packed = critic_pair(name, **cfg)
    assert_same_values_and_update(padded, packed, edge_batch("varied"))


@pytest.mark.parametrize("kind", ["response-1", "no-padding-row", "equal-lengths"])
def test_packed_equals_padded_on_edge_cases(kind):
    padded, packed = critic_pair("qwen2")
    assert_same_values_and_update(padded, packed, edge_batch(kind))


def test_packed_equals_padded_for_a_batch_of_one():
    padded, packed = critic_pair("qwen2", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1)
    assert_same_values_and_update(padded, packed, make_batch(1, 5, 4, seed=7))


def test_packed_sequences_do_not_attend_to_each_other():
    _, packed = critic_pair("qwen2")
    batch = make_batch(8, 6, 5, seed=8)
    before = packed.compute_values(batch)
    changed = dict(batch)
    changed["input_ids"] = batch["input_ids"].clone()
    changed["input_ids"][3] = (changed["input_ids"][3] + 1) % 128
    after = packed.compute_values(changed)
    others = [i for i in range(8) if i != 3]
    assert torch.equal(before[others], after[others])
    assert not torch.equal(before[3], after[3])


def test_packed_path_switches_attention_and_always_passes_use_cache_false(monkeypatch):
    _, packed = critic_pair("qwen2")
    model = packed.critic_module
    assert model.config._attn_implementation == VARLEN
    seen = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda **kw: seen.append(kw) or forward(**kw))
    packed.compute_values(make_batch(8, 6, 5))
    assert seen and all(kw["use_cache"] is False and kw["attention_mask"] is None for kw in seen)
    assert all(kw["input_ids"].shape[0] == 1 for kw in seen)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["qwen2", "generic"])
def test_packed_equals_padded_on_cuda(name):
    """The CUDA varlen kernel (flash-attn, else torch's varlen_attn) under the default bf16 autocast against the padded
    model's sdpa: both round every matmul to bf16 and differ in how attention accumulates."""
    torch.manual_seed(0)
    base = MODELS[name]().cuda()
    critics = []
    for packed in (False, True):
        model = copy.deepcopy(base)
        config = {"ppo_mini_batch_size": 8, "grad_clip": None, "model": {"use_remove_padding": packed}}
        critics.append(DataParallelPPOCritic(config, model, torch.optim.SGD(model.parameters(), lr=0.1)))
    padded, packed = critics
    assert packed.use_remove_padding and packed.compute_dtype == torch.bfloat16
    batch = make_batch(8, 7, 6, seed=9)
    # bf16's unit roundoff is 2**-9: values of magnitude < 0.5 differ by a few ulps (the CPU stand-in of the kernel
    # measures one, test_attention); a wrong position or mask moves them by ~0.1
    torch.testing.assert_close(packed.compute_values(batch), padded.compute_values(batch), rtol=0, atol=1e-2)
    assert packed.update_critic(batch)["critic/skipped_steps"] == 0


def multimodal_batch(model, batch_size=8, prompt_len=14, response_len=5, seed=11):
    """One image per sample (4 or 2 image tokens), mrope position ids [B, 3, T] from the model's rope index."""
    return add_images(make_batch(batch_size, prompt_len, response_len, seed=seed, vocab=100), model, prompt_len, seed)


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
def test_packed_equals_padded_for_a_multimodal_model_with_images(dynamic):
    torch.manual_seed(0)
    base = tiny_qwen2_vl()
    batch = multimodal_batch(base)
    assert batch["position_ids"].shape == (8, 3, 19)
    cfg = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4, "grad_clip": None}
    if dynamic:
        cfg |= {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 40}
    critics = []
    for packed in (False, True):
        model = copy.deepcopy(base)
        critic_cfg = {**cfg, "model": {"use_remove_padding": packed}}
        critics.append(DataParallelPPOCritic(critic_cfg, model, torch.optim.SGD(model.parameters(), lr=0.1)))
    padded, packed = critics
    assert packed.critic_module.model.config.vision_config._attn_implementation != VARLEN
    assert_same_values_and_update(padded, packed, batch)
