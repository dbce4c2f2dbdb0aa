"""Recorded rollout files (JSON Lines or Parquet) → rollout rows (`data/rows.py` pads them into batches).

A rollout row holds a prompt, a response and exactly one of `token_level_rewards` (one per response token) or
`reward` (a scalar, put on the last response token). Other fields are ignored. The prompt is `prompt_ids` (token
ids) or `prompt` (text); the response is `response_ids` or `response`; each side on its own, so one file may mix
id rows and text rows. Text is tokenised with the tokenizer directory passed to `read_rollouts` (see `Tokenizer`).
A row of verl's rollout dump (`trainer.rollout_data_dir`: `input`, `output`, `score`, and no prompt or response field
of ours) is read as verl wrote it: `input` is the prompt decoded without special tokens, `output` the response
likewise, `score` its reward (see `Tokenizer.decoded_prompt`). A directory is read as its `*.parquet` parts in name
order (what verl and HF datasets write).
Every malformed row is reported as ``<path>: row <n>: field '<name>' must be ..., got ...`` (for JSON Lines, n is
the line number).
"""

from __future__ import annotations

import errno
import json
import math
import numbers
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ppo_critic.data.rows import Rollout

if TYPE_CHECKING:
    from ppo_critic.config.critic import ModelConfig

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")
REWARD_FIELDS = ("token_level_rewards", "reward")
_SIDES = (("prompt_ids", "prompt"), ("response_ids", "response"))  # (token ids, text) of each side
_VERL_SIDES = ((None, "input"), (None, "output"))  # text only: verl records no token ids
_VERL_FIELDS = ("input", "output", "score")  # a row of verl's rollout dump
_PLACEHOLDER = "\x00ppo-critic-message\x00"  # a user message no chat template writes by itself
_MAX_INT64 = 2**63
_IDS_EXPECTED = "must be a non-empty list of integer token ids"
_REWARDS_EXPECTED = "must be a list of finite numbers, one per response token"
_REWARD_EXPECTED = "must be a finite number"
_LISTED_ROWS = 10
FLOAT32_MAX = 3.4028234663852886e38  # rewards and the returns they sum to are float32 tensors


class _RowError(ValueError):
    """A malformed row; the reader adds the path and the row number."""


# ---------------------------------------------------------------------------------------------------------------
# Reading


def read_rollouts(
    path: str | os.PathLike,
    vocab_size: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    max_length: int | None = None,
) -> list[Rollout]:
    """Read every rollout of a `.jsonl` or `.parquet` file; raise ValueError naming the malformed rows.

    `vocab_size` bounds every token id (given or tokenised); `tokenizer` is a local tokenizer directory, loaded
    only if a row carries text (`prompt` / `response`). `tokenizer_dir` picks it from the model config. `max_length`
    (the model's positions, `max_position_embeddings`) bounds each row's prompt + response tokens: a list of ids is
    measured before its ids are checked one by one, text once tokenised; an overlong row is never collated.
    """
    name = os.fspath(path)
    if os.path.isdir(name):
        return [r for part in parquet_parts(name) for r in read_rollouts(part, vocab_size, tokenizer, max_length)]
    rows, decode = _reader_for(name)
    _check_vocab_size(vocab_size)
    _check_max_length(max_length)
    if not os.path.exists(name):
        raise FileNotFoundError(errno.ENOENT, "rollout file not found", name)
    if not stat.S_ISREG(os.stat(name).st_mode):  # a FIFO would block forever, a device never end
        raise ValueError(f"{name} is not a regular file (a pipe or a device?); give a .jsonl or .parquet file")
    text = Tokenizer(tokenizer)
    rollouts: list[Rollout] = []
    bad: list[tuple[int, str]] = []
    for number, raw in rows(name):
        try:
            rollouts.append(_parse_row(decode(raw), vocab_size, text, max_length))
        except _RowError as e:
            bad.append((number, str(e)))
    if bad:
        raise ValueError(_describe_bad_rows(name, bad))
    if not rollouts:
        raise ValueError(f"{name}: no rollout rows found (the file is empty or holds only blank lines)")
    return rollouts


def parquet_parts(directory: str) -> list[str]:
    """The `*.parquet` files of a directory (what verl and HF datasets write: one file per part), in name order."""
    parts = sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".parquet"))
    if not parts:
        raise ValueError(f"{directory} is a directory without .parquet files; give a rollout file or such a directory")
    return parts


def _reader_for(path: str) -> tuple[Callable[[str], Iterator[tuple[int, Any]]], Callable[[Any], Any]]:
    suffix = file_format(path)
    if suffix == ".jsonl":
        return _iter_jsonl, _decode_json_line
    return _iter_parquet, _identity


def file_format(path: str) -> str:
    """The rollout file format `path` names by its extension (".jsonl" or ".parquet"); ValueError otherwise."""
    suffix = Path(path).suffix.lower()
    if suffix not in SUPPORTED_EXTENSIONS:
        raise ValueError(
            f"{path}: unsupported file extension {suffix or '(none)'!r}; supported: {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    return suffix


def _check_vocab_size(vocab_size: int | None) -> None:
    if vocab_size is not None and (not _is_int(vocab_size) or vocab_size <= 0):
        raise ValueError(f"vocab_size must be a positive integer or None, got {vocab_size!r}")


def _check_max_length(max_length: int | None) -> None:
    """`max_length`, when given, leaves room for a prompt token and a response token."""
    if max_length is not None and (not _is_int(max_length) or max_length < 2):
        raise ValueError(f"max_length must be an integer >= 2 (a prompt and a response token), got {max_length!r}")


def _describe_bad_rows(path: str, bad: list[tuple[int, str]]) -> str:
    """One line per malformed row (the first `_LISTED_ROWS`), so every problem can be fixed in one pass."""
    lines = [f"{path}: row {number}: {message}" for number, message in bad[:_LISTED_ROWS]]
    if len(bad) > _LISTED_ROWS:
        lines.append(f"{path}: ... and {len(bad) - _LISTED_ROWS} more malformed rows ({len(bad)} in total)")
    return "\n".join(lines)


def _iter_jsonl(path: str) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if number == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
            if line.strip():
                yield number, line


def _decode_json_line(line: bytes) -> Any:
    try:
        return json.loads(line.decode("utf-8").strip())
    except UnicodeDecodeError as e:
        raise _RowError(f"is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise _RowError(f"is not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise _RowError("nests too deeply to read (thousands of brackets); a rollout row is flat") from None
    except ValueError as e:  # an integer of more digits than Python converts
        digits = re.search(r"has (\d+) digits", str(e))
        size = f" ({digits.group(1)} digits)" if digits else ""
        raise _RowError(f"holds an integer too long to read{size}; token ids and rewards are small numbers") from None


def _identity(row: Any) -> Any:
    return row


def _iter_parquet(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    pq = import_parquet()
    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses for a damaged file
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from e
    with file:
        columns = _check_parquet_schema(path, file.schema_arrow)
        number = 0
        batches = file.iter_batches(columns=columns)
        while True:
            try:
                record_batch = next(batches, None)
            except Exception as e:  # a codec pyarrow was built without, a damaged page
                raise ValueError(f"{path}: cannot read its rows after row {number} ({_one_line(e)})") from e
            if record_batch is None:
                return
            for row in record_batch.to_pylist():
                number += 1
                yield number, row


def import_parquet() -> Any:
    """pyarrow.parquet, or an ImportError saying how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("reading or writing .parquet rollout files needs pyarrow: pip install pyarrow") from e
    return pq


def _check_parquet_schema(path: str, schema: Any) -> list[str]:
    """The known columns present; raise ValueError for a missing or wrongly typed one."""
    import pyarrow as pa

    names = schema.names
    doubled = sorted({c for c in names if names.count(c) > 1})
    if doubled:
        raise ValueError(f"{path}: column(s) {doubled} appear more than once; write each column once")
    alternatives = [*_SIDES, REWARD_FIELDS]
    missing = ["' or '".join(fields) for fields in alternatives if not any(c in names for c in fields)]
    if missing:
        listed = ", ".join(f"'{c}'" for c in missing)
        raise ValueError(f"{path}: missing column(s) {listed}; the file has columns {names}")
    is_text = (pa.types.is_string, pa.types.is_large_string)
    expected = {
        "prompt_ids": ("list<integer>", lambda t: _is_list_of(t, pa.types.is_integer)),
        "prompt": ("string", lambda t: any(ok(t) for ok in is_text)),
        "response_ids": ("list<integer>", lambda t: _is_list_of(t, pa.types.is_integer)),
        "response": ("string", lambda t: any(ok(t) for ok in is_text)),
        "token_level_rewards": ("list<integer or floating>", lambda t: _is_list_of(t, _is_arrow_number)),
        "reward": ("integer or floating", _is_arrow_number),
    }
    present = [c for c in expected if c in schema.names]
    for column in present:
        kind = schema.field(column).type
        description, ok = expected[column]
        if not (ok(kind) or pa.types.is_null(kind)):
            raise ValueError(f"{path}: column {column!r} must have Parquet/Arrow type {description}, got {kind}")
    return present


def _is_list_of(kind: Any, ok: Callable[[Any], bool]) -> bool:
    import pyarrow as pa

    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    return any(is_list(kind) for is_list in lists) and ok(kind.value_type)


def _is_arrow_number(kind: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


# ---------------------------------------------------------------------------------------------------------------
# Row validation


def _parse_row(row: Any, vocab_size: int | None, text: Tokenizer, max_length: int | None = None) -> Rollout:
    """One row as a Rollout: its prompt (which leaves a position for the response), its response, its rewards."""
    if not isinstance(row, dict):
        raise _RowError(f"must be a JSON object with fields prompt_ids, response_ids, ..., got {_kind(row)}")
    verl = _is_verl_dump(row)
    missing = [field for field in _VERL_FIELDS if verl and field not in row]
    if missing:
        raise _RowError(
            f"field {missing[0]!r} is missing; a row of verl's rollout dump (trainer.rollout_data_dir) has fields "
            f"{', '.join(_VERL_FIELDS)}"
        )
    (prompt_ids_field, prompt_field), (response_ids_field, response_field) = _VERL_SIDES if verl else _SIDES
    budget = None if max_length is None else _Budget(max_length, max_length - 1)
    prompt_ids = _side(row, prompt_ids_field, prompt_field, vocab_size, text, budget)
    budget = None if max_length is None else _Budget(max_length, max_length - len(prompt_ids))
    response_ids = _side(row, response_ids_field, response_field, vocab_size, text, budget)
    rewards = _scalar_reward(row, "score", len(response_ids)) if verl else _rewards(row, len(response_ids))
    return Rollout(prompt_ids, response_ids, rewards)


def _is_verl_dump(row: dict[str, Any]) -> bool:
    """A row as verl's `trainer.rollout_data_dir` writes it: `input`, `output` and `score` (one of them is enough to
    read the row as verl's, so a missing one is named), and no field of ours for either side."""
    ours = [field for side in _SIDES for field in side]
    return any(field in row for field in _VERL_FIELDS) and not any(field in row for field in ours)


def _check_float32(rewards: list[float], field: str) -> list[float]:
    """Rewards, and the returns they add up to (at most the sum of their sizes, γ ≤ 1), must fit float32, the dtype
    the critic computes them in: beyond it they become inf."""
    largest = max(abs(r) for r in rewards)
    if largest > FLOAT32_MAX:
        raise _RowError(
            f"field {field!r} holds {largest:g}, beyond float32's range (±{FLOAT32_MAX:.2e}) in which the critic "
            "computes; scale the rewards down"
        )
    total = math.fsum(abs(r) for r in rewards)
    if total > FLOAT32_MAX:
        raise _RowError(
            f"field {field!r}: the rewards add up to {total:g} in size, beyond "
            f"float32's range (±{FLOAT32_MAX:.2e}), so the returns would be infinite; scale the rewards down"
        )
    return rewards


@dataclass(frozen=True)
class _Budget:
    """The model's positions (`max_length`) and how many of them a side of the row may still take (`room`)."""

    max_length: int
    room: int

    def check(self, field: str, tokens: int) -> None:
        """A row error naming `field` and the fix when its `tokens` do not fit in the room left."""
        if tokens > self.room:
            total = tokens + self.max_length - self.room
            raise _RowError(
                f"field {field!r} has {tokens} tokens, so the row has at least {total}, more than the "
                f"model's {self.max_length} positions; use a model with max_position_embeddings >= {total}, or "
                "shorter rows"
            )


def _side(
    row: dict[str, Any],
    ids_field: str,
    text_field: str,
    vocab_size: int | None,
    text: Tokenizer,
    budget: _Budget | None,
) -> list[int]:
    """The token ids of one side (prompt or response): given in `ids_field`, or tokenised from `text_field` (the only
    form when `ids_field` is None)."""
    if ids_field is not None and row.get(text_field) is None:
        return _token_ids(row, ids_field, text_field, vocab_size, budget)
    if ids_field is not None and row.get(ids_field) is not None:
        raise _RowError(
            f"fields {ids_field!r} and {text_field!r} are both given, so the {text_field} is ambiguous; "
            f"keep one: {ids_field!r} (token ids) or {text_field!r} (text to tokenise)"
        )
    value = row[text_field]
    if not isinstance(value, str):
        raise _RowError(f"field {text_field!r} must be a string (text to tokenise), got {_short(value)}")
    ids = text.encode(text_field, value)
    if not ids:
        raise _RowError(f"field {text_field!r} must be text that tokenises to at least one token, got {_short(value)}")
    if budget is not None:  # text has no cheap floor on its token count (an unknown word may be one token)
        budget.check(text_field, len(ids))
    _check_range(text_field, ids, vocab_size, tokenised=True)
    return ids


def _token_ids(
    row: dict[str, Any], field: str, text_field: str, vocab_size: int | None, budget: _Budget | None = None
) -> list[int]:
    if field not in row:
        raise _RowError(f"field {field!r} is missing; it {_IDS_EXPECTED} (or give field {text_field!r} as text)")
    value = row[field]
    if budget is not None and (isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim == 1)):
        budget.check(field, len(value))  # before any work per id
    items = _as_list(value)
    if not items:
        raise _RowError(f"field {field!r} {_IDS_EXPECTED}, got {_short(value)}")
    for i, item in enumerate(items):
        if not _is_int(item):
            raise _RowError(f"field {field!r} {_IDS_EXPECTED}, got {_short(value)} (element {i} is {_short(item)})")
    ids = [int(item) for item in items]
    _check_range(field, ids, vocab_size, tokenised=False)
    return ids


def _check_range(field: str, ids: list[int], vocab_size: int | None, tokenised: bool) -> None:
    """Every id in [0, vocab_size), or [0, 2**63) without one: a row's ids must index the model's embedding."""
    for i, item in enumerate(ids):
        if not 0 <= item < (vocab_size or _MAX_INT64):
            bound = f"vocab_size={vocab_size}" if vocab_size else "2**63"
            if tokenised:
                raise _RowError(
                    f"field {field!r} is tokenised to id {item} at token {i}, outside [0, {bound}): the tokenizer "
                    "does not match the model (set critic.model.tokenizer_path to the model's tokenizer)"
                )
            raise _RowError(f"field {field!r} must hold token ids in [0, {bound}), got {item} at element {i}")


def _rewards(row: dict[str, Any], response_length: int) -> list[float]:
    given = [f for f in REWARD_FIELDS if row.get(f) is not None]
    if len(given) != 1:
        which = "both" if given else "neither"
        raise _RowError(
            "needs exactly one of field 'token_level_rewards' (a list, one reward per response token) or field "
            f"'reward' (a scalar, put on the last response token), got {which}"
        )
    if given[0] == "reward":
        return _scalar_reward(row, "reward", response_length)
    return _reward_list(row["token_level_rewards"], response_length)


def _scalar_reward(row: dict[str, Any], field: str, response_length: int) -> list[float]:
    """The number in `field` on the last response token (where verl's reward managers put a sequence's score)."""
    value = row.get(field)
    if not _is_finite_number(value):
        raise _RowError(f"field {field!r} {_REWARD_EXPECTED}, got {_short(value)}")
    return _check_float32([0.0] * (response_length - 1) + [float(value)], field)


def _reward_list(value: Any, response_length: int) -> list[float]:
    items = _as_list(value)
    if items is None:
        raise _RowError(f"field 'token_level_rewards' {_REWARDS_EXPECTED}, got {_short(value)}")
    for i, item in enumerate(items):
        if not _is_finite_number(item):
            detail = f"(element {i} is {_short(item)})"
            raise _RowError(f"field 'token_level_rewards' {_REWARDS_EXPECTED}, got {_short(value)} {detail}")
    if len(items) != response_length:
        raise _RowError(
            f"field 'token_level_rewards' {_REWARDS_EXPECTED} (the response has {response_length} token(s)), "
            f"got {len(items)} value(s)"
        )
    return _check_float32([float(item) for item in items], "token_level_rewards")


def _as_list(value: Any) -> list[Any] | None:
    """The items of a list, tuple or 1-D numpy array; None for anything else."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return value.tolist()
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_finite_number(value: Any) -> bool:
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _kind(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------------------
# Text rows


def tokenizer_dir(model: ModelConfig) -> str | None:
    """The tokenizer directory for text rows: `critic.model.tokenizer_path`, else the model directory
    `critic.model.path` (where a Hugging Face model keeps its tokenizer), else None."""
    return model.tokenizer_path if model.tokenizer_path is not None else model.path


class Tokenizer:
    """Tokenises the text of rollout rows like the policy saw and wrote it; loads the tokenizer on first use.

    Prompt: with a chat template, the prompt is one user message rendered with `add_generation_prompt=True`;
    without one, it is encoded as the tokenizer encodes any text (its default special tokens, e.g. a BOS).
    Response: encoded without special tokens, then the tokenizer's EOS token appended (when it has one and the
    text does not already end with it), as a policy ends a finished answer. The tokenizer is loaded from local
    files only and never runs code from the directory (`trust_remote_code=False`).
    """

    def __init__(self, directory: str | os.PathLike | None):
        self.directory = None if directory is None else os.fspath(directory)
        self._tokenizer: Any = None
        self._frame: tuple[str, str] | None = None

    def encode(self, field: str, text: str) -> list[int]:
        """The token ids of `text` given in `field`: `prompt` / `response`, or verl's `input` / `output`."""
        encoders = {"prompt": self.prompt, "response": self.response, "input": self.decoded_prompt}
        return encoders.get(field, self.response)(text)  # verl's `output` is a response like ours

    def prompt(self, text: str) -> list[int]:
        """The prompt's token ids, ending where the policy's answer begins."""
        tokenizer = self._load("prompt")
        if not tokenizer.chat_template:
            return self._encode("prompt", text, add_special_tokens=True)
        messages = [{"role": "user", "content": text}]
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as e:  # jinja2 and tokenizers raise their own types
            raise _RowError(f"field 'prompt' could not be rendered with the tokenizer's chat template ({e})") from e
        return [int(i) for i in ids]

    def response(self, text: str) -> list[int]:
        """The response's token ids followed by EOS (the token that ends a policy's answer)."""
        eos = self._load("response").eos_token_id
        ids = self._encode("response", text, add_special_tokens=False)
        return ids if eos is None or ids[-1:] == [eos] else [*ids, eos]

    def decoded_prompt(self, text: str) -> list[int]:
        """The prompt ids that verl's dump decoded into `text` (`skip_special_tokens=True`, which drops the chat
        template's special tokens): the template around the one user message that `text` frames, checked by
        decoding them as verl does. A prompt of another shape (a system message of its own, other template
        arguments) or another tokenizer's is a row error naming the field: its ids cannot be recovered."""
        before, after = self._visible_frame()
        framed = text.startswith(before) and text.endswith(after) and len(text) >= len(before) + len(after)
        ids = self.prompt(text[len(before) : len(text) - len(after)]) if framed else []
        if not ids or self._tokenizer.decode(ids, skip_special_tokens=True) != text:
            raise _RowError(
                f"field 'input' ({_short(text)}) is not what verl's trainer.rollout_data_dir writes for one user "
                "message in this tokenizer's chat template, so the prompt's token ids cannot be recovered; set "
                "critic.model.tokenizer_path to the policy's tokenizer, or record 'prompt_ids' (or 'prompt': the "
                "user message) instead"
            )
        return ids

    def _visible_frame(self) -> tuple[str, str]:
        """What the chat template writes before and after a user message, as verl's dump shows it (special tokens
        dropped); ("", "") without a template. Computed once."""
        if self._frame is None:
            tokenizer = self._load("input")
            before, after = "", ""
            if tokenizer.chat_template:
                message = [{"role": "user", "content": _PLACEHOLDER}]
                try:
                    rendered = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
                except Exception as e:  # jinja2 raises its own types
                    raise _RowError(f"field 'input' needs the tokenizer's chat template, which failed ({e})") from e
                before, _, after = rendered.partition(_PLACEHOLDER)
            self._frame = (self._visible(before), self._visible(after))
        return self._frame

    def _visible(self, text: str) -> str:
        """`text` as a decode without special tokens shows it."""
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _encode(self, field: str, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return [int(i) for i in self._tokenizer.encode(text, add_special_tokens=add_special_tokens)]
        except Exception as e:  # the tokenizers library raises a bare Exception, e.g. for a word without [UNK]
            raise _RowError(f"field {field!r} could not be tokenised ({e})") from e

    def _load(self, field: str) -> Any:
        """The tokenizer, loaded once; a row error naming the fix when no directory was given."""
        if self.directory is None:
            instead = f", or give {field + '_ids'!r}" if field in ("prompt", "response") else ""
            raise _RowError(
                f"field {field!r} is text, which needs a tokenizer: set critic.model.tokenizer_path=DIR (a local "
                f"tokenizer directory; library: read_rollouts(..., tokenizer=DIR)){instead}"
            )
        if self._tokenizer is None:
            self._tokenizer = _load_tokenizer(self.directory)
        return self._tokenizer


def _load_tokenizer(directory: str) -> Any:
    if not os.path.isdir(directory):
        raise ValueError(
            f"tokenizer directory {directory} does not exist or is not a directory; rollout rows with text need "
            "critic.model.tokenizer_path=DIR (or critic.model.path) to name a local directory holding a tokenizer"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises OSError / ValueError / tokenizers' Exception for bad files
        raise ValueError(
            f"could not load a tokenizer from {directory} ({type(e).__name__}: {e}); rollout rows with text need "
            "critic.model.tokenizer_path=DIR to name a directory holding tokenizer.json / tokenizer_config.json"
        ) from e


def _one_line(err: Exception) -> str:
    """An exception's message on one line."""
    return " ".join(str(err).split())
