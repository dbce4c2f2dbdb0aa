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
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from ppo_critic.config.critic import ModelConfig
from ppo_critic.data.rows import Rollout, collate
from ppo_critic.rollout_files import read as rollouts
from ppo_critic.rollout_files import write as values_file
from ppo_critic.rollout_files.read import read_rollouts, tokenizer_dir
from ppo_critic.rollout_files.write import write_values

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
    no_tokenizer = rollouts.Tokenizer(None)
    assert rollouts._parse_row(row, None, no_tokenizer) == Rollout([1, 2], [3], [0.5])
    assert all(type(x) is int for x in rollouts._parse_row(row, None, no_tokenizer).prompt_ids)


# ---------------------------------------------------------------------------------------------------------------
# Malformed rows: each kind names the file, the row (= line) number and the field


IDS = "must be a non-empty list of integer token ids"
REWARDS = "must be a list of finite numbers, one per response token"
ONE_OF = (
    "needs exactly one of field 'token_level_rewards' (a list, one reward per response token) or field 'reward' "
    "(a scalar, put on the last response token), got"
)
NOT_JSON = "is not valid JSON (Expecting property name enclosed in double quotes at column 20)"
VERL_DUMP = "a row of verl's rollout dump (trainer.rollout_data_dir) has fields input, output, score"
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
    "ids-missing": (
        {"response_ids": [1], "reward": 0.0},
        f"field 'prompt_ids' is missing; it {IDS} (or give field 'prompt' as text)",
    ),
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
    "reward-beyond-float32": (  # issue 52: was "17 NaN/Inf, sample 1" from the critic, naming neither row nor field
        {**GOOD, "reward": 1e39},
        "field 'reward' holds 1e+39, beyond float32's range (±3.40e+38) in which the critic computes; scale the "
        "rewards down",
    ),
    "rewards-sum-beyond-float32": (
        {**GOOD, "response_ids": [1, 2], "reward": None, "token_level_rewards": [-3e38, 3e38]},
        "field 'token_level_rewards': the rewards add up to 6e+38 in size, beyond float32's range (±3.40e+38), so "
        "the returns would be infinite; scale the rewards down",
    ),
    "verl-dump-without-output": (  # issue 52: named prompt_ids, a field of ours the row never meant to have
        {"input": "a question", "score": 1.0},
        f"field 'output' is missing; {VERL_DUMP}",
    ),
    "verl-dump-without-input": (
        {"output": "an answer", "score": 1.0},
        f"field 'input' is missing; {VERL_DUMP}",
    ),
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
# Text rows, tokenised with a local tokenizer directory


WORDS = ["<pad>", "<s>", "</s>", "<unk>", "<user>", "<assistant>", "how", "are", "you", "fine", "thanks"]
VOCAB = {word: i for i, word in enumerate([*WORDS, "what", "is", "two", "plus", "four", "?"])}
# `<{role}>`: the rendered prompt shows that the prompt became a single *user* message.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %} <assistant>{% endif %}"
)
TEXT_ROWS = [
    {"prompt": "how are you", "response": "fine thanks", "token_level_rewards": [0.5, -1.0, 2.0]},
    {"prompt": "what is two plus two ?", "response": "four", "reward": 1.0},
    {"prompt": "how are you", "response": "fine </s>", "reward": -0.5},  # ends with EOS already: not doubled
    {"prompt": "what is zzz ?", "response": "", "reward": 3.0},  # an unknown word; an empty answer is just EOS
]
# (prompt ids without a chat template: BOS + words; with TEMPLATE: <user> words <assistant>; response ids + EOS)
TEXT_IDS = [
    ([1, 6, 7, 8], [4, 6, 7, 8, 5], [9, 10, 2]),
    ([1, 11, 12, 13, 14, 13, 16], [4, 11, 12, 13, 14, 13, 16, 5], [15, 2]),
    ([1, 6, 7, 8], [4, 6, 7, 8, 5], [9, 2]),
    ([1, 11, 12, 3, 16], [4, 11, 12, 3, 16, 5], [2]),
]


def save_tokenizer(directory: Path, vocab: dict[str, int] = VOCAB, chat_template: str | None = None, **special) -> str:
    """A word-level tokenizer that puts BOS before plain text, saved like a model's tokenizer directory."""
    tokens = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>", **special}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=tokens["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **tokens)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory) -> str:
    return save_tokenizer(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> str:
    return save_tokenizer(tmp_path_factory.mktemp("chat"), chat_template=TEMPLATE)


def id_rows(templated: bool) -> list[dict]:
    """TEXT_ROWS with the text replaced by the token ids it must become."""
    rows = []
    for row, (plain, chat, response) in zip(TEXT_ROWS, TEXT_IDS, strict=True):
        rest = {k: v for k, v in row.items() if k not in ("prompt", "response")}
        rows.append({"prompt_ids": chat if templated else plain, "response_ids": response, **rest})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    return write_jsonl(path, rows) if path.suffix == ".jsonl" else write_parquet(path, rows)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("templated", [False, True], ids=["plain", "chat-template"])
def test_text_rows_become_the_exact_token_ids(tmp_path, suffix, templated, plain_tokenizer, chat_tokenizer):
    tokenizer = chat_tokenizer if templated else plain_tokenizer
    got = read_rollouts(write_rows(tmp_path / f"text{suffix}", TEXT_ROWS), vocab_size=17, tokenizer=Path(tokenizer))
    assert [(r.prompt_ids, r.response_ids) for r in got] == [(c if templated else p, r) for p, c, r in TEXT_IDS]
    # Rewards are read after tokenisation, against the response with its EOS: a scalar lands on the EOS token.
    assert [r.token_level_rewards for r in got] == [[0.5, -1.0, 2.0], [0.0, 1.0], [0.0, -0.5], [3.0]]
    expected = read_rollouts(write_rows(tmp_path / f"ids{suffix}", id_rows(templated)))
    assert got == expected
    for key, tensor in collate(expected, pad_token_id=PAD).items():
        assert torch.equal(collate(got, pad_token_id=PAD)[key], tensor), key


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_file_may_mix_id_rows_text_rows_and_sides(tmp_path, suffix, chat_tokenizer):
    ids = id_rows(templated=True)
    half_text = {"prompt": TEXT_ROWS[1]["prompt"], "response_ids": ids[1]["response_ids"], "reward": 1.0}
    mixed = [TEXT_ROWS[0], half_text, ids[2], TEXT_ROWS[3]]
    got = read_rollouts(write_rows(tmp_path / f"mixed{suffix}", mixed), tokenizer=chat_tokenizer)
    assert got == read_rollouts(write_rows(tmp_path / f"ids{suffix}", ids))


def test_tokenizer_is_loaded_once_and_only_for_text(tmp_path, monkeypatch, plain_tokenizer):
    loads: list[str] = []
    real = rollouts._load_tokenizer
    monkeypatch.setattr(rollouts, "_load_tokenizer", lambda directory: loads.append(directory) or real(directory))
    ids_only = write_jsonl(tmp_path / "ids.jsonl", id_rows(templated=False))
    assert len(read_rollouts(ids_only, tokenizer=tmp_path / "no-such-dir")) == 4
    assert loads == []
    assert len(read_rollouts(write_jsonl(tmp_path / "text.jsonl", TEXT_ROWS), tokenizer=plain_tokenizer)) == 4
    assert loads == [plain_tokenizer]


def test_tokenizer_without_eos_appends_nothing(tmp_path):
    tokenizer = save_tokenizer(tmp_path / "tok", eos_token=None)
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "how", "response": "fine thanks", "reward": 1.0}])
    assert read_rollouts(path, tokenizer=tokenizer) == [Rollout([1, 6], [9, 10], [0.0, 1.0])]
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "how", "response": "", "reward": 1.0}])
    with pytest.raises(ValueError) as info:
        read_rollouts(path, tokenizer=tokenizer)
    assert (
        str(info.value) == f"{path}: row 1: field 'response' must be text that tokenises to at least one token, got ''"
    )


NEEDS_TOKENIZER = (
    "field 'prompt' is text, which needs a tokenizer: set critic.model.tokenizer_path=DIR (a local tokenizer "
    "directory; library: read_rollouts(..., tokenizer=DIR)), or give 'prompt_ids'"
)
TEXT_MALFORMED = {
    "both-prompt": (
        {**TEXT_ROWS[0], "prompt_ids": [1, 2]},
        "fields 'prompt_ids' and 'prompt' are both given, so the prompt is ambiguous; keep one: 'prompt_ids' "
        "(token ids) or 'prompt' (text to tokenise)",
    ),
    "both-response": (
        {**GOOD, "response": "fine"},
        "fields 'response_ids' and 'response' are both given, so the response is ambiguous; keep one: "
        "'response_ids' (token ids) or 'response' (text to tokenise)",
    ),
    "not-a-string": (
        {**TEXT_ROWS[1], "prompt": ["how"]},
        "field 'prompt' must be a string (text to tokenise), got ['how']",
    ),
    "rewards-length": (
        {**TEXT_ROWS[0], "token_level_rewards": [0.5, -1.0]},
        f"field 'token_level_rewards' {REWARDS} (the response has 3 token(s)), got 2 value(s)",
    ),
    "outside-vocab": (
        {"prompt": "how are you", "response": "fine four", "reward": 1.0},
        "field 'response' is tokenised to id 15 at token 1, outside [0, vocab_size=11): the tokenizer does not "
        "match the model (set critic.model.tokenizer_path to the model's tokenizer)",
    ),
}


@pytest.mark.parametrize("kind", list(TEXT_MALFORMED))
def test_malformed_text_row(tmp_path, kind, plain_tokenizer):
    row, message = TEXT_MALFORMED[kind]
    path = write_jsonl(tmp_path / "rollouts.jsonl", [GOOD, "", row, TEXT_ROWS[2]])
    with pytest.raises(ValueError) as info:
        read_rollouts(path, vocab_size=11, tokenizer=plain_tokenizer)
    assert str(info.value) == f"{path}: row 3: {message}"


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_text_without_a_tokenizer_names_row_field_and_fix(tmp_path, suffix):
    ids = id_rows(templated=False)
    path = write_rows(tmp_path / f"r{suffix}", [ids[0], ids[1], TEXT_ROWS[2]])
    with pytest.raises(ValueError) as info:
        read_rollouts(path)
    assert str(info.value) == f"{path}: row 3: {NEEDS_TOKENIZER}"
    assert len(read_rollouts(path, tokenizer=save_tokenizer(tmp_path / "tok"))) == 3


def test_word_the_tokenizer_cannot_encode(tmp_path):
    vocab = {word: i for i, word in enumerate(WORDS) if word != "<unk>"}
    tokenizer = save_tokenizer(tmp_path / "tok", vocab, unk_token=None)
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "how are you", "response": "fine zzz", "reward": 1.0}])
    with pytest.raises(ValueError, match=r"r\.jsonl: row 1: field 'response' could not be tokenised \(.*UNK"):
        read_rollouts(path, tokenizer=tokenizer)


def test_tokenizer_directory_that_cannot_be_loaded(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", TEXT_ROWS)
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=f"tokenizer directory {missing} does not exist or is not a directory"):
        read_rollouts(path, tokenizer=missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"could not load a tokenizer from {tmp_path / 'empty'} "):
        read_rollouts(path, tokenizer=tmp_path / "empty")


def test_parquet_text_columns(tmp_path):
    path = write_parquet(tmp_path / "r.parquet", [{"prompt": "how", "response": [3], "reward": 1.0}])
    with pytest.raises(
        ValueError, match=r"r\.parquet: column 'response' must have Parquet/Arrow type string, got list<"
    ):
        read_rollouts(path)
    path = write_parquet(tmp_path / "r.parquet", [{"response": "fine", "reward": 1.0}])
    with pytest.raises(ValueError, match=r"missing column\(s\) 'prompt_ids' or 'prompt'; the file has columns"):
        read_rollouts(path)


def test_tokenizer_dir_prefers_tokenizer_path_then_model_path():
    assert tokenizer_dir(ModelConfig()) is None
    assert tokenizer_dir(ModelConfig(path="/models/m")) == "/models/m"
    assert tokenizer_dir(ModelConfig(path="/models/m", tokenizer_path="/tok")) == "/tok"
    assert tokenizer_dir(ModelConfig(tokenizer_path="/tok")) == "/tok"


# ---------------------------------------------------------------------------------------------------------------
# verl's rollout dump (trainer.rollout_data_dir): text decoded with skip_special_tokens=True, and a score


PAD_ID = VOCAB["<pad>"]
# what the policy saw and wrote: its prompt rendered by TEMPLATE (chat) or with a BOS (plain), its answer ending in EOS
POLICY_ROWS = [
    ([4, 6, 7, 8, 5], [1, 6, 7, 8], [9, 10, 2], 1.5),
    ([4, 11, 12, 13, 14, 13, 16, 5], [1, 11, 12, 13, 14, 13, 16], [15, 2], 0),
]


def verl_dump_row(tokenizer, prompt_ids: list[int], response_ids: list[int], score: float) -> dict:
    """A row as verl's trainer writes it to `trainer.rollout_data_dir/<step>.jsonl`: the left-padded prompt and the
    right-padded response decoded with `skip_special_tokens=True`, the summed score, the ground truth and the step."""
    padded_prompt, padded_response = [PAD_ID] * 2 + prompt_ids, response_ids + [PAD_ID] * 3
    return {
        "input": tokenizer.decode(padded_prompt, skip_special_tokens=True),
        "output": tokenizer.decode(padded_response, skip_special_tokens=True),
        "gts": "4",
        "score": score,
        "step": 1,
    }


@pytest.fixture(scope="module")
def roles_tokenizer(tmp_path_factory) -> str:
    """TEMPLATE with its role markers special tokens (as a real chat template's are): verl's dump drops them."""
    roles = ["<user>", "<assistant>"]
    return save_tokenizer(tmp_path_factory.mktemp("roles"), chat_template=TEMPLATE, additional_special_tokens=roles)


@pytest.mark.parametrize("templated", [False, True], ids=["plain", "chat-template"])
def test_verls_rollout_dump_gives_back_the_policys_token_ids(tmp_path, templated, plain_tokenizer, roles_tokenizer):
    directory = roles_tokenizer if templated else plain_tokenizer
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    expected = [(chat if templated else plain, response, score) for chat, plain, response, score in POLICY_ROWS]
    dump = [verl_dump_row(tokenizer, prompt, response, score) for prompt, response, score in expected]
    assert dump[0]["input"] == "how are you"  # neither the template's roles nor the BOS survive
    assert dump[0]["output"] == "fine thanks"  # nor the EOS
    ours = {"prompt_ids": [1, 6], "response_ids": [9], "reward": 2.0, "input": "unread", "output": "unread"}
    got = read_rollouts(write_jsonl(tmp_path / "1.jsonl", [*dump, ours]), vocab_size=17, tokenizer=directory)
    want = [Rollout(p, r, [0.0] * (len(r) - 1) + [float(s)]) for p, r, s in expected]
    assert got == [*want, Rollout([1, 6], [9], [2.0])]


# A Qwen-style template: a default system message, role names as plain text between special markers
QWEN_STYLE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def byte_level_tokenizer(tmp_path_factory) -> str:
    """A byte-level BPE (GPT-2 / Qwen style) trained here on a few lines, with QWEN_STYLE: EOS <|im_end|>."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    lines = ["You are a helpful assistant.", "What is 2 + 2?\nThe answer is 4.", "system user assistant"]
    backend.train_from_iterator(
        lines * 10, trainers.BpeTrainer(vocab_size=400, special_tokens=special, initial_alphabet=alphabet)
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=special
    )
    tokenizer.chat_template = QWEN_STYLE
    tokenizer.save_pretrained(directory := tmp_path_factory.mktemp("byte_level"))
    return str(directory)


def test_verls_dump_of_a_byte_level_chat_model_gives_back_the_policys_ids(tmp_path, byte_level_tokenizer):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(byte_level_tokenizer)
    policy = []
    for question, answer in [("What is 2 + 2?", "The answer is 4."), ("  Hi\n\nyou  ", " 4\n")]:
        message = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(message, add_generation_prompt=True, return_dict=False)
        policy.append((prompt, [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id], 1.0))
    dump = [verl_dump_row(tokenizer, prompt, response, score) for prompt, response, score in policy]
    assert dump[0]["input"] == "system\nYou are a helpful assistant.\nuser\nWhat is 2 + 2?\nassistant\n"
    got = read_rollouts(write_jsonl(tmp_path / "1.jsonl", dump), tokenizer=byte_level_tokenizer)
    assert [(r.prompt_ids, r.response_ids) for r in got] == [(p, r) for p, r, _ in policy]


VERL_MALFORMED = {
    "another-template": (
        {"input": "how are you", "output": "fine", "score": 1.0},
        "field 'input' ('how are you') is not what verl's trainer.rollout_data_dir writes for one user message "
        "in this tokenizer's chat template, so the prompt's token ids cannot be recovered; set "
        "critic.model.tokenizer_path to the policy's tokenizer, or record 'prompt_ids' (or 'prompt': the user "
        "message) instead",
    ),
    "no-score": (
        {"input": "<user> how <assistant>", "output": "fine"},
        f"field 'score' is missing; {VERL_DUMP}",
    ),
    "score-nan": (
        '{"input": "<user> how <assistant>", "output": "fine", "score": NaN}',
        "field 'score' must be a finite number, got nan",
    ),
    "input-not-text": (
        {"input": [6, 7], "output": "fine", "score": 1.0},
        "field 'input' must be a string (text to tokenise), got [6, 7]",
    ),
}


@pytest.mark.parametrize("kind", list(VERL_MALFORMED))
def test_a_verl_dump_row_that_cannot_be_used_names_the_field(tmp_path, kind, chat_tokenizer):
    row, message = VERL_MALFORMED[kind]
    good = {"input": "<user> how are you <assistant>", "output": "fine", "score": 1.0}  # role markers not special
    path = write_jsonl(tmp_path / "1.jsonl", [good, row])
    with pytest.raises(ValueError) as info:
        read_rollouts(path, tokenizer=chat_tokenizer)
    assert str(info.value) == f"{path}: row 2: {message}"
    assert read_rollouts(write_jsonl(tmp_path / "good.jsonl", [good]), tokenizer=chat_tokenizer) == [
        Rollout([4, 6, 7, 8, 5], [9, 2], [0.0, 1.0])
    ]


def test_a_verl_dump_read_with_another_tokenizer_is_refused(tmp_path, plain_tokenizer):
    path = write_jsonl(tmp_path / "1.jsonl", [{"input": "how are zzz", "output": "fine", "score": 1.0}])
    with pytest.raises(ValueError, match=r"1\.jsonl: row 1: field 'input' \('how are zzz'\) is not what verl's"):
        read_rollouts(path, tokenizer=plain_tokenizer)  # 'zzz' is <unk>, which decodes to nothing
    with pytest.raises(ValueError) as info:
        read_rollouts(path)
    needs = "field 'input' is text, which needs a tokenizer: set critic.model.tokenizer_path=DIR (a local tokenizer"
    assert str(info.value) == f"{path}: row 1: {needs} directory; library: read_rollouts(..., tokenizer=DIR))"


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
    real = getattr(values_file, name)

    def half_then_fail(tmp: str, rows: list[list[float]]) -> None:
        real(tmp, rows[:1])
        assert os.path.getsize(tmp) > 0  # something was written before the failure
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(values_file, name, half_then_fail)
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


# ---------------------------------------------------------------------------------------------------------------
# Rows longer than the model's positions (`max_length`, issue 30)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_row_longer_than_max_length_names_the_row_the_field_and_the_fix(tmp_path, suffix):
    path = write_rows(tmp_path / f"rollouts{suffix}", ROWS)  # rows of 3 + 2, 1 + 3 and 2 + 1 tokens
    assert len(read_rollouts(path, max_length=5)) == 3  # a row of exactly max_length tokens fits
    with pytest.raises(ValueError) as info:
        read_rollouts(path, max_length=4)
    assert str(info.value) == (
        f"{path}: row 1: field 'response_ids' has 2 tokens, so the row has at least 5, more than the model's 4 "
        "positions; use a model with max_position_embeddings >= 5, or shorter rows"
    )
    with pytest.raises(ValueError) as info:
        read_rollouts(path, max_length=3)
    assert str(info.value).splitlines() == [
        f"{path}: row 1: field 'prompt_ids' has 3 tokens, so the row has at least 4, more than the model's 3 positions;"
        " use a model with max_position_embeddings >= 4, or shorter rows",
        f"{path}: row 2: field 'response_ids' has 3 tokens, so the row has at least 4, more than the model's 3 "
        "positions; use a model with max_position_embeddings >= 4, or shorter rows",
    ]


def test_a_text_row_longer_than_max_length_is_named_once_tokenised(tmp_path, plain_tokenizer):
    path = write_jsonl(tmp_path / "text.jsonl", TEXT_ROWS)  # row 2: 7 prompt + 2 response tokens
    assert len(read_rollouts(path, tokenizer=plain_tokenizer, max_length=9)) == 4
    with pytest.raises(ValueError) as info:
        read_rollouts(path, tokenizer=plain_tokenizer, max_length=8)
    assert str(info.value).startswith(f"{path}: row 2: field 'response' has 2 tokens, so the row has at least 9")


def test_a_3m_token_row_is_refused_before_any_work_per_token(tmp_path, monkeypatch):
    path = write_jsonl(
        tmp_path / "long.jsonl", [GOOD, {"prompt_ids": [1], "response_ids": [2] * 3_000_000, "reward": 1}]
    )
    checked = []
    monkeypatch.setattr(rollouts, "_is_int", lambda value: checked.append(value) or isinstance(value, int))
    with pytest.raises(ValueError, match=r"row 2: field 'response_ids' has 3000000 tokens, so the row has at least"):
        read_rollouts(path, max_length=64)
    assert len(checked) < 20  # the ids of the long row were never looked at one by one


@pytest.mark.parametrize("max_length", [0, 1, 2.5, True])
def test_max_length_must_fit_a_prompt_and_a_response_token(tmp_path, max_length):
    path = write_jsonl(tmp_path / "rollouts.jsonl", ROWS)
    with pytest.raises(ValueError, match="max_length must be an integer >= 2"):
        read_rollouts(path, max_length=max_length)


def test_a_directory_of_parquet_parts_reads_as_its_parts_in_name_order(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = tmp_path / "rollouts"
    parts.mkdir()
    for i in (1, 0):  # written out of order: read in name order
        table = pa.table({"prompt_ids": [[1, 2 + i]], "response_ids": [[3, 4]], "reward": [float(i)]})
        pq.write_table(table, parts / f"part-{i:05d}.parquet")
    (parts / "_SUCCESS").write_text("")  # what Spark-style writers leave beside the parts
    assert read_rollouts(parts) == [Rollout([1, 2], [3, 4], [0.0, 0.0]), Rollout([1, 3], [3, 4], [0.0, 1.0])]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"empty is a directory without \.parquet files"):
        read_rollouts(empty)


def test_a_pipe_or_a_device_is_refused_before_it_is_opened(tmp_path):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)  # opened, it would wait for a writer forever
    zero = tmp_path / "zero.jsonl"
    zero.symlink_to("/dev/zero")  # read, it would never end
    for path in (fifo, zero):
        with pytest.raises(ValueError, match="is not a regular file"):
            read_rollouts(path)


def test_rows_too_deep_or_with_an_unreadable_integer_and_doubled_parquet_columns_are_named(tmp_path):
    """Issue 43 family 8: a row nested thousands deep (RecursionError), a 4400-digit integer (Python's message, no
    row), a Parquet file with a column twice (KeyError): each is now one line naming the file, the row and the fix."""
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"prompt_ids": [1, 2], "response_ids": [3], "reward": ' + "[" * 5000 + "1" + "]" * 5000 + "}\n")
    with pytest.raises(ValueError, match=r"deep.jsonl: row 1: nests too deeply to read"):
        read_rollouts(deep)
    huge = tmp_path / "huge.jsonl"
    good = '{"prompt_ids": [1, 2], "response_ids": [3], "reward": 1.0}\n'
    huge.write_text(good + '{"prompt_ids": [1, ' + "9" * 4400 + '], "response_ids": [3], "reward": 1.0}\n')
    with pytest.raises(ValueError, match=r"huge.jsonl: row 2: holds an integer too long to read \(4400 digits\)"):
        read_rollouts(huge)
    doubled = tmp_path / "dup.parquet"
    columns = [pa.array([[1, 2]]), pa.array([[3]]), pa.array([1.0]), pa.array([2.0])]
    pq.write_table(pa.table(columns, names=["prompt_ids", "response_ids", "reward", "reward"]), doubled)
    with pytest.raises(ValueError, match=r"dup.parquet: column\(s\) \['reward'\] appear more than once"):
        read_rollouts(doubled)


def test_a_parquet_file_whose_pages_cannot_be_decoded_is_named_with_the_row_reached(tmp_path, monkeypatch):
    """Issue 43 family 8: a compressed Parquet file whose codec pyarrow lacks raised pyarrow's error without the
    file. Made here by a reader that fails as such a build does, after the first batch."""
    path = tmp_path / "rows.parquet"
    rows = [{"prompt_ids": [1, 2], "response_ids": [3], "reward": 1.0}] * 4
    pq.write_table(pa.Table.from_pylist(rows), path, compression="zstd", row_group_size=2)
    original = pq.ParquetFile.iter_batches

    def lacking_codec(self, *args, **kwargs):
        batches = original(self, *args, **{**kwargs, "batch_size": 2})
        yield next(batches)
        raise pa.ArrowNotImplementedError("Support for codec 'zstd' not built")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", lacking_codec)
    with pytest.raises(ValueError, match=r"rows.parquet: cannot read its rows after row 2 \(Support for codec 'zstd'"):
        read_rollouts(path)
