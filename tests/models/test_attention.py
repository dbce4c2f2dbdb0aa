"""The CPU varlen attention: its buckets, their cost model, equality with per-sequence attention and with the padded
model, and what `use_remove_padding=auto` checks (`packed_blocker`)."""

from __future__ import annotations

import copy
import inspect
import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import FP32_REORDERED, make_batch, tiny_config
from cuda_contract import (
    Calls,
    ContractError,
    flash_attn_varlen_func,
    opaque_kernel,
    reference_varlen,
    torch_varlen_attn,
)
from ppo_critic import DataParallelPPOCritic, build_value_model
from ppo_critic.models import attention
from ppo_critic.models.attention import Buckets, bucket_shapes, packed_blocker, varlen_attention
from test_packing import assert_same_values_and_update, critic_pair

# how the sorted sequences of a packed row are cut into buckets, besides the cost model's own choice
PLANS = {
    "one bucket": lambda lengths, width: [(len(lengths), lengths[0])],
    "pairs": lambda lengths, width: [(len(lengths[i : i + 2]), lengths[i]) for i in range(0, len(lengths), 2)],
    "per sequence": lambda lengths, width: [(1, n) for n in lengths],
}


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.sampled_from([16, 64, 256]))
def test_buckets_hold_every_token_once_in_its_sequence(lengths, width):
    bounds = cu_seqlens(lengths).tolist()
    b = Buckets.build(bounds, width)
    assert sum(n * length for n, length in b.shapes) == len(b.gather) == len(b.valid)
    assert sum(n for n, _ in b.shapes) == sum(1 for n in lengths if n)
    seq_of_token = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    assert torch.equal(b.gather[b.scatter], torch.arange(bounds[-1]))  # each token's slot holds it
    assert b.valid[b.scatter].all() and int(b.valid.sum()) == bounds[-1]
    start = 0
    for n, length in b.shapes:  # a bucket's rows: one sequence each, its tokens in order, then its last one repeated
        rows = b.gather[start : start + n * length].view(n, length)
        for row, valid in zip(rows, b.valid[start : start + n * length].view(n, length), strict=True):
            seq = seq_of_token[row]
            assert (seq == seq[0]).all() and int(valid.sum()) == lengths[seq[0]] <= length
            assert torch.equal(row[valid], torch.arange(bounds[seq[0]], bounds[seq[0] + 1]))
            assert (row[~valid] == bounds[seq[0] + 1] - 1).all()
        start += n * length


def modelled_cost(shapes: list[tuple[int, int]], lengths: list[int], width: int) -> float:
    """The cost `bucket_shapes` minimises, written out: per-sequence calls on views, or gathered buckets."""
    row = lambda n: width * (attention.LINEAR_US * n + attention.QUADRATIC_US * n * n)  # noqa: E731
    if all(n == 1 for n, _ in shapes):
        return sum(attention.SEQUENCE_CALL_US + row(n) for n in lengths)
    gather = attention.GATHER_US * sum(lengths) * width
    return gather + sum(attention.BUCKET_CALL_US + n * row(length) for n, length in shapes)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 600), min_size=1, max_size=8), st.sampled_from([64, 256]))
def test_bucket_shapes_are_the_cheapest_cut_of_the_sorted_lengths(lengths, width):
    lengths = sorted(lengths, reverse=True)
    shapes = bucket_shapes(lengths, width)
    taken = 0
    for n, length in shapes:  # consecutive runs of the sorted lengths, each padded to its longest
        assert n >= 1 and length == lengths[taken]
        taken += n
    assert taken == len(lengths)
    cuts = [  # brute force: every way to cut the sorted list into consecutive buckets
        [(e - s, lengths[s]) for s, e in itertools.pairwise((0, *chosen, len(lengths)))]
        for k in range(len(lengths))
        for chosen in itertools.combinations(range(1, len(lengths)), k)
    ]
    cheapest = min(modelled_cost(c, lengths, width) for c in cuts)  # the last cut is one bucket per sequence
    # the same <= 9 float64 terms summed in other orders: relative error <= ~9 * 2**-53 (Higham §3.1); 1e-9 is ample
    assert modelled_cost(shapes, lengths, width) == pytest.approx(cheapest, rel=1e-9)


def test_short_sequences_share_calls_and_long_ones_run_alone():
    short = sorted([1 + i % 20 for i in range(96)], reverse=True)  # the built-in task's shape: 4 heads × 16
    assert len(bucket_shapes(short, 64)) <= 5
    assert bucket_shapes([1400, 1380], 256) == [(1, 1400), (1, 1380)]


def test_buckets_are_cached_per_cu_seqlens_tensor():
    cu = cu_seqlens([3, 1, 4])
    first = Buckets.of(cu, 64, CPU)
    assert Buckets.of(cu, 64, CPU) is first  # every layer of one forward
    assert Buckets.of(cu, 256, CPU) is not first
    assert Buckets.of(cu_seqlens([3, 2]), 64, CPU).lengths == (3, 2)  # the next micro-batch
    with torch.inference_mode():  # tensors without a version counter
        assert Buckets.of(cu_seqlens([2, 2]), 64, CPU).lengths == (2, 2)


def per_sequence_reference(q, k, v, lengths, causal):
    """The definition: one attention per sequence on its own slice, outputs in packed order [1, nnz, Hq, D]."""
    outs = []
    for s, e in itertools.pairwise(cu_seqlens(lengths).tolist()):
        if e > s:
            sl = slice(s, e)
            outs.append(
                F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=causal, enable_gqa=True)
            )
    return torch.cat(outs, dim=2).transpose(1, 2)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("plan", [*PLANS, "cost model"])
def test_bucketed_attention_equals_per_sequence_attention(plan, causal, monkeypatch):
    if plan in PLANS:
        monkeypatch.setattr(attention, "bucket_shapes", PLANS[plan])
    lengths = [5, 1, 0, 12, 3, 1, 7, 7, 30, 2]  # length 1 and empty sequences, equal lengths, one long one
    g = torch.Generator().manual_seed(0)
    nnz = sum(lengths)
    q, k, v = (torch.randn(1, nnz, h, 8, generator=g).transpose(1, 2).requires_grad_() for h in (4, 2, 2))  # GQA
    module = nn.Module()
    module.is_causal = causal
    out, _ = varlen_attention(module, q, k, v, None, cu_seq_lens_q=cu_seqlens(lengths))
    reference = per_sequence_reference(q, k, v, lengths, causal)
    # per query the same dot products (8 terms) and softmax sums (<= 30 keys; padding keys weigh exactly 0), maybe
    # blocked otherwise by the kernel: float32 sums of n <= 30 terms in another order, conftest.FP32_REORDERED
    torch.testing.assert_close(out, reference, **FP32_REORDERED)
    weights = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    for got, want in zip(
        grads, expected, strict=True
    ):  # sums of the same terms plus exact zeros from padding: as above
        torch.testing.assert_close(got, want, **FP32_REORDERED)


def batch_with_short_rows():
    """Mixed lengths, among them a sequence of one token (a prompt token, no response) and one of two."""
    batch = make_batch(8, 7, 6, seed=3)
    batch["attention_mask"][0] = 0
    batch["attention_mask"][0, 6] = 1  # the last prompt token only
    batch["attention_mask"][1, :6] = 0
    batch["attention_mask"][1, 8:] = 0  # the last prompt token and the first response token
    batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return batch


@pytest.mark.parametrize("plan", [*PLANS, "cost model"])
def test_packed_model_with_any_buckets_equals_the_padded_model(plan, monkeypatch):
    if plan in PLANS:
        monkeypatch.setattr(attention, "bucket_shapes", PLANS[plan])
    padded, packed = critic_pair("qwen2", ppo_micro_batch_size_per_gpu=8)  # GQA: 4 query heads, 2 key/value
    assert_same_values_and_update(padded, packed, batch_with_short_rows())


def tiny(model_type: str = "qwen2", **overrides) -> nn.Module:
    return build_value_model(tiny_config(model_type, **overrides))


class NoKwargsWrapper(nn.Module):
    """A user's module around an HF model whose forward takes no extra keyword arguments."""

    def __init__(self):
        super().__init__()
        self.inner = tiny()

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    ("build", "name", "device", "reason"),
    [
        (tiny, None, CPU, None),
        (tiny, "flash_attention_2", CUDA, None),  # transformers' own varlen path decides
        (tiny, "eager", CPU, "cannot run packed rows"),
        (tiny, "sdpa", CPU, "cannot run packed rows"),
        (lambda: nn.Linear(2, 1), None, CPU, "no transformers model inside"),
        (NoKwargsWrapper, None, CPU, "takes no **kwargs"),
        (lambda: tiny("mistral"), None, CPU, "sliding-window"),
        (tiny, None, CUDA, None),  # every compute dtype: the kernels take the half ones, bucketed sdpa the others
    ],
)
def test_packed_blocker_names_what_stops_packing(build, name, device, reason):
    blocker = packed_blocker(build(), name, device)
    assert blocker is None if reason is None else reason in blocker


def test_packed_blocker_on_cuda_needs_a_varlen_kernel(monkeypatch):
    attention.register()
    monkeypatch.setitem(attention.KERNELS, "cuda", object())
    assert packed_blocker(tiny(), None, CUDA) is None
    monkeypatch.delitem(attention.KERNELS, "cuda")
    assert "neither flash-attn nor" in packed_blocker(tiny(), None, CUDA)


def test_packed_blocker_needs_a_model_that_passes_kwargs_to_its_attention(monkeypatch):
    model = tiny()
    monkeypatch.setattr(type(model), "_supports_attention_backend", False)
    assert "does not pass keyword arguments" in packed_blocker(model, None, CPU)


# The CUDA kernel branch of the varlen attention, run on the CPU through stand-ins of the CUDA kernels that enforce
# their input contracts (tests/cuda_contract.py): our adapters around each kernel signature are the real ones.
TORCH_SIGNATURES = ("2.13", "2.11", "older")
KERNEL_DOUBLES = {
    **{
        f"torch varlen_attn, {signature} signature": lambda calls, s=signature: attention.torch_varlen_kernel(
            torch_varlen_attn(calls, s)
        )
        for signature in TORCH_SIGNATURES
    },
    "flash-attn": lambda calls: attention.flash_kernel(flash_attn_varlen_func(calls)),
}


@pytest.fixture(params=list(KERNEL_DOUBLES))
def cpu_kernel(request, monkeypatch) -> Calls:
    """This test's CPU tensors take the kernel branch (the one CUDA tensors take), through a contract stand-in."""
    calls = Calls()
    attention.register()
    monkeypatch.setitem(attention.KERNELS, "cpu", KERNEL_DOUBLES[request.param](calls))
    return calls


def test_the_kernel_branch_under_bf16_autocast_gives_the_padded_values(cpu_kernel):
    """bf16 autocast over fp32 weights (ppo-critic's default on CUDA): RoPE hands q and k back in float32 beside a
    bf16 v, yet the kernel gets one bf16 dtype, and values and update agree with the padded bf16 critic."""
    padded, packed = critic_pair("qwen2", dtype="bfloat16")  # GQA: 4 query heads, 2 key/value
    batch = make_batch(8, 7, 6, seed=9)
    values = packed.compute_values(batch)
    assert cpu_kernel.dtypes and set(cpu_kernel.dtypes) == {torch.bfloat16}
    # Both run every matmul in bf16 under autocast and differ only in how attention rounds: the stand-in attends in
    # float32 to the bf16 q/k/v and rounds the output once, sdpa's CPU kernel accumulates in other blocks. The values
    # (|v| < 0.5) then differ by a few bf16 ulps (2**-9 at 0.25-0.5; measured: one); a wrong position or mask moves
    # them by ~0.1.
    torch.testing.assert_close(values, padded.compute_values(batch), rtol=0, atol=1e-2)
    before = [p.detach().clone() for p in packed.critic_module.parameters()]
    assert packed.update_critic(batch)["critic/skipped_steps"] == 0
    assert any(not torch.equal(a, p) for a, p in zip(before, packed.critic_module.parameters(), strict=True))


@pytest.mark.parametrize(("kv_heads", "causal"), [(2, True), (4, True), (2, False)])
def test_the_kernel_branch_casts_mixed_autocast_inputs_to_one_half_dtype(cpu_kernel, kv_heads, causal):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 7]
    q = torch.randn(1, 4, sum(lengths), 16, generator=g)  # float32, as RoPE returns them under autocast
    k = torch.randn(1, kv_heads, sum(lengths), 16, generator=g)
    v = torch.randn(1, kv_heads, sum(lengths), 16, generator=g).bfloat16()  # the autocast dtype, from a Linear
    module = nn.Module()
    module.is_causal = causal
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = varlen_attention(module, q, k, v, None, cu_seq_lens_q=cu_seqlens(lengths), max_length_q=7)
    assert cpu_kernel.dtypes == [torch.bfloat16] and out.dtype == torch.bfloat16 and out.shape == (1, 13, 4, 16)
    reference = per_sequence_reference(q.bfloat16().float(), k.bfloat16().float(), v.float(), lengths, causal)
    # the stand-in attends in float32 to the bf16-rounded inputs, then rounds once: one bf16 rounding (2**-9)
    # of outputs of magnitude < 3
    torch.testing.assert_close(out.float(), reference, rtol=2**-8, atol=1e-2)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_float32_on_a_kernel_device_runs_bucketed_sdpa_and_half_dtypes_the_kernel(cpu_kernel, causal):
    """The kernels take float16 / bfloat16 only: float32 packed attention goes to the bucketed sdpa on the kernel's
    device and equals per-sequence attention; under bf16 autocast the same inputs go to the kernel."""
    lengths = [5, 1, 0, 12, 3]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, sum(lengths), 16, generator=g) for h in (4, 2, 2))
    module = nn.Module()
    module.is_causal = causal
    cu = cu_seqlens(lengths)
    out, _ = varlen_attention(module, q, k, v, None, cu_seq_lens_q=cu, max_length_q=12)
    assert not cpu_kernel.dtypes and out.dtype == torch.float32
    # sdpa per bucket against sdpa per sequence: float32 sums of <= 16 terms in another order (FP32_REORDERED)
    reference = per_sequence_reference(q, k, v, lengths, causal)
    torch.testing.assert_close(out, reference, **FP32_REORDERED)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        varlen_attention(module, q, k, v, None, cu_seq_lens_q=cu, max_length_q=12)
    assert cpu_kernel.dtypes == [torch.bfloat16]


def test_float32_packing_on_a_kernel_device_equals_the_padded_model(cpu_kernel):
    """float32 compute where a kernel is registered (float32 on CUDA): `true` packs and `auto` too, through the
    bucketed sdpa, with the padded critic's values and update (FP32_REORDERED); the kernel is never called."""
    padded, packed = critic_pair("qwen2", dtype="float32")  # GQA: 4 query heads, 2 key/value
    assert packed.use_remove_padding and packed.compute_dtype == torch.float32
    assert_same_values_and_update(padded, packed, make_batch(8, 7, 6, seed=9))
    model = tiny()
    auto = DataParallelPPOCritic({"ppo_mini_batch_size": 8}, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert auto.use_remove_padding
    assert not cpu_kernel.dtypes


def test_the_contract_stand_ins_refuse_what_the_kernels_refuse():
    calls = Calls()
    torch_kernel = attention.torch_varlen_kernel(torch_varlen_attn(calls))
    q, cu = torch.randn(6, 4, 16).bfloat16(), cu_seqlens([6])
    with pytest.raises(ContractError, match="one dtype"):
        torch_kernel(q, q.float(), q, cu, 6, None, 0.0, True)
    with pytest.raises(ContractError, match="int32"):
        torch_kernel(q, q, q, cu.long(), 6, None, 0.0, True)
    with pytest.raises(ContractError, match="max length"):
        torch_kernel(q, q, q, cu, 5, None, 0.0, True)
    kv = q[:, :2]
    with pytest.raises(ContractError, match="GQA"):
        torch_varlen_attn(calls, "older")(q, kv, kv, cu, cu, 6, 6, True)
    with pytest.raises(ContractError, match="GQA"):  # torch 2.13 wants enable_gqa=True
        torch_varlen_attn(calls, "2.13")(q, kv, kv, cu, cu, 6, 6)
    with pytest.raises(ContractError, match="4 query heads and 3 key/value heads"):  # 2.11: the flash kernel's rule
        torch_varlen_attn(calls, "2.11")(q, q[:, :3], q[:, :3], cu, cu, 6, 6)
    assert calls.dtypes == []


@pytest.mark.parametrize(("signature", "kv_heads"), [("2.13", 2), ("2.11", 2), ("older", 4)])
def test_kv_heads_reach_the_torch_kernel_unrepeated_where_its_signature_allows(signature, kv_heads):
    """Qwen2.5's 14 query / 2 key-value heads would copy K and V 7-fold before every attention call: torch 2.13 and
    2.11 hand fewer K/V heads to the flash kernel (2.13 through `enable_gqa`); only the older signature repeats."""
    calls = Calls()
    q, kv, cu = torch.randn(9, 4, 16).bfloat16(), torch.randn(9, 2, 16).bfloat16(), cu_seqlens([4, 5])
    out = attention.torch_varlen_kernel(torch_varlen_attn(calls, signature))(q, kv, kv, cu, 5, None, 0.0, True)
    assert calls.heads == [(4, kv_heads)]
    torch.testing.assert_close(out, reference_varlen(q, kv, kv, cu, None, True), rtol=0, atol=0)


def test_the_torch_stand_in_has_this_torchs_varlen_attn_signature():
    """The stand-in of the installed torch's signature is that signature (names, kinds, defaults): torch 2.13 here,
    torch 2.11 in tests/with_gpu_stack (the GPU box's)."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    signature = torch.__version__[:4]
    if signature not in TORCH_SIGNATURES:
        pytest.skip(f"no stand-in of torch {torch.__version__}'s varlen_attn")

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert shape(torch_varlen_attn(Calls(), signature)) == shape(varlen.varlen_attn)


def attend(q, k, v, cu, longest):
    """The packed attention as a decoder layer calls it, under bf16 autocast."""
    with torch.autocast(q.device.type, dtype=torch.bfloat16):
        return varlen_attention(nn.Module(), q, k, v, None, cu_seq_lens_q=cu, max_length_q=longest)[0]


def test_the_kernel_branch_traces_into_one_graph(monkeypatch):
    """With `use_torch_compile`, choosing the kernel inside traced code (an import, a signature lookup per call)
    would break the graph at every attention call; the choice is made at registration."""
    attention.register()
    monkeypatch.setitem(attention.KERNELS, "cpu", opaque_kernel)
    q, kv = torch.randn(1, 4, 9, 16), torch.randn(1, 2, 9, 16)
    explained = torch._dynamo.explain(attend)(q, kv, kv.bfloat16(), cu_seqlens([4, 5]), 5)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.cuda
def test_the_cuda_kernel_traces_into_one_graph():
    """The real CUDA kernel (flash-attn, else torch's varlen_attn) behind the same dispatch, with no graph break."""
    attention.register()
    q, kv = torch.randn(1, 4, 9, 64, device="cuda"), torch.randn(1, 2, 9, 64, device="cuda")
    explained = torch._dynamo.explain(attend)(q, kv, kv.bfloat16(), cu_seqlens([4, 5]).cuda(), 5)
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.cuda
def test_float32_packing_on_cuda_equals_the_padded_model(monkeypatch):
    """float32 on CUDA, which the varlen kernels do not take, packs through the bucketed sdpa: the padded critic's
    values and update within FP32_REORDERED (float32 matmuls stay full float32: torch's default precision)."""
    assert torch.get_float32_matmul_precision() == "highest"
    attention.register()
    kernel, called = attention.KERNELS["cuda"], []
    monkeypatch.setitem(attention.KERNELS, "cuda", lambda *args: called.append(args[0].dtype) or kernel(*args))
    torch.manual_seed(0)
    base = tiny().cuda()
    critics = []
    for packed in (False, True):
        model = copy.deepcopy(base)
        config = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4, "grad_clip": None, "dtype": "float32"}
        config["model"] = {"use_remove_padding": packed}
        critics.append(DataParallelPPOCritic(config, model, torch.optim.SGD(model.parameters(), lr=0.1)))
    padded, packed = critics
    assert packed.use_remove_padding and packed.compute_dtype == torch.float32
    assert_same_values_and_update(padded, packed, make_batch(8, 7, 6, seed=9))
    assert not called
