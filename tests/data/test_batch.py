"""`Batch`: accepting dicts / TensorDicts / DataProtos, validation with clear errors, select / index / split / to."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from conftest import FakeDataProto, edited
from ppo_critic.data.batch import Batch

PROMPT_LENS = [4, 2, 3]
RESPONSE_LENS = [3, 1, 2]
P, R = 4, 3
B, T = len(PROMPT_LENS), P + R


def make_tensors(targets: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """B=3 rows, T=7: prompts left-padded to P=4, responses right-padded to R=3 (DESIGN §3)."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.stack([torch.arange(P) >= P - n for n in PROMPT_LENS]).long()
    response_mask = torch.stack([torch.arange(R) < n for n in RESPONSE_LENS]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    input_ids = torch.randint(1, 1000, (B, T), generator=g) * attention_mask
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, -R:],
    }
    if targets:
        tensors["values"] = torch.randn(B, R, generator=g) * response_mask
        tensors["returns"] = torch.randn(B, R, generator=g) * response_mask
    return tensors


def make_non_tensors() -> dict[str, np.ndarray]:
    mm = np.empty(B, dtype=object)
    for i in range(B):
        mm[i] = {"pixel_values": torch.full((2, 2), float(i)), "row": i}
    return {"multi_modal_inputs": mm, "uid": np.array([f"uid-{i}" for i in range(B)], dtype=object)}


def make_batch(targets: bool = True, **overrides: Any) -> Batch:
    return Batch(edited(make_tensors(targets), **overrides))


# ---------------------------------------------------------------------------------------------- sanity of the fixture


def test_fixture_layout():
    t = make_tensors()
    assert t["attention_mask"].tolist() == [
        [1, 1, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 1, 0, 0],
        [0, 1, 1, 1, 1, 1, 0],
    ]
    assert t["position_ids"].tolist()[1] == [0, 0, 0, 1, 2, 2, 2]
    Batch(t).validate(require_targets=True)


# ---------------------------------------------------------------------------------------------- from_any


def test_from_dict_of_tensors_keeps_non_tensors():
    tensors = make_tensors()
    data: dict[str, Any] = dict(tensors)
    data["uid"] = ["a", "b", "c"]
    batch = Batch.from_any(data)
    assert set(batch.tensors) == set(tensors)
    assert all(batch[k] is tensors[k] for k in tensors)
    assert batch.non_tensors == {"uid": ["a", "b", "c"]}
    assert len(batch) == B
    assert "uid" in batch and "values" in batch and "nope" not in batch
    batch.validate(require_targets=True)


def test_from_tensordict():
    tensors = make_tensors()
    td = TensorDict(tensors, batch_size=[B])
    batch = Batch.from_any(td)
    assert set(batch.tensors) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(batch[k], v)
    assert batch.non_tensors == {}
    assert len(batch) == B
    batch.validate(require_targets=True)


def test_from_tensordict_with_non_tensor_stack():
    from tensordict import NonTensorStack

    td = TensorDict(make_tensors(), batch_size=[B])
    td["uid"] = NonTensorStack("a", "b", "c")
    batch = Batch.from_any(td)
    assert "uid" not in batch.tensors
    assert list(batch.non_tensors["uid"]) == ["a", "b", "c"]
    assert list(batch.index([2, 0]).non_tensors["uid"]) == ["c", "a"]
    batch.validate(require_targets=True)


def test_from_dataproto_stand_in():
    tensors = make_tensors()
    meta = {"temperature": 0.7, "max_token_len": 4096}
    proto = FakeDataProto(TensorDict(tensors, batch_size=[B]), make_non_tensors(), meta)
    batch = Batch.from_any(proto)
    assert set(batch.tensors) == set(tensors)
    assert set(batch.non_tensors) == {"multi_modal_inputs", "uid"}
    assert batch.meta_info == meta
    assert batch.meta_info is not meta  # a copy: the caller's dict is not aliased
    assert batch.non_tensors["uid"].tolist() == ["uid-0", "uid-1", "uid-2"]
    batch.validate(require_targets=True)


def test_from_dataproto_with_empty_optional_parts():
    proto = FakeDataProto(TensorDict(make_tensors(), batch_size=[B]), {}, None)  # type: ignore[arg-type]
    batch = Batch.from_any(proto)
    assert batch.non_tensors == {} and batch.meta_info == {}
    batch.validate()


def test_from_batch_is_identity_and_rejects_other_types():
    batch = make_batch()
    assert Batch.from_any(batch) is batch
    with pytest.raises(TypeError, match="list"):
        Batch.from_any([torch.zeros(2)])


# ---------------------------------------------------------------------------------------------- index / split / select


@pytest.mark.parametrize("as_tensor", [False, True])
def test_index_reorders_tensors_and_non_tensors(as_tensor):
    tensors = make_tensors()
    proto = FakeDataProto(TensorDict(tensors, batch_size=[B]), make_non_tensors(), {"k": 1})
    batch = Batch.from_any(proto)
    rows = [2, 0]
    sub = batch.index(torch.tensor(rows) if as_tensor else rows)
    assert len(sub) == 2
    for k, v in tensors.items():
        assert torch.equal(sub[k], v[rows])
    assert sub.non_tensors["uid"].tolist() == ["uid-2", "uid-0"]
    assert [d["row"] for d in sub.non_tensors["multi_modal_inputs"]] == [2, 0]
    assert torch.equal(sub.non_tensors["multi_modal_inputs"][0]["pixel_values"], torch.full((2, 2), 2.0))
    assert sub.meta_info == {"k": 1}
    sub.validate(require_targets=True)


def test_index_with_list_non_tensor():
    data: dict[str, Any] = dict(make_tensors())
    data["tags"] = ["x", "y", "z"]
    sub = Batch.from_any(data).index([1, 1, 2])
    assert sub.non_tensors["tags"] == ["y", "y", "z"]
    assert torch.equal(sub["input_ids"], data["input_ids"][[1, 1, 2]])


@pytest.mark.parametrize("rows", [[1, 2], [0, 1, 2], [2, 0], [1, 1], [-1], [-2, -1], [], [2, 1, 0]])
def test_index_slices_consecutive_rows_and_gathers_others_the_same(rows):
    """A run of consecutive rows is a view (nothing copied, no index tensor to move), other rows are gathered: the
    rows are those of tensor indexing either way."""
    batch = Batch.from_any(make_tensors())
    sub = batch.index(rows)
    for k, v in batch.tensors.items():
        assert torch.equal(sub[k], v[torch.tensor(rows, dtype=torch.long)])
    assert (sub["input_ids"]._base is not None) == (rows in ([1, 2], [0, 1, 2]))


def test_lengths_read_once_are_carried_by_select_to_index_and_split():
    """The attended tokens per row, on the host: micro-batching and packing read them without touching the mask."""
    batch = Batch.from_any(make_tensors())
    lengths = batch["attention_mask"].sum(-1).tolist()
    assert batch.lengths() == lengths and batch.seq_lens is None  # read, not kept: the caller's batch is unchanged
    batch = batch.with_lengths()
    assert batch.seq_lens == lengths and batch.with_lengths() is batch
    assert batch.select(["input_ids"]).to("cpu").index(torch.tensor([2, 0])).seq_lens == [lengths[2], lengths[0]]
    assert [p.seq_lens for p in batch.split(2)] == [lengths[:2], lengths[2:]]


def test_split_keeps_rows_aligned():
    tensors = make_tensors()
    batch = Batch.from_any(FakeDataProto(TensorDict(tensors, batch_size=[B]), make_non_tensors(), {"m": 2}))
    parts = batch.split(2)
    assert [len(p) for p in parts] == [2, 1]
    assert parts[0].non_tensors["uid"].tolist() == ["uid-0", "uid-1"]
    assert parts[1].non_tensors["uid"].tolist() == ["uid-2"]
    assert [d["row"] for d in parts[1].non_tensors["multi_modal_inputs"]] == [2]
    assert torch.equal(torch.cat([p["values"] for p in parts]), tensors["values"])
    assert all(p.meta_info == {"m": 2} for p in parts)
    for p in parts:
        p.validate(require_targets=True)


def test_select_keeps_named_tensors_and_non_tensors():
    batch = Batch.from_any(FakeDataProto(TensorDict(make_tensors(), batch_size=[B]), make_non_tensors(), {"m": 3}))
    sub = batch.select(["input_ids", "attention_mask", "multi_modal_inputs", "does_not_exist"])
    assert set(sub.tensors) == {"input_ids", "attention_mask"}
    assert set(sub.non_tensors) == {"multi_modal_inputs"}
    assert sub.meta_info == {"m": 3}
    picked = sub.index([1])
    assert [d["row"] for d in picked.non_tensors["multi_modal_inputs"]] == [1]


# ---------------------------------------------------------------------------------------------- response_mask


def test_response_mask_defaults_to_response_part_of_attention_mask():
    batch = make_batch()
    assert batch.response_length == R
    expected = batch["attention_mask"][:, -R:]
    assert torch.equal(batch.response_mask, expected)
    assert batch.response_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]


def test_explicit_response_mask_is_used():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 1, 0]])
    batch = make_batch(response_mask=mask)
    assert torch.equal(batch.response_mask, mask)
    batch.validate(require_targets=True)


# ---------------------------------------------------------------------------------------------- validate: accepted


def test_validate_accepts_variants():
    make_batch(targets=False).validate()  # compute_values needs no targets
    tensors = make_tensors()
    Batch({**tensors, "input_ids": tensors["input_ids"].int()}).validate(require_targets=True)
    Batch({**tensors, "attention_mask": tensors["attention_mask"].bool()}).validate(require_targets=True)
    mrope = tensors["position_ids"].unsqueeze(1).expand(B, 3, T).clone()
    Batch({**tensors, "position_ids": mrope}).validate(require_targets=True)
    # the shortest legal sequence: one prompt token, R = T - 1
    one = Batch(
        {
            "input_ids": torch.tensor([[5, 6]]),
            "attention_mask": torch.tensor([[1, 1]]),
            "position_ids": torch.tensor([[0, 1]]),
            "responses": torch.tensor([[6]]),
        }
    )
    one.validate()


# ---------------------------------------------------------------------------------------------- validate: errors


@pytest.mark.parametrize("key", ["input_ids", "attention_mask", "position_ids", "responses"])
def test_missing_model_key(key):
    batch = make_batch(**{key: None})
    with pytest.raises(ValueError, match=key):
        batch.validate()


@pytest.mark.parametrize("key", ["values", "returns"])
def test_missing_target_key_only_when_targets_required(key):
    batch = make_batch(**{key: None})
    batch.validate()  # fine for compute_values
    with pytest.raises(ValueError, match=key):
        batch.validate(require_targets=True)


def test_float_input_ids():
    batch = make_batch(input_ids=make_tensors()["input_ids"].float())
    with pytest.raises(TypeError, match="input_ids"):
        batch.validate()


def test_input_ids_wrong_rank():
    batch = make_batch(input_ids=make_tensors()["input_ids"].unsqueeze(-1))
    with pytest.raises(ValueError, match="input_ids"):
        batch.validate()


@pytest.mark.parametrize("shape", [(B, T - 1), (B, T + 1), (B - 1, T), (B, 1, T)])
def test_attention_mask_shape(shape):
    batch = make_batch(attention_mask=torch.ones(shape, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        batch.validate()


@pytest.mark.parametrize("shape", [(B, T - 1), (B - 1, T), (B, 2, T), (B, 3, T - 1), (B, T, 3)])
def test_position_ids_shape(shape):
    batch = make_batch(position_ids=torch.zeros(shape, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids"):
        batch.validate()


@pytest.mark.parametrize("r", [T, T + 2])
def test_responses_not_shorter_than_sequence(r):
    batch = make_batch(targets=False, responses=torch.ones(B, r, dtype=torch.long))
    with pytest.raises(ValueError, match="responses") as err:
        batch.validate()
    assert f"R={r}" in str(err.value) and f"T={T}" in str(err.value)


def test_empty_responses():
    batch = make_batch(targets=False, responses=torch.ones(B, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="responses"):
        batch.validate()


@pytest.mark.parametrize("shape", [(B - 1, R), (B + 1, R), (B,), (B, R, 1)])
def test_responses_bad_shape(shape):
    batch = make_batch(targets=False, responses=torch.ones(shape, dtype=torch.long))
    with pytest.raises(ValueError, match="responses"):
        batch.validate()


@pytest.mark.parametrize("key", ["values", "returns", "response_mask"])
@pytest.mark.parametrize("shape", [(B, R + 1), (B, R - 1), (B - 1, R), (B,), (B, R, 1)])
def test_per_token_shape(key, shape):
    batch = make_batch(**{key: torch.zeros(shape)})
    with pytest.raises(ValueError, match=key):
        batch.validate(require_targets=True)


def test_empty_batch():
    tensors = {k: v[:0] for k, v in make_tensors().items()}
    batch = Batch(tensors)
    assert len(batch) == 0
    with pytest.raises(ValueError, match="empty") as err:
        batch.validate(require_targets=True)
    assert "input_ids" in str(err.value)


@pytest.mark.parametrize("key", ["values", "returns"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_target_at_valid_position(key, bad):
    tensors = make_tensors()
    x = tensors[key].clone()
    x[2, 1] = bad  # row 2 has 2 response tokens: position 1 is valid
    batch = make_batch(**{key: x})
    batch.validate()  # targets are not checked for compute_values
    with pytest.raises(ValueError, match=key) as err:
        batch.validate(require_targets=True)
    assert "sample 2" in str(err.value)


@pytest.mark.parametrize("key", ["values", "returns"])
def test_non_finite_target_at_masked_position_is_accepted(key):
    x = make_tensors()[key].clone()
    x[1, 1] = float("nan")  # row 1 has 1 response token: positions 1, 2 are padding
    x[1, 2] = float("inf")
    x[2, 2] = float("nan")
    make_batch(**{key: x}).validate(require_targets=True)


def test_non_finite_target_masked_by_explicit_response_mask_is_accepted():
    values = make_tensors()["values"].clone()
    values[0, 0] = float("nan")  # valid per attention_mask, but masked out by response_mask
    mask = torch.tensor([[0, 1, 1], [1, 0, 0], [1, 1, 0]])
    make_batch(values=values, response_mask=mask).validate(require_targets=True)


def test_integer_targets():
    batch = make_batch(values=torch.zeros(B, R, dtype=torch.long))
    with pytest.raises(TypeError, match="values"):
        batch.validate(require_targets=True)


def test_response_mask_outside_attention_mask():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]])  # row 1 has only 1 attended response token
    batch = make_batch(response_mask=mask)
    with pytest.raises(ValueError, match="response_mask") as err:
        batch.validate()
    assert "attention_mask" in str(err.value)


def test_attention_mask_not_binary():
    attention = make_tensors()["attention_mask"].clone()
    attention[0, 0] = 2
    batch = make_batch(attention_mask=attention)
    with pytest.raises(ValueError, match="attention_mask"):
        batch.validate()


def test_response_mask_not_binary():
    mask = make_tensors()["attention_mask"][:, -R:].clone()
    mask[0, 0] = 2
    batch = make_batch(response_mask=mask)
    with pytest.raises(ValueError, match="response_mask"):
        batch.validate()


@pytest.mark.parametrize("n", [B - 1, B + 1])
def test_non_tensor_with_wrong_length(n):
    data: dict[str, Any] = dict(make_tensors())
    data["multi_modal_inputs"] = [{} for _ in range(n)]
    batch = Batch.from_any(data)
    with pytest.raises(ValueError, match="multi_modal_inputs") as err:
        batch.validate()
    assert str(n) in str(err.value) and str(B) in str(err.value)


def test_multi_modal_inputs_that_are_not_per_sample():
    data: dict[str, Any] = dict(make_tensors())
    data["multi_modal_inputs"] = {"pixel_values": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"multi_modal_inputs.*one dict per sample"):
        Batch.from_any(data).validate()


@pytest.mark.parametrize(
    "extra",
    [1.0, "greedy", None, {"temperature": 1.0}, torch.tensor(0.7), np.arange(2), ["a", "b"], np.float32(3.0)],
    ids=["float", "str", "none", "dict", "0-dim-tensor", "short-array", "short-list", "numpy-scalar"],
)
def test_extras_of_any_type_are_carried_never_read(extra):
    """A plain-dict batch (or a DataProto's non_tensor_batch) may carry extras the critic does not read, e.g. verl's
    `temperature`: they pass validation and ride along through index/split/select unchanged."""
    data: dict[str, Any] = {**make_tensors(), "extra": extra}
    batch = Batch.from_any(data)
    batch.validate(require_targets=True)
    part = batch.index([2, 0])
    carried = part.tensors.get("extra", part.non_tensors.get("extra"))
    assert carried is extra and len(part) == 2
    assert [len(b) for b in batch.split(2)] == [2] * (B // 2) + [1] * (B % 2)
    proto = FakeDataProto(TensorDict(make_tensors(), batch_size=[B]), {**make_non_tensors(), "extra": extra}, {})
    Batch.from_any(proto).index([1]).validate()


# ---------------------------------------------------------------------------------------------- to(device)


def test_to_moves_tensors_and_keeps_the_rest():
    data: dict[str, Any] = dict(make_tensors())
    data["uid"] = ["a", "b", "c"]
    batch = Batch.from_any(data)
    batch.meta_info["step"] = 4
    on_meta = batch.to("meta")
    assert all(v.device.type == "meta" for v in on_meta.tensors.values())
    assert on_meta.non_tensors == {"uid": ["a", "b", "c"]}
    assert on_meta.meta_info == {"step": 4}
    assert all(v.device.type == "cpu" for v in batch.tensors.values())  # the original is untouched
    assert on_meta["values"].shape == (B, R) and on_meta["input_ids"].dtype == torch.long
    back = batch.to(torch.device("cpu"))
    assert all(v.device.type == "cpu" for v in back.tensors.values())
    assert all(torch.equal(back[k], batch[k]) for k in batch.tensors)


class Placed:
    """A tensor stand-in on any device that records each copy `Batch.to` asks of it as (source, target,
    non_blocking): a CPU cannot race a copy, so the contract is checked on the arguments."""

    def __init__(self, device: str | torch.device, copies: list):
        self.device, self.copies = torch.device(device), copies

    def to(self, device: str | torch.device, non_blocking: bool = False) -> Placed:
        self.copies.append((self.device, torch.device(device), non_blocking))
        return Placed(device, self.copies)


@pytest.mark.parametrize(
    ("source", "target", "in_flight"),
    [("cpu", "cuda", True), ("cuda", "cpu", False), ("cuda:0", "cuda:1", False), ("cuda:1", "cpu", False)],
)
def test_to_leaves_only_copies_from_the_host_in_flight(source, target, in_flight):
    """A non-blocking copy from the host is ordered before any use by the device's stream; one off a device would be
    read by the host (or the other device) before it lands, so it blocks."""
    copies: list = []
    batch = Batch({key: Placed(source, copies) for key in ("input_ids", "attention_mask")})
    batch.to(target, non_blocking=True)
    assert copies == [(torch.device(source), torch.device(target), in_flight)] * 2
    batch.to(target)
    assert [blocking for *_, blocking in copies[2:]] == [False, False]


@pytest.mark.cuda
def test_a_cuda_batch_moved_to_the_host_holds_its_values():
    """The batch's data is written behind 0.1 s of queued GPU work: a copy that did not wait would read it early."""
    expected = make_tensors()
    zeros = {key: torch.zeros_like(value, device="cuda") for key, value in expected.items()}
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles on the stream before the data is written
    on_gpu = {key: zeros[key] + value.cuda(non_blocking=True) for key, value in expected.items()}
    moved = Batch(on_gpu).to("cpu", non_blocking=True)
    assert all(torch.equal(moved[key], value) for key, value in expected.items())


# ---------------------------------------------------------------------------------------------- position ids


@pytest.mark.parametrize(
    "change",
    [lambda p: torch.zeros_like(p), lambda p: p + 10**12, lambda p: p.flip(-1)],
    ids=["all-zero", "offset", "reversed"],
)
def test_position_ids_must_count_each_rows_valid_tokens_from_zero(change):
    """Anything else changes the values (and makes the padded and packed paths disagree)."""
    good = make_tensors()
    batch = make_batch(position_ids=change(good["position_ids"]))
    with pytest.raises(ValueError, match=r"position_ids'\] does not count the valid tokens of sample \d from 0"):
        batch.validate()
    padding_only = good["position_ids"].masked_fill(good["attention_mask"] == 0, 7)  # padding is never read
    make_batch(position_ids=padding_only).validate()


def test_mrope_position_ids_start_at_zero_and_never_go_back_in_time():
    good = make_tensors()
    text = good["position_ids"][:, None, :].expand(-1, 3, -1).clone()
    image = text.clone()
    image[:, 1:, 5:] = 0  # height/width components of an image block may go back; the temporal one may not
    make_batch(position_ids=image).validate()
    for bad in (text + 1, text.flip(-1), text - 5):
        with pytest.raises(ValueError, match=r"mrope, \[B, 3, T\]\) of sample \d does not start at 0"):
            make_batch(position_ids=bad).validate()


# ---------------------------------------------------------------------------------------------- validate: issue 30


def refusal(batch: Batch, pattern: str, require_targets: bool = True) -> str:
    """The one-line ValueError/TypeError `batch.validate` raises, checked against `pattern`."""
    with pytest.raises((ValueError, TypeError), match=pattern) as err:
        batch.validate(require_targets=require_targets)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("rows", [[1], [0, 1, 2]], ids=["one-row", "whole-batch"])
def test_an_all_zero_attention_mask_row_is_refused(rows):
    attention = make_tensors()["attention_mask"].clone()
    attention[rows] = 0
    message = refusal(make_batch(attention_mask=attention), r"batch\['attention_mask'\] is all 0 in", False)
    assert f"{len(rows)} of {B} sample(s) (first: sample {rows[0]})" in message and "drop those samples" in message


@pytest.mark.parametrize(
    "key", ["input_ids", "attention_mask", "position_ids", "responses", "returns", "response_mask"]
)
def test_a_meta_tensor_is_refused(key):
    tensors = make_tensors()
    value = (tensors[key] if key in tensors else tensors["attention_mask"][:, -R:]).to("meta")
    refusal(make_batch(**{key: value}), rf"batch\['{key}'\] is on the meta device .*pass a tensor that holds data")


def test_a_tensordict_on_the_meta_device_is_refused():
    td = TensorDict(make_tensors(), batch_size=[B], device="meta")
    refusal(Batch.from_any(td), r"batch\['input_ids'\] is on the meta device")


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("key", ["input_ids", "attention_mask", "position_ids", "values"])
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "nested"])
def test_a_sparse_or_nested_tensor_is_refused(key, layout):
    x = make_tensors()[key]
    if layout == "nested":
        x, fix = torch.nested.nested_tensor(list(x), layout=torch.jagged), "to_padded_tensor"
    else:
        x, fix = (x.to_sparse() if layout == "sparse_coo" else x.to_sparse_csr()), "to_dense"
    message = refusal(make_batch(**{key: x}), rf"batch\['{key}'\] is a \S*{layout.split('_')[-1]} tensor; pass a dense")
    assert fix in message


def _nan_positions() -> torch.Tensor:
    positions = make_tensors()["position_ids"].float()
    positions[0, 2] = float("nan")  # row 0 is all valid
    return positions


@pytest.mark.parametrize(
    "positions",
    [
        _nan_positions(),
        make_tensors()["position_ids"].float(),
        make_tensors()["position_ids"].double(),
        make_tensors()["position_ids"].short(),
        make_tensors()["position_ids"].to(torch.uint8),
        make_tensors()["position_ids"].bool(),
        make_tensors()["position_ids"][:, None].expand(-1, 3, -1).float(),
    ],
    ids=["float-nan", "float", "float64", "int16", "uint8", "bool", "mrope-float"],
)
def test_position_ids_must_be_long_or_int32(positions):
    """An embedding lookup (absolute-position models) takes long/int32 only; NaN positions cannot count tokens."""
    message = refusal(make_batch(position_ids=positions), r"batch\['position_ids'\] must be a torch.long \(or")
    assert str(positions.dtype) in message and "position_ids.long()" in message


@pytest.mark.parametrize(
    ("key", "convert", "name"),
    [
        ("returns", lambda x: x.numpy(), "numpy.ndarray"),
        ("values", lambda x: x.tolist(), "list"),
        ("input_ids", lambda x: x.tolist(), "list"),
        ("attention_mask", lambda x: x.numpy(), "numpy.ndarray"),
        ("response_mask", lambda x: x.numpy(), "numpy.ndarray"),  # else silently replaced by attention_mask's
    ],
)
@pytest.mark.parametrize("container", ["dict", "dataproto"])
def test_a_key_that_is_not_a_tensor_is_named_with_its_type(key, convert, name, container):
    tensors = make_tensors()
    value = convert(tensors[key] if key in tensors else tensors["attention_mask"][:, -R:])
    rest = {k: v for k, v in tensors.items() if k != key}
    data = {**rest, key: value} if container == "dict" else FakeDataProto(TensorDict(rest, [B]), {key: value}, {})
    message = refusal(Batch.from_any(data), rf"batch\['{key}'\] is a {name}, not a torch.Tensor")
    assert f"torch.as_tensor({key})" in message


def test_a_zero_dim_input_ids_is_refused():
    refusal(make_batch(input_ids=torch.tensor(3)), r"batch\['input_ids'\] must be \[B, T\], got shape \(\)")


@pytest.mark.parametrize("key", ["values", "returns"])
@pytest.mark.parametrize("big", [1e300, -1e200, 2.0**481], ids=["1e300", "-1e200", "2**481"])
def test_float64_targets_whose_square_overflows_float64_are_refused(key, big):
    x = make_tensors()[key].double()
    x[2, 1] = big  # valid
    message = refusal(make_batch(**{key: x}), rf"batch\['{key}'\] holds 1 value\(s\) beyond ±3.12e\+144")
    assert "sample 2, response token 1" in message and "overflow float64" in message


def test_large_targets_that_float64_holds_or_that_are_masked_are_accepted():
    """float32 3e38 is valid input (its overflowing float32 loss is a skipped step, DESIGN §3); 2**480 is the limit."""
    x = make_tensors()["returns"].double()
    x[0, 0], x[1, 1] = 2.0**480, 1e300  # row 1 has one response token: position 1 is padding
    make_batch(returns=x).validate(require_targets=True)
    make_batch(values=torch.full((B, R), 3e38)).validate(require_targets=True)


@pytest.mark.parametrize("part", ["batch", "non_tensor_batch", "meta_info"])
def test_a_dataproto_part_of_the_wrong_type_is_refused(part):
    parts = {"batch": TensorDict(make_tensors(), batch_size=[B]), "non_tensor_batch": {}, "meta_info": {}}
    parts[part] = [1, 2]
    with pytest.raises(TypeError, match=rf"the DataProto's {part} must be .* or None, got list"):
        Batch.from_any(FakeDataProto(**parts))


def test_validate_accepts_int32_positions_and_any_mask_dtype():
    tensors = make_tensors()
    Batch({**tensors, "position_ids": tensors["position_ids"].int()}).validate(require_targets=True)
    mask = tensors["attention_mask"][:, -R:]
    for dtype in (torch.bool, torch.float32, torch.int32):
        edits = {"attention_mask": tensors["attention_mask"].to(dtype), "response_mask": mask.to(dtype)}
        Batch({**tensors, **edits}).validate(require_targets=True)


def test_digest_tells_batches_apart_by_rows_tokens_ids_and_target_bits():
    """What the ranks of one sequence-parallel group compare per call (critics/base.py `_check_same_batch`)."""
    tensors = make_tensors()
    digest = Batch(tensors).digest()
    assert torch.equal(digest, Batch({k: v.clone() for k, v in tensors.items()}).digest())
    assert digest[:2].tolist() == [B, T] and len(digest) == 2 + 7  # 7 entries summed; response_mask absent: -1
    swapped = edited(tensors, input_ids=tensors["input_ids"].flip(1))  # the same ids elsewhere: position-weighted
    signed = edited(tensors, returns=torch.where(tensors["returns"] == 0, -0.0, tensors["returns"]))  # bits, not sums
    fewer = {k: v[:-1] for k, v in tensors.items()}
    for other in (swapped, signed, fewer):
        assert not torch.equal(digest, Batch(other).digest())
