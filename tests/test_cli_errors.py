"""Every refusal of the CLI is one clear line (issue 30): exit code 2, one error line on stderr naming the key (or the
file and the row) and the fix, no traceback, and nothing written. Values too large for their type, sizes that cannot
be allocated, malformed AdamW betas, `--config` files that are not YAML mappings, rows longer than the model's
positions. Cases that would allocate without the checks run the real CLI in a subprocess under an address-space limit,
so that a regression fails fast instead of exhausting the machine."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppo_critic.cli import main

LIMIT_BYTES = 6 * 2**30  # the subprocesses' address space: torch and a tiny model fit, the refused batches do not
DIGITS_400 = "1" + "0" * 399  # an integer too large for a float
DIGITS_5000 = "1" * 5000  # an integer longer than Python converts from a string (4300 digits)
# a run of seconds, in case a refusal is missed (the option under test comes after these and wins)
QUICK = [
    "trainer.steps=2",
    "trainer.rollout_batch_size=4",
    "trainer.eval_size=4",
    "critic.ppo_mini_batch_size=4",
    "trainer.progress=false",
    "trainer.logger=[jsonl]",
    "trainer.export_hf=false",
]


def one_line(code: int, err: str) -> str:
    """The refusal's message: exit code 2, no traceback, and exactly one error line on stderr, the last (before it
    only argparse's usage, or a progress bar of the model's loading)."""
    assert code == 2, err[-3000:]
    lines = err.rstrip("\n").splitlines()
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err, err[-3000:]
    return errors[0]


def refusal(argv: list, capsys) -> str:
    """Run `ppo-critic ARGV` in this process and return its one-line refusal."""
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in argv])
    return one_line(exit_.value.code, capsys.readouterr().err)


def refusal_in_subprocess(argv: list, cwd: Path, timeout: float = 120) -> tuple[str, float]:
    """Run the real CLI in a subprocess whose address space is capped at `LIMIT_BYTES`; its refusal and the seconds."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "ppo_critic", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=cap,
        env=env,
        cwd=cwd,
    )
    return one_line(done.returncode, done.stderr), time.monotonic() - start


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def row_of(prompt: int, response: int) -> dict:
    """A row of `prompt` + `response` token ids and a final reward."""
    return {"prompt_ids": [1] * prompt, "response_ids": [2] * response, "reward": 1.0}


# ---------------------------------------------------------------------------------------------------------------
# Values too large for their type, malformed betas


@pytest.mark.parametrize(
    ("override", "words"),
    [
        (f"trainer.gamma={DIGITS_400}", ["trainer.gamma=<a 400-digit integer>", "must be a finite number"]),
        (f"trainer.dist_timeout_s={DIGITS_400}", ["trainer.dist_timeout_s=<a 400-digit integer>", "finite number"]),
        ("trainer.dist_timeout_s=1e300", ["trainer.dist_timeout_s=1e+300 is too large", "use at most"]),
        (f"trainer.steps={DIGITS_5000}", ["trainer.steps=<a 5000-digit integer>", "64-bit"]),
        ("trainer.log_every=9223372036854775808", ["trainer.log_every=9223372036854775808", "64-bit integer"]),
        ("critic.optim.betas=[0.9]", ["critic.optim.betas=[0.9] must be a list of 2 numbers"]),
        ("critic.optim.betas=x", ["critic.optim.betas='x' must be a list of 2 numbers"]),
        ("critic.optim.betas=[0.9,0.99,0.1]", ["critic.optim.betas=[0.9, 0.99, 0.1] must be a list of 2 numbers"]),
        ("critic.optim.betas=[[0.9],[0.99]]", ["critic.optim.betas[0]=[0.9] must be a number"]),
        (f"critic.optim.betas=[0.9,{DIGITS_5000}]", ["critic.optim.betas[1]=<a 5000-digit integer>", "64-bit"]),
    ],
    ids=[
        "gamma-400-digits",
        "timeout-400-digits",
        "timeout-1e300",
        "steps-5000-digits",
        "log-every-2**63",
        "betas-one",
        "betas-string",
        "betas-three",
        "betas-nested",
        "betas-5000-digits",
    ],
)
def test_a_value_too_large_or_malformed_is_one_line_naming_the_key(override, words, tmp_path, capsys):
    line = refusal(["train", *QUICK, f"trainer.run_dir={tmp_path / 'run'}", override], capsys)
    assert all(word in line for word in words), line
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------------------
# Sizes that cannot be allocated: refused by the config check, before torch is imported or a file is written


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["trainer.eval_size=10000000000"], ["trainer.eval_size=10000000000:", "lower trainer.eval_size"]),
        (
            ["trainer.rollout_batch_size=1099511627776", "critic.ppo_mini_batch_size=64"],
            ["trainer.rollout_batch_size=1099511627776:", "lower trainer.rollout_batch_size"],
        ),
        (["task.max_prompt_len=100000000"], ["task.max_prompt_len=100000000:", "lower task.max_prompt_len"]),
        (
            ["data=rollouts.jsonl", "trainer.rollout_batch_size=1099511627776", "critic.ppo_mini_batch_size=64"],
            ["trainer.rollout_batch_size=1099511627776:", "lower trainer.rollout_batch_size"],
        ),
    ],
    ids=["eval-size", "rollout-batch", "max-prompt-len", "rollout-batch-of-a-file"],
)
def test_a_batch_that_cannot_fit_in_memory_is_refused_before_anything_runs(overrides, words, tmp_path):
    write_rows(tmp_path / "rollouts.jsonl", [row_of(2, 1)] * 4)
    line, seconds = refusal_in_subprocess(["train", "trainer.run_dir=run", *overrides], cwd=tmp_path)
    assert all(word in line for word in words) and "more than this machine's" in line, line
    assert not (tmp_path / "run").exists()
    assert seconds < 60  # a config check, not an allocation


# ---------------------------------------------------------------------------------------------------------------
# --config files that are not a YAML mapping of options


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"- 1\n- 2\n", ["holds a list, not options", "trainer: {steps: 100}"]),
        (b"just a string\n", ["holds a single value ('just a string'), not options"]),
        (bytes(range(256)) * 4, ["not a text file", "YAML saved as UTF-8"]),
        (b"trainer:\n  steps: \xff\xfe3\n", ["is not UTF-8 text (byte 18 is 0xff)", "YAML saved as UTF-8"]),
        ("trainer:\n  steps: 3\n".encode("utf-16"), ["is UTF-16 text; save it as UTF-8"]),
        ("trainer:\n  steps: 3\n".encode("utf-32"), ["is UTF-32 text; save it as UTF-8"]),
        ("trainer:\n  steps: 3\n".encode("utf-16-le"), ["not a text file", "UTF-16 without a byte-order mark"]),
        (f"trainer:\n  steps: {DIGITS_5000}\n".encode(), [":2:10: trainer.steps=<a 5000-digit integer>", "64-bit"]),
    ],
    ids=["list", "scalar", "binary", "latin-1", "utf-16", "utf-32", "utf-16-no-bom", "5000-digits"],
)
def test_a_config_file_that_is_not_options_is_one_line_naming_it(content, words, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_bytes(content)
    line = refusal(["train", "--config", config, *QUICK, f"trainer.run_dir={tmp_path / 'run'}"], capsys)
    assert str(config) in line and all(word in line for word in words), line
    assert not (tmp_path / "run").exists()


def test_a_config_directory_is_one_line_naming_it(tmp_path, capsys):
    line = refusal(["train", "--config", tmp_path, *QUICK, f"trainer.run_dir={tmp_path / 'run'}"], capsys)
    assert f"--config {tmp_path} is a directory; give the YAML file of options" in line, line
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# Rollout rows longer than the model's positions


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny HF value model (TokenClassification, one label) with 64 positions, naming its objective as an export
    does."""
    from transformers import AutoModelForTokenClassification, Qwen2Config

    from conftest import TINY

    config = Qwen2Config(**{**TINY, "max_position_embeddings": 64}, num_labels=1, use_cache=False)
    config.ppo_critic_vf_loss_type = "mse"
    directory = tmp_path_factory.mktemp("critic")
    AutoModelForTokenClassification.from_config(config).save_pretrained(directory)
    return directory


def test_values_refuses_a_row_longer_than_the_models_positions(model_dir, tmp_path, capsys):
    rows = [row_of(2, 1), row_of(40, 30)]
    data, out = write_rows(tmp_path / "rows.jsonl", rows), tmp_path / "values.jsonl"
    line = refusal(["values", model_dir, f"data={data}", f"out={out}"], capsys)
    assert f"{data}: row 2: field 'response_ids' has 30 tokens, so the row has at least 70" in line, line
    assert "more than the model's 64 positions; use a model with max_position_embeddings >= 70" in line, line
    assert not out.exists()


def test_values_refuses_a_3m_token_row_before_any_work_on_its_tokens(model_dir, tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", [row_of(1, 3_000_000)])
    out = tmp_path / "values.jsonl"
    line, seconds = refusal_in_subprocess(["values", model_dir, f"data={data}", f"out={out}"], cwd=tmp_path)
    assert "row 1: field 'response_ids' has 3000000 tokens" in line and "max_position_embeddings" in line, line
    assert not out.exists() and seconds < 60  # without the check: minutes of work, and gigabytes


def test_train_refuses_a_row_longer_than_the_models_positions(tmp_path, capsys):
    data = write_rows(tmp_path / "rows.jsonl", [row_of(2, 1)] * 3 + [row_of(10, 10)])
    run = tmp_path / "run"
    argv = [
        "train",
        *QUICK,
        f"data={data}",
        f"trainer.run_dir={run}",
        "critic.model.override_config.max_position_embeddings=16",
    ]
    line = refusal(argv, capsys)
    assert f"{data}: row 4: field 'response_ids' has 10 tokens, so the row has at least 20" in line, line
    assert "more than the model's 16 positions" in line and not run.exists()


def test_values_checks_the_rollout_file_before_it_builds_the_model(model_dir, tmp_path, capsys, monkeypatch):
    """Issue 43, the first hour: a bad file cost 7-26 s of model building before its error. Now the file's rows are
    read (against the model's vocabulary and positions, from its config alone) first; no worker is built."""
    import ppo_critic.train

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the rollout file was checked")

    monkeypatch.setattr(ppo_critic.train, "make_worker", no_model)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt_ids": [1, 2], "response_ids": [3], "reward": 1.0}\n{"prompt_ids": [1]}\n')
    line = refusal(["values", model_dir, f"data={data}", f"out={tmp_path / 'v.jsonl'}"], capsys)
    assert f"{data}" in line and "row 2" in line, line
    too_big = write_rows(tmp_path / "ids.jsonl", [{**row_of(2, 1), "prompt_ids": [10**6, 1]}])
    line = refusal(["values", model_dir, f"data={too_big}", f"out={tmp_path / 'v.jsonl'}"], capsys)
    assert "row 1" in line and "vocab" in line, line
