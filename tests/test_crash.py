"""Crash safety: a training process killed (SIGKILL) while it writes a checkpoint resumes bit-identically; a failed
write explains itself and keeps the previous checkpoint; a checkpoint that does not verify is refused by `train`,
`values` and `export` naming the file (train resumes from the one before it and moves it aside when it saves that step
again); loading checkpoints, weights and rollout files executes no code stored in them, and remote model code runs
only when asked."""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import pickle
import runpy
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

import ppo_critic.run.checkpoint as ckpt
from conftest import TINY, make_batch, state_hash, tiny_config, without_timings
from ppo_critic import build_value_model
from ppo_critic.cli import main
from ppo_critic.config.critic import CriticConfig
from ppo_critic.rollout_files.read import read_rollouts
from ppo_critic.run.checkpoint import latest_checkpoint, load_checkpoint, verify_checkpoint
from ppo_critic.worker import CriticWorker
from test_checkpoint import DAMAGES, contents
from test_train import SHORT

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------------------------
# SIGKILL while a checkpoint is written

# A checkpoint after every step, the newest two kept: saving step 3 writes, renames, updates `latest`, then deletes
# step 1. Each kill point stops the process at one moment of that save; the value is the checkpoint a resume must
# start from (the newest complete one).
CRASH_ARGS = [*SHORT, "trainer.save_every=1", "trainer.keep_last_n=2", "trainer.logger=[console,jsonl]"]
KILL_POINTS = {
    "shard-written": 2,  # DCP has written (and fsynced) a shard into .tmp-step_00000003; no .metadata yet
    "state-file": 2,  # trainer_state.json written to its temporary name, not yet renamed into place
    "renamed": 3,  # .tmp-step_00000003 renamed to step_00000003; `latest` still names step 2
    "latest-file": 3,  # the new `latest` written to its temporary name, not yet renamed over the old one
    "cleanup": 3,  # deleting step_00000001 (keep_last_n=2): one file removed, the rest not
}

# Run in a fresh interpreter: imports once, then forks one process per training run (so a run costs its training,
# not another interpreter start), as many at once as there are cores. Each run is `python -m ppo_critic train ...`
# (runpy), its output in a log file. A killed run first installs a hook that SIGKILLs the process at its kill point.
DRIVER = r'''
import json, os, runpy, signal, sys, traceback
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot  # noqa: F401 - imported once here instead of in every run
import ppo_critic.run.checkpoint as ckpt
import ppo_critic.cli  # noqa: F401 - torch, transformers and the train loop, imported once

KILL_STEP = "step_00000003"


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def where(path, dir_fd=None):
    base = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.getcwd()
    return os.path.join(base, os.fspath(path))


def arm(point):
    fsync, rename, replace, unlink = os.fsync, os.rename, os.replace, os.unlink
    if point == "shard-written":
        def hooked_fsync(fd):
            fsync(fd)
            if f".tmp-{KILL_STEP}" in os.readlink(f"/proc/self/fd/{fd}"):
                die()
        os.fsync = hooked_fsync
    elif point == "state-file":
        def hooked_replace(src, dst, **kwargs):
            if KILL_STEP in where(dst) and Path(dst).name == ckpt.STATE_FILE:
                die()
            return replace(src, dst, **kwargs)
        os.replace = hooked_replace
    elif point == "renamed":
        def hooked_rename(src, dst, **kwargs):
            rename(src, dst, **kwargs)
            if Path(dst).name == KILL_STEP:
                die()
        os.rename = hooked_rename
    elif point == "latest-file":
        def hooked_replace(src, dst, **kwargs):
            if Path(dst).name == ckpt.LATEST and Path(src).read_text().strip() == KILL_STEP:
                die()
            return replace(src, dst, **kwargs)
        os.replace = hooked_replace
    elif point == "cleanup":
        removed = []
        def hooked_unlink(path, *args, dir_fd=None, **kwargs):
            full = where(path, dir_fd)
            if "step_00000001" in full and ".tmp-" not in full:
                if removed:
                    die()
                removed.append(full)
            return unlink(path, *args, dir_fd=dir_fd, **kwargs)
        os.unlink = hooked_unlink
    else:
        raise ValueError(point)


def run(argv, log, point=None):
    """`python -m ppo_critic <argv>` in a forked process; returns how it ended."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            if point:
                arm(point)
            sys.argv = ["ppo_critic", *argv]
            runpy.run_module("ppo_critic", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status)}
    return {"exit": os.WEXITSTATUS(status)}


def snapshot(ckpts):
    """Names under the checkpoint directory, with the contents of hidden (temporary) directories."""
    out = {"latest": (ckpts / "latest").read_text().strip() if (ckpts / "latest").exists() else None}
    out["names"] = sorted(p.name for p in ckpts.iterdir())
    hidden = [p for p in ckpts.iterdir() if p.name.startswith(".") and p.is_dir()]
    out["hidden"] = {p.name: sorted(q.name for q in p.iterdir()) for p in hidden}
    return out


def job(name, plan, root):
    """The reference run, or one kill point: the run killed there, then the same command again."""
    argv = ["train", *plan["args"], f"trainer.run_dir={root / name}"]
    if name == "reference":
        return {"reference": run(argv, root / "reference.log")}
    killed = run(argv, root / f"{name}.killed.log", name)
    after_kill = snapshot(root / name / "checkpoints")
    resumed = run(argv, root / f"{name}.resumed.log")
    after_resume = snapshot(root / name / "checkpoints")
    return {"killed": killed, "after_kill": after_kill, "resumed": resumed, "after_resume": after_resume}


plan = json.loads(Path(sys.argv[1]).read_text())
root = Path(plan["root"])
pending, running = ["reference", *plan["points"]], {}
while pending or running:  # the jobs are independent: run as many at once as there are cores
    while pending and len(running) < max(1, os.cpu_count() or 1):
        name = pending.pop(0)
        pid = os.fork()
        if pid == 0:
            try:
                (root / f"{name}.json").write_text(json.dumps(job(name, plan, root)))
            finally:
                os._exit(0)
        running[pid] = name
    pid, _ = os.wait()
    running.pop(pid)
report = {}
for name in ["reference", *plan["points"]]:
    report[name] = json.loads((root / f"{name}.json").read_text())
report["reference"] = report["reference"]["reference"]
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def crash_runs(tmp_path_factory):
    """One uninterrupted reference run, then each kill point: a run killed at it and the same command again."""
    root = tmp_path_factory.mktemp("crash")
    plan = root / "plan.json"
    plan.write_text(json.dumps({"root": str(root), "args": CRASH_ARGS, "points": list(KILL_POINTS)}))
    driver = root / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, str(driver), str(plan)], capture_output=True, text=True, timeout=600, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["reference"] == {"exit": 0}, (root / "reference.log").read_text()[-3000:]
    return root, report


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_sigkill_while_checkpointing_resumes_bit_identically(crash_runs, point):
    root, report = crash_runs
    entry = report[point]
    log = (root / f"{point}.resumed.log").read_text()
    assert entry["killed"] == {"signal": signal.SIGKILL}, (root / f"{point}.killed.log").read_text()[-3000:]
    expected = KILL_POINTS[point]

    # Right after the kill: the moment it hit is visible, and the newest complete checkpoint is the expected one.
    after = entry["after_kill"]
    hidden = after["hidden"]
    tmp = hidden.get(".tmp-step_00000003", [])
    if point == "shard-written":
        assert any(n.endswith(".distcp") for n in tmp) and ".metadata" not in tmp, after
    elif point == "state-file":
        assert any(n.startswith(f".{ckpt.STATE_FILE}.") and n.endswith(".tmp") for n in tmp), after
        assert ckpt.STATE_FILE not in tmp and ckpt.MANIFEST not in tmp, after
    elif point in ("renamed", "latest-file"):
        assert "step_00000003" in after["names"] and after["latest"] == "step_00000002", after
        temporary = any(n.startswith(".latest.") and n.endswith(".tmp") for n in after["names"])
        assert temporary == (point == "latest-file"), after
    elif point == "cleanup":
        assert "step_00000001" not in after["names"], after  # renamed away before its files were deleted
        assert any(n.startswith(".del-step_00000001") for n in hidden), after
    complete = sorted(n for n in after["names"] if n.startswith("step_"))
    assert complete[-1] == f"step_{expected:08d}", after

    # The same command resumes from it (trainer.resume=auto) and finishes.
    assert entry["resumed"] == {"exit": 0}, log[-3000:]
    assert f"resumed from {root / point / 'checkpoints' / f'step_{expected:08d}'} at step {expected}" in log
    final = entry["after_resume"]
    assert final["latest"] == "step_00000004" and final["hidden"] == {}, final  # leftovers cleared
    assert [n for n in final["names"] if not n.startswith(".")] == ["latest", "step_00000003", "step_00000004"]
    assert [n for n in final["names"] if n.endswith(".tmp")] == [], final  # the killed writer's temporaries, removed

    # Bit-identical to the run that was never interrupted: final weights and every logged metric.
    a = load_file(root / "reference" / "hf" / "model.safetensors")
    b = load_file(root / point / "hf" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), point

    def rows(run):
        lines = (root / run / "metrics.jsonl").read_text().splitlines()
        return [without_timings(json.loads(line)) for line in lines]

    assert [r["step"] for r in rows(point)] == [1, 2, 3, 4]
    assert rows(point) == rows("reference")


# ---------------------------------------------------------------------------------------------------------------
# A write that fails: clear error, previous checkpoint intact and loadable


def worker_config() -> dict:
    return {"ppo_mini_batch_size": 4, "model": {"override_config": {"model_type": "qwen2", **TINY}}}


@pytest.fixture
def saved_worker(tmp_path):
    """A worker with checkpoints at steps 1 and 2, one more update done (not saved), and the step-2 digest."""
    worker = CriticWorker(worker_config(), total_steps=10)
    batch = make_batch(8, 6, 5)
    for _ in range(2):
        worker.update_critic(batch)
        worker.save_checkpoint(tmp_path, keep_last_n=2)
    digest = state_hash(worker.model, worker.optimizer)
    worker.update_critic(batch)
    return worker, digest


def assert_loads_as(path: Path, digest: str) -> None:
    fresh = CriticWorker(worker_config(), total_steps=10, seed=7)
    fresh.load_checkpoint(path)
    assert state_hash(fresh.model, fresh.optimizer) == digest


def test_read_only_file_system_while_writing_state_keeps_the_previous_checkpoint(tmp_path, saved_worker, monkeypatch):
    worker, digest = saved_worker
    write_file = ckpt.write_file

    def read_only(path, text):
        if path.name == ckpt.STATE_FILE:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        write_file(path, text)

    monkeypatch.setattr(ckpt, "write_file", read_only)
    with pytest.raises(OSError) as info:
        worker.save_checkpoint(tmp_path, keep_last_n=2)
    assert info.value.errno == errno.EROFS
    assert str(info.value).startswith(
        f"[Errno 30] writing checkpoint {tmp_path / 'step_00000003'} failed: Read-only file system"
    )
    assert str(info.value).endswith("; the previous checkpoints are intact")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001", "step_00000002"]
    assert latest_checkpoint(tmp_path).name == "step_00000002"
    assert_loads_as(tmp_path / "step_00000002", digest)


def test_disk_full_while_updating_latest_keeps_both_checkpoints(tmp_path, saved_worker, monkeypatch):
    worker, digest = saved_worker
    after = state_hash(worker.model, worker.optimizer)
    write_file = ckpt.write_file

    def disk_full(path, text):
        if path.name == ckpt.LATEST:
            raise OSError(errno.ENOSPC, "No space left on device")
        write_file(path, text)

    monkeypatch.setattr(ckpt, "write_file", disk_full)
    with pytest.raises(OSError, match="No space left on device") as info:
        worker.save_checkpoint(tmp_path, keep_last_n=2)
    assert str(info.value).startswith(
        f"[Errno 28] checkpoint {tmp_path / 'step_00000003'} is complete, but updating {tmp_path / 'latest'} failed"
    )
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"
    assert latest_checkpoint(tmp_path).name == "step_00000003"  # resume=auto reads the directories, not `latest`
    assert_loads_as(tmp_path / "step_00000002", digest)
    assert_loads_as(tmp_path / "step_00000003", after)


def test_a_checkpoint_of_another_model_is_rejected_with_the_reason(tmp_path, saved_worker):
    other = CriticWorker({**worker_config(), "model": {"override_config": tiny_config(hidden_size=32)}})
    before = state_hash(other.model, other.optimizer)
    with pytest.raises(ValueError, match="Size mismatch") as info:
        other.load_checkpoint(tmp_path / "step_00000002")
    assert str(info.value).startswith(f"cannot load checkpoint {tmp_path / 'step_00000002'} into this model")
    assert state_hash(other.model, other.optimizer) == before
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint"):
        other.load_checkpoint(tmp_path / "step_00000009")
    assert state_hash(other.model, other.optimizer) == before


def test_saving_before_the_first_update_changes_nothing(tmp_path):
    """get_state_dict gives a fresh optimizer zero state (one lr=0 step); saving or loading must not leave that."""
    batch = make_batch(8, 6, 5)
    plain = CriticWorker(worker_config(), total_steps=4)
    plain.update_critic(batch)
    saved = CriticWorker(worker_config(), total_steps=4)
    path = saved.save_checkpoint(tmp_path)
    assert not saved.optimizer.state
    saved.update_critic(batch)
    loaded = CriticWorker(worker_config(), total_steps=4, seed=5)
    loaded.load_checkpoint(path)
    assert not loaded.optimizer.state
    loaded.update_critic(batch)
    expected = state_hash(plain.model, plain.optimizer)
    assert state_hash(saved.model, saved.optimizer) == expected
    assert state_hash(loaded.model, loaded.optimizer) == expected


# ---------------------------------------------------------------------------------------------------------------
# train, values and export on a run whose newest checkpoint does not verify

RUN_ARGS = [*SHORT, "trainer.logger=[console,jsonl]"]  # checkpoints at steps 2 and 4


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", *RUN_ARGS, f"trainer.run_dir={run}"]) == 0
    return run


def command(argv: list, capsys) -> tuple[int, str, list[str]]:
    """`ppo-critic <argv>` in this process: exit code, stdout + stderr, and the checkpoint warnings it issued."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exit_:
            code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err, [str(w.message) for w in caught if "checkpoint" in str(w.message)]


@pytest.mark.parametrize("case", ["bit-flip-without-manifest", "manifest-null", "metadata-deleted", "extra-file"])
def test_a_newest_checkpoint_that_does_not_verify_is_refused_by_every_command(trained_run, tmp_path, capsys, case):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    newest = run / "checkpoints" / "step_00000004"
    damage, problem = DAMAGES[case]
    damage(newest)
    damaged = contents(newest)
    refusal = f"checkpoint {newest} is damaged: {problem}"
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 4], "reward": 1.0}) + "\n")
    values = ["values", run, f"data={rollouts}", f"out={tmp_path / 'values.jsonl'}"]
    for argv, output in ((values, tmp_path / "values.jsonl"), (["export", run, tmp_path / "hf"], tmp_path / "hf")):
        code, text, warned = command(argv, capsys)
        said = [line for line in text.strip().splitlines() if not line.startswith("usage: ")]
        assert code == 2 and len(said) == 1 and said[0].startswith(f"ppo-critic {argv[0]}: error: {refusal}"), text
        assert warned == [] and not output.exists()

    code, text, warned = command(["train", *RUN_ARGS, f"trainer.run_dir={run}"], capsys)
    assert code == 0, text
    assert text.count(refusal) == 1 and f"{refusal}; trying the checkpoint before it\n" in text, text
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in text
    aside = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_00000004.damaged-")]
    assert len(aside) == 1 and contents(aside[0]) == damaged  # saving step 4 again moved it aside, whole
    assert warned == [
        f"checkpoint {newest} is damaged ({problem}): moved aside to {aside[0]} before saving its step again"
    ]
    verify_checkpoint(newest)
    assert latest_checkpoint(run / "checkpoints") == newest


# ---------------------------------------------------------------------------------------------------------------
# Loading runs no code from the files


class Payload:
    """Unpickling this creates `marker`: proof that pickled code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def payload_runs(marker: Path, load) -> bool:
    """Whether `load()` created the marker (the marker is removed again)."""
    load()
    ran = marker.exists()
    if ran:
        marker.unlink()
    return ran


@pytest.fixture
def checkpoint(tmp_path):
    worker = CriticWorker(worker_config(), total_steps=4)
    worker.update_critic(make_batch(8, 6, 5))
    return worker, worker.save_checkpoint(tmp_path / "ckpts")


def restamp(path: Path) -> None:
    """A manifest that matches the checkpoint's files as they are now."""
    (path / ckpt.MANIFEST).write_text(json.dumps(ckpt._hashes(path)))


def test_code_in_checkpoint_metadata_is_not_executed(tmp_path, checkpoint):
    worker, path = checkpoint
    marker = tmp_path / "pwned"
    evil = pickle.dumps(Payload(marker))
    assert payload_runs(marker, lambda: pickle.loads(evil))  # the payload is live
    (path / ".metadata").write_bytes(evil)
    restamp(path)  # an attacker rewrites the manifest too: the manifest guards against damage, not against intent
    before = state_hash(worker.model, worker.optimizer)
    with pytest.raises(ValueError, match=r"is not plain DCP checkpoint metadata \(global '_?io.open' is not allowed"):
        load_checkpoint(path, worker.model, worker.optimizer, {})
    assert not marker.exists()
    assert state_hash(worker.model, worker.optimizer) == before


def test_code_in_a_non_tensor_checkpoint_entry_is_not_executed(tmp_path, checkpoint):
    """DCP stores non-tensor entries (optimizer hyper-parameters) as pickles it would load with weights_only=False."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    worker, path = checkpoint
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    evil = buf.getvalue()
    assert payload_runs(marker, lambda: torch.load(io.BytesIO(evil), weights_only=False))
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own, trusted file
    fqn = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    (path / "evil.distcp").write_bytes(evil)
    metadata.storage_data[index] = dataclasses.replace(
        metadata.storage_data[index], relative_path="evil.distcp", offset=0, length=len(evil)
    )
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    restamp(path)
    before = state_hash(worker.model, worker.optimizer)
    with pytest.raises(ValueError, match="UnpicklingError") as info:
        load_checkpoint(path, worker.model, worker.optimizer, {})
    assert str(info.value).startswith(f"cannot load checkpoint {path}")
    assert not marker.exists()
    assert state_hash(worker.model, worker.optimizer) == before


def test_code_in_a_pickled_weights_file_is_not_executed(tmp_path):
    """A model directory with a `pytorch_model.bin` (a torch pickle): transformers loads it weights_only."""
    from transformers import AutoConfig

    fields = tiny_config()
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(tmp_path / "model")
    marker = tmp_path / "pwned"
    torch.save(Payload(marker), tmp_path / "model" / "pytorch_model.bin")
    assert payload_runs(marker, lambda: torch.load(tmp_path / "model" / "pytorch_model.bin", weights_only=False))
    with pytest.raises(Exception, match=r"(?i)weights.only|unpickl"):
        build_value_model(tmp_path / "model")
    assert not marker.exists()


def test_code_in_a_parquet_extension_type_is_not_executed(tmp_path):
    """pyarrow < 14.0.1 unpickled `arrow.py_extension_type` field metadata (CVE-2023-47248)."""
    marker = tmp_path / "pwned"
    evil = pickle.dumps(Payload(marker))
    assert payload_runs(marker, lambda: pickle.loads(evil))
    ext = {b"ARROW:extension:name": b"arrow.py_extension_type", b"ARROW:extension:metadata": evil}
    schema = pa.schema(
        [
            pa.field("prompt_ids", pa.list_(pa.int64()), metadata=ext),
            pa.field("response_ids", pa.list_(pa.int64())),
            pa.field("reward", pa.float64()),
        ]
    )
    path = tmp_path / "r.parquet"
    pq.write_table(pa.table({"prompt_ids": [[1, 2]], "response_ids": [[3]], "reward": [1.0]}, schema=schema), path)
    rows = read_rollouts(path)
    assert not marker.exists()
    assert [(r.prompt_ids, r.response_ids) for r in rows] == [([1, 2], [3])]


def remote_code_model(root: Path, marker: Path, model_type: str) -> Path:
    """A model directory whose config asks for custom code that creates `marker` when imported."""
    root.mkdir()
    fields = {**TINY, "model_type": model_type, "architectures": ["EvilForTokenClassification"]}
    fields["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForTokenClassification": "evil.EvilModel"}
    (root / "config.json").write_text(json.dumps(fields))
    code = f"""
        open({str(marker)!r}, "w").close()
        from transformers import Qwen2Config, Qwen2ForTokenClassification
        class EvilConfig(Qwen2Config):
            model_type = {model_type!r}
        class EvilModel(Qwen2ForTokenClassification):
            config_class = EvilConfig
    """
    (root / "evil.py").write_text(textwrap.dedent(code))
    return root


def test_remote_code_is_not_run_unless_asked(tmp_path):
    assert CriticConfig().model.trust_remote_code is False
    marker = tmp_path / "pwned"
    custom = remote_code_model(tmp_path / "custom", marker, "evil")
    runpy.run_path(str(custom / "evil.py"))  # the code is live
    assert marker.exists()
    marker.unlink()
    with pytest.raises(FileNotFoundError, match="trust_remote_code"):
        build_value_model(custom)
    worker_cfg = {"ppo_mini_batch_size": 4, "model": {"path": str(custom)}}
    with pytest.raises(FileNotFoundError, match="trust_remote_code"):
        CriticWorker(worker_cfg)
    # A known architecture with an `auto_map` gets the built-in class, and the custom code is not imported.
    known = remote_code_model(tmp_path / "known", marker, "qwen2")
    model = build_value_model(known)
    assert type(model).__name__ == "Qwen2ForTokenClassification"
    assert not marker.exists()
