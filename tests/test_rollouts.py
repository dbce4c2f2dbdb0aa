"""Rollout files (JSON Lines / Parquet) → critic batches, row-level errors, and atomic writing of values."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ppo_critic import rollouts
from ppo_critic.rollouts import Rollout, collate, read_rollouts, write_values

GOOD = {"prompt_ids": [1, 2], "response_ids": [3], "reward": 1.0}

# Three rows with both reward kinds: P = 3, R = 3 after padding.
ROWS = [
    {"prompt_ids": [5, 6, 7], "response_ids": [8, 9], "token_level_rewards": [0.5, -1.0], "extra": "ignored"},
    {"prompt_ids": [11], "response_ids": [12, 13, 14], "reward": 2.0},
    {"prompt_ids": [21, 22], "response_ids": [23], "reward": -0.25},
]
PAD = 99
EXPECTED = {
    "input_ids": [[5, 6, 7, 8, 9, PAD], [PAD, PAD, 11, 12, 13, 14], [PAD, 21, 22, 23, PAD, PAD]],
    "attention_mask": [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]],
    "position_ids": [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3], [0, 0, 1, 2, 2, 2]],
    "responses": [[8, 9, PAD], [12, 13, 14], [23, PAD, PAD]],
    "response_mask": [[1, 1, 0], [1, 1, 1], [1, 0, 0]],
}
EXPECTED_REWARDS = [[0.5, -1.0, 0.0], [0.0, 0.0, 2.0], [-0.25, 0.0, 0.0]]


def write_jsonl(path: Path, lines: list[object]) -> Path:
    """One line per item: dicts/lists as JSON, strings verbatim (to write blank or broken lines)."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def write_parquet(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    columns = {key: [row.get(key) for row in rows] for key in dict.fromkeys(k for row in rows for k in row)}
    pq.write_table(pa.table(columns, schema=schema), path)
    return path


def check_batch(batch: dict[str, torch.Tensor]) -> None:
    assert set(batch) == {*EXPECTED, "token_level_rewards"}
    for key, want in EXPECTED.items():
        assert batch[key].dtype == torch.int64, key
        assert torch.equal(batch[key], torch.tensor(want)), key
    assert batch["token_level_rewards"].dtype == torch.float32
    assert torch.equal(batch["token_level_rewards"], torch.tensor(EXPECTED_REWARDS))


# ---------------------------------------------------------------------------------------------------------------
# Round trips


def test_jsonl_round_trip(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [ROWS[0], "", "   ", ROWS[1], ROWS[2]])
    got = read_rollouts(path)
    assert got == [
        Rollout([5, 6, 7], [8, 9], [0.5, -1.0]),
        Rollout([11], [12, 13, 14], [0.0, 0.0, 2.0]),
        Rollout([21, 22], [23], [-0.25]),
    ]
    check_batch(collate(got, pad_token_id=PAD))


def test_parquet_round_trip(tmp_path):
    schema = pa.schema(
        [
            ("prompt_ids", pa.list_(pa.int32())),
            ("response_ids", pa.large_list(pa.int64())),
            ("token_level_rewards", pa.list_(pa.float32())),
            ("reward", pa.float64()),
            ("extra", pa.string()),
        ]
    )
    path = write_parquet(tmp_path / "r.parquet", ROWS, schema)
    got = read_rollouts(str(path), vocab_size=24)
    assert [r.response_ids for r in got] == [[8, 9], [12, 13, 14], [23]]
    check_batch(collate(got, pad_token_id=PAD))


def test_parquet_many_row_groups_keep_order_and_row_numbers(tmp_path):
    rows = [{"prompt_ids": [i], "response_ids": [i + 1], "reward": float(i)} for i in range(10)]
    rows[7]["response_ids"] = []
    path = tmp_path / "r.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    with pytest.raises(ValueError, match=r"r\.parquet: row 8: field 'response_ids'"):
        read_rollouts(path)
    rows[7]["response_ids"] = [8]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    assert [r.prompt_ids for r in read_rollouts(path)] == [[i] for i in range(10)]


def test_collate_default_pad_and_single_row():
    batch = collate([Rollout([4], [7, 8], [0.0, 1.0])])
    assert batch["input_ids"].tolist() == [[4, 7, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2]]


def test_collate_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one rollout"):
        collate([])
    with pytest.raises(ValueError, match=r"rollouts\[1\]: token_level_rewards has 1 value"):
        collate([Rollout([1], [2], [0.0]), Rollout([1], [2, 3], [0.0])])


def test_numpy_scalars_and_arrays_are_accepted():
    row = {"prompt_ids": np.array([1, 2], dtype=np.int32), "response_ids": [np.int64(3)], "reward": np.float32(0.5)}
    assert rollouts._parse_row(row, vocab_size=None) == Rollout([1, 2], [3], [0.5])
    assert all(type(x) is int for x in rollouts._parse_row(row, None).prompt_ids)


# ---------------------------------------------------------------------------------------------------------------
# Malformed rows: each kind names the file, the row (= line) number and the field


IDS = "must be a non-empty list of integer token ids"
REWARDS = "must be a list of finite numbers, one per response token"
ONE_OF = (
    "needs exactly one of field 'token_level_rewards' (a list, one reward per response token) or field 'reward' "
    "(a scalar, put on the last response token), got"
)
NOT_JSON = "is not valid JSON (Expecting property name enclosed in double quotes at column 20)"
MALFORMED = {
    "ids-string": ({**GOOD, "response_ids": "abc"}, f"field 'response_ids' {IDS}, got 'abc'"),
    "ids-empty": ({**GOOD, "prompt_ids": []}, f"field 'prompt_ids' {IDS}, got []"),
    "ids-float": ({**GOOD, "prompt_ids": [1, 2.5]}, f"field 'prompt_ids' {IDS}, got [1, 2.5] (element 1 is 2.5)"),
    "ids-bool": ({**GOOD, "response_ids": [True]}, f"field 'response_ids' {IDS}, got [True] (element 0 is True)"),
    "ids-nested": ({**GOOD, "response_ids": [[1]]}, f"field 'response_ids' {IDS}, got [[1]] (element 0 is [1])"),
    "ids-null": ({**GOOD, "prompt_ids": None}, f"field 'prompt_ids' {IDS}, got None"),
    "ids-negative": (
        {**GOOD, "prompt_ids": [3, -1]},
        "field 'prompt_ids' must hold token ids in [0, 2**63), got -1 at element 1",
    ),
    "ids-missing": ({"response_ids": [1], "reward": 0.0}, f"field 'prompt_ids' is missing; it {IDS}"),
    "rewards-length": (
        {**GOOD, "reward": None, "token_level_rewards": [1.0, 2.0]},
        f"field 'token_level_rewards' {REWARDS} (the response has 1 token(s)), got 2 value(s)",
    ),
    "rewards-nan": (
        '{"prompt_ids": [1], "response_ids": [2, 3], "token_level_rewards": [0, NaN]}',
        f"field 'token_level_rewards' {REWARDS}, got [0, nan] (element 1 is nan)",
    ),
    "rewards-scalar": (
        {**GOOD, "reward": None, "token_level_rewards": 1.0},
        f"field 'token_level_rewards' {REWARDS}, got 1.0",
    ),
    "reward-string": ({**GOOD, "reward": "1.0"}, "field 'reward' must be a finite number, got '1.0'"),
    "reward-inf": (
        '{"prompt_ids": [1], "response_ids": [2], "reward": -Infinity}',
        "field 'reward' must be a finite number, got -inf",
    ),
    "reward-bool": ({**GOOD, "reward": False}, "field 'reward' must be a finite number, got False"),
    "reward-both": ({**GOOD, "token_level_rewards": [1.0]}, f"{ONE_OF} both"),
    "reward-neither": ({**GOOD, "reward": None}, f"{ONE_OF} neither"),
    "not-object": ([1, 2], "must be a JSON object with fields prompt_ids, response_ids, ..., got array"),
    "bad-json": ('{"prompt_ids": [1], ', NOT_JSON),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_jsonl_row(tmp_path, kind):
    row, message = MALFORMED[kind]
    path = write_jsonl(tmp_path / "rollouts.jsonl", [GOOD, "", GOOD, row, GOOD])
    with pytest.raises(ValueError) as info:
        read_rollouts(path)
    assert str(info.value) == f"{path}: row 4: {message}"


def test_each_bad_row_is_reported_on_its_own_line(tmp_path):
    lines = [GOOD, {**GOOD, "response_ids": "abc"}, GOOD, {**GOOD, "reward": float("nan")}, "{not json", GOOD]
    path = write_jsonl(tmp_path / "rollouts.jsonl", lines)
    with pytest.raises(ValueError) as info:
        read_rollouts(path)
    lines = str(info.value).splitlines()
    assert len(lines) == 3
    assert lines[0] == f"{path}: row 2: field 'response_ids' must be a non-empty list of integer token ids, got 'abc'"
    assert lines[1].startswith(f"{path}: row 4: field 'reward' must be a finite number")
    assert lines[2].startswith(f"{path}: row 5: is not valid JSON")


def test_many_bad_rows_are_counted_and_the_list_is_cut(tmp_path):
    path = write_jsonl(tmp_path / "rollouts.jsonl", [{**GOOD, "prompt_ids": []}] * 15)
    with pytest.raises(ValueError) as info:
        read_rollouts(path)
    lines = str(info.value).splitlines()
    assert len(lines) == 11 and lines[9].startswith(f"{path}: row 10: field 'prompt_ids'")
    assert lines[10] == f"{path}: ... and 5 more malformed rows (15 in total)"


def test_invalid_utf8_line(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"rollouts\.jsonl: row 2: is not valid UTF-8"):
        read_rollouts(path)


def test_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n")
    assert read_rollouts(path) == [Rollout([1, 2], [3], [1.0])]


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_jsonl(tmp_path, content):
    path = tmp_path / "rollouts.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"rollouts\.jsonl: no rollout rows found"):
        read_rollouts(path)


def test_empty_parquet(tmp_path):
    schema = pa.schema(
        [("prompt_ids", pa.list_(pa.int64())), ("response_ids", pa.list_(pa.int64())), ("reward", pa.float64())]
    )
    path = tmp_path / "r.parquet"
    pq.write_table(schema.empty_table(), path)
    with pytest.raises(ValueError, match=r"r\.parquet: no rollout rows found"):
        read_rollouts(path)


def test_parquet_column_of_wrong_type(tmp_path):
    path = write_parquet(tmp_path / "r.parquet", [{"prompt_ids": "12", "response_ids": [3], "reward": 1.0}])
    with pytest.raises(ValueError) as info:
        read_rollouts(path)
    assert str(info.value) == f"{path}: column 'prompt_ids' must have Parquet/Arrow type list<integer>, got string"
    path = write_parquet(tmp_path / "r.parquet", [{"prompt_ids": [1], "response_ids": [3], "reward": True}])
    with pytest.raises(ValueError, match="column 'reward' must have Parquet/Arrow type integer or floating, got bool"):
        read_rollouts(path)


def test_parquet_missing_column(tmp_path):
    path = write_parquet(tmp_path / "r.parquet", [{"prompt_ids": [1], "response_ids": [3]}])
    with pytest.raises(ValueError, match=r"missing column\(s\) 'token_level_rewards' or 'reward'"):
        read_rollouts(path)


def test_parquet_bad_rows(tmp_path):
    rows = [
        {"prompt_ids": [1], "response_ids": [3], "reward": 1.0},
        {"prompt_ids": None, "response_ids": [3], "reward": 1.0},
        {"prompt_ids": [1], "response_ids": [3], "reward": float("nan")},
    ]
    path = write_parquet(tmp_path / "r.parquet", rows)
    with pytest.raises(ValueError) as info:
        read_rollouts(path)
    assert str(info.value).startswith(f"{path}: row 2: field 'prompt_ids' must be a non-empty list of integer token")
    assert str(info.value).splitlines()[1].startswith(f"{path}: row 3: field 'reward'")


def test_not_a_parquet_file(tmp_path):
    path = tmp_path / "r.parquet"
    path.write_text("hello")
    with pytest.raises(ValueError, match=r"r\.parquet: not a readable Parquet file"):
        read_rollouts(path)


def test_vocab_size_bound(tmp_path):
    path = write_jsonl(tmp_path / "rollouts.jsonl", ROWS)
    assert len(read_rollouts(path, vocab_size=24)) == 3
    with pytest.raises(ValueError) as info:
        read_rollouts(path, vocab_size=23)
    message = f"{path}: row 3: field 'response_ids' must hold token ids in [0, vocab_size=23), got 23 at element 0"
    assert str(info.value) == message
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        read_rollouts(path, vocab_size=0)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        read_rollouts(path)


@pytest.mark.parametrize("name", ["r.csv", "r.json", "rollouts"])
def test_unknown_extension(tmp_path, name):
    path = tmp_path / name
    path.write_text("{}")
    with pytest.raises(ValueError, match=r"unsupported file extension .*; supported: \.jsonl, \.parquet"):
        read_rollouts(path)
    with pytest.raises(ValueError, match="unsupported file extension"):
        write_values(path, [[1.0]])


# ---------------------------------------------------------------------------------------------------------------
# Writing values


VALUES = [[0.5, -1.25], [3.0], [0.0, 1.0, 2.0], [7.5]]


def read_values(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    return pq.read_table(path).to_pylist()


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_write_values_round_trip(tmp_path, suffix):
    path = tmp_path / "new" / "dir" / f"values{suffix}"
    ragged = [torch.tensor(VALUES[0]), np.array(VALUES[1], dtype=np.float32), VALUES[2], tuple(VALUES[3])]
    write_values(path, ragged)
    assert read_values(path) == [{"row": i, "values": v} for i, v in enumerate(VALUES)]
    write_values(str(path), VALUES[::-1])  # overwrites
    assert read_values(path) == [{"row": i, "values": v} for i, v in enumerate(VALUES[::-1])]
    assert os.listdir(path.parent) == [path.name]


def test_written_file_has_the_usual_permissions(tmp_path):
    reference = tmp_path / "reference"
    reference.write_text("")
    write_values(tmp_path / "v.jsonl", VALUES)
    assert (tmp_path / "v.jsonl").stat().st_mode == reference.stat().st_mode


def test_write_values_rejects_non_finite(tmp_path):
    path = tmp_path / "v.jsonl"
    with pytest.raises(ValueError, match=r"values\[1\] has 1 NaN/Inf value\(s\) \(first at position 1\)"):
        write_values(path, [[1.0], [2.0, math.nan]])
    assert not path.exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_write_values_is_atomic(tmp_path, monkeypatch, suffix):
    path = tmp_path / f"values{suffix}"
    write_values(path, VALUES)
    before = path.read_bytes()
    name = "_write_jsonl" if suffix == ".jsonl" else "_write_parquet"
    real = getattr(rollouts, name)

    def half_then_fail(tmp: str, rows: list[list[float]]) -> None:
        real(tmp, rows[:1])
        assert os.path.getsize(tmp) > 0  # something was written before the failure
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(rollouts, name, half_then_fail)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_values(path, [[9.0]] * 5)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [path.name]


def test_failed_rename_leaves_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "values.jsonl"

    def fail(*args: object) -> None:
        raise OSError("rename failed")

    monkeypatch.setattr(rollouts.os, "replace", fail)
    with pytest.raises(OSError, match="rename failed"):
        write_values(path, VALUES)
    assert os.listdir(tmp_path) == []
