"""A run directory written by an earlier version still resumes, exports and computes values.

The fixture `tests/fixtures/run_46b319d/` is a run directory exactly as the code at commit 46b319d wrote it (a tiny
critic on the built-in counting task, 4 steps, checkpoints at steps 2 and 4, its HF export in `hf/`);
`tests/fixtures/run_46b319d_expected/` holds what that same code computed from it: the per-token values of a small
rollout file from the run directory and from its `hf/` export, and the metrics of its own resume to step 6.
`tests/fixtures/run_46b319d.md` gives the commands that made them. Each command works on a copy of the run in a
directory of its own (the committed fixture is never written, and checked unchanged at the end) and drives the
current code only through its command line, so the test does not depend on where modules live inside the package.
The three commands are independent and run side by side: most of each one's time is importing torch and
transformers, and one after the other they took most of a minute on a loaded 2-core machine.

Tolerances. Everything is fp32 on the CPU. The current code reproduced the old values bit for bit when this test was
written; 1e-6 (~30 ulp at the values' magnitude ~0.35) leaves room for another BLAS or thread split, while the
smallest real change measured, the step-2 checkpoint instead of the step-4 one, moves them by up to 1.5e-2. The
resumed training metrics are compared at a relative 1e-5 (conftest's FP32_REORDERED): the old code's resume ran with
two threads, these commands with one, and two optimizer steps later they differ by <= 3e-7 relative; restarting the
data, the RNG or Adam's moments instead of resuming them changes the loss in its second digit.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RUN = "run_46b319d"  # the copy keeps the name: the saved config.yaml says trainer.run_dir=run_46b319d
EXPECTED = FIXTURES / "run_46b319d_expected"
VALUES_ATOL = 1e-6
METRICS_TOL = {"rel_tol": 1e-5, "abs_tol": 1e-6}
TIMEOUT_S = 300
CLOCK_KEYS = ("time", "elapsed_s")  # with perf/*: what a clock measured, not what was computed

COMMANDS = {  # each runs in a directory of its own holding RUN (a copy) and rollouts.jsonl
    "resume": ("train", "--config", f"{RUN}/config.yaml", "trainer.steps=6"),
    "export": ("export", RUN, "exported"),
    "values": ("values", RUN, "data=rollouts.jsonl", "out=values.jsonl"),
}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


class Command:
    """One `ppo-critic` command started on its own copy of the old run; `finish()` waits for it and checks it."""

    def __init__(self, cwd: Path, args: tuple[str, ...]):
        self.cwd, self.args = cwd, args
        shutil.copytree(FIXTURES / RUN, cwd / RUN, symlinks=True)
        shutil.copy(EXPECTED / "rollouts.jsonl", cwd / "rollouts.jsonl")
        self._out, self._err = open(cwd / "stdout.txt", "w"), open(cwd / "stderr.txt", "w")  # noqa: SIM115
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a tiny model: threads only slow a loaded machine
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ppo_critic", *args], cwd=cwd, env=env, stdout=self._out, stderr=self._err
        )

    @property
    def run(self) -> Path:
        return self.cwd / RUN

    def finish(self) -> str:
        """The command's stdout, once it has exited 0 without a warning."""
        try:
            self.proc.wait(timeout=TIMEOUT_S)
        finally:
            self.close()
        stdout, stderr = (self.cwd / "stdout.txt").read_text(), (self.cwd / "stderr.txt").read_text()
        shown = f"$ ppo-critic {' '.join(self.args)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
        assert self.proc.returncode == 0, shown
        # the current code takes the old run as it is: no refusal, and no warning about its layout or checkpoints
        assert not re.search(r"\bwarn(ing)?s?\b", stdout + stderr, re.IGNORECASE), shown
        return stdout

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self._err.close()


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    before = _tree(FIXTURES / RUN)
    started = {name: Command(tmp_path_factory.mktemp(name), args) for name, args in COMMANDS.items()}
    yield started
    for command in started.values():
        command.close()
    assert _tree(FIXTURES / RUN) == before, "the committed fixture was modified"


def _assert_values(got: list[dict], expected: list[dict], atol: float) -> None:
    rollouts = _jsonl(EXPECTED / "rollouts.jsonl")
    assert [r["row"] for r in got] == list(range(len(rollouts)))
    for row, want, rollout in zip(got, expected, rollouts, strict=True):
        assert len(row["values"]) == len(rollout["response_ids"]), row
        assert all(math.isfinite(v) for v in row["values"]), row
        worst = max(abs(a - b) for a, b in zip(row["values"], want["values"], strict=True))
        assert worst <= atol, f"row {row['row']}: values differ from the old code's by {worst:.3g}"


def test_resume_continues_the_old_run(commands):
    command = commands["resume"]
    saved = (FIXTURES / RUN / "metrics.jsonl").read_text().splitlines()
    stdout = command.finish()
    assert f"resumed from {RUN}/checkpoints/step_00000004 at step 4" in stdout, stdout
    assert "done at step 6" in stdout, stdout

    run = command.run
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert lines[: len(saved)] == saved, "the old run's metrics rows were rewritten"
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # continued from 4: no step repeated or missing
    assert rows[4]["elapsed_s"] > rows[3]["elapsed_s"]  # training time continues across the resume

    # steps 5 and 6 are the steps the old code's own resume took: data position, RNG, Adam, EMA, value norm resumed
    old = {r["step"]: r for r in _jsonl(EXPECTED / "metrics_resumed_to_6.jsonl")}
    for row in rows[4:]:
        want = {k: v for k, v in old[row["step"]].items() if not k.startswith("perf/") and k not in CLOCK_KEYS}
        assert want.keys() <= row.keys(), sorted(want.keys() - row.keys())
        differ = {k: (v, row[k]) for k, v in want.items() if not math.isclose(row[k], v, **METRICS_TOL)}
        assert not differ, f"step {row['step']} (old, new): {differ}"

    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_00000006"
    assert (checkpoints / "step_00000006" / "manifest.json").is_file()
    # trainer.keep_last_n=2 counts the old checkpoints too: the oldest is deleted, step 4 kept
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["step_00000004", "step_00000006"]
    assert _jsonl(run / "config_changes.jsonl") == [{"step": 4, "changed": {"trainer.steps": [4, 6]}}]


def test_export_of_the_old_run_loads(commands):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForTokenClassification

    command = commands["export"]
    stdout = command.finish()
    assert "exported step 4" in stdout, stdout
    out = command.cwd / "exported"

    # the same weights and config as the old code's own export of the same checkpoint (hf/ of the run)
    new, old = load_file(out / "model.safetensors"), load_file(command.run / "hf" / "model.safetensors")
    assert new.keys() == old.keys()
    assert all(torch.equal(new[k], old[k]) for k in old), [k for k in old if not torch.equal(new[k], old[k])]
    configs = [json.loads((d / "config.json").read_text()) for d in (out, command.run / "hf")]
    for config in configs:
        config.pop("transformers_version", None)
    assert configs[0].pop("ppo_critic_vf_loss_type") == "mse"  # an export names its objective now (issue 52)
    assert configs[0] == configs[1]

    # docs/usage.md: a token-classification critic loads with AutoModelForTokenClassification.from_pretrained(out_dir)
    model, info = AutoModelForTokenClassification.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == "Qwen2ForTokenClassification"
    assert not any(info.values()), info
    model.eval()
    got = []
    for i, rollout in enumerate(_jsonl(EXPECTED / "rollouts.jsonl")):
        n = len(rollout["response_ids"])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([rollout["prompt_ids"] + rollout["response_ids"]])).logits
        got.append({"row": i, "values": logits[0, -n - 1 : -1, 0].tolist()})  # token t's value: the output before it
    # transformers' own attention here, the CLI's packed attention there: sums in another order (FP32_REORDERED)
    _assert_values(got, _jsonl(EXPECTED / "values_hf.jsonl"), atol=1e-5)


def test_values_of_the_old_run(commands):
    command = commands["values"]
    stdout = command.finish()
    assert "wrote values of 4 rollouts to values.jsonl" in stdout, stdout
    _assert_values(_jsonl(command.cwd / "values.jsonl"), _jsonl(EXPECTED / "values_run.jsonl"), atol=VALUES_ATOL)
