"""Checkpoint files on their own: retention by step, manifests that catch changed bytes, and no half-written state;
a checkpoint that does not verify (whatever is wrong with it) is refused naming the file, skipped by resume=auto out
loud, and never deleted."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ppo_critic.run import rundir
from ppo_critic.run.checkpoint import (
    CheckpointDamaged,
    complete_checkpoints,
    delete_checkpoint,
    latest_checkpoint,
    load_state_dicts,
    read_state,
    save_state_dicts,
    verify_checkpoint,
)


def save(root, step: int, keep_last_n: int | None = None):
    return save_state_dicts(root, step, {"w": torch.full((4,), float(step))}, {"note": step}, keep_last_n)


def names(root) -> list[str]:
    return [p.name for p in complete_checkpoints(root)]


def test_retention_orders_by_step_and_keeps_what_it_just_wrote(tmp_path):
    for step in (99_999_998, 99_999_999, 100_000_000):  # the name grows a digit: sorting by name would misorder
        save(tmp_path, step, keep_last_n=2)
    assert names(tmp_path) == ["step_99999999", "step_100000000"]
    assert latest_checkpoint(tmp_path).name == "step_100000000"
    assert (tmp_path / "latest").read_text().strip() == "step_100000000"
    written = save(tmp_path, 5, keep_last_n=2)  # older than those kept: still never deleted on the spot
    assert written.is_dir() and read_state(written)["note"] == 5
    assert names(tmp_path) == ["step_00000005", "step_99999999", "step_100000000"]


def test_deleting_a_checkpoint_takes_the_latest_that_names_it_and_only_that(tmp_path):
    """verl's engine keeps N checkpoints over several roots (global_step_k/critic/): a root whose only checkpoint
    goes must not keep a `latest` naming it; a root's `latest` naming another checkpoint stays."""
    lone, kept = save(tmp_path / "a", 1), save(tmp_path / "b", 1)
    save(tmp_path / "b", 2)
    delete_checkpoint(lone)
    assert not lone.exists() and not (tmp_path / "a" / "latest").exists() and os.listdir(tmp_path / "a") == []
    delete_checkpoint(kept)
    assert (tmp_path / "b" / "latest").read_text().strip() == "step_00000002" and names(tmp_path / "b") == [
        "step_00000002"
    ]


def test_any_changed_added_or_missing_byte_is_named(tmp_path):
    path = save(tmp_path, 1)
    verify_checkpoint(path)
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # one flipped bit in the tensor data
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamaged, match=f"{shard.name} does not match its content hash"):
        verify_checkpoint(path)
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    verify_checkpoint(path)
    (path / "stray.txt").write_text("x")
    with pytest.raises(CheckpointDamaged, match=r"stray\.txt is not in manifest\.json"):
        verify_checkpoint(path)
    (path / "stray.txt").unlink()
    (path / "trainer_state.json").unlink()
    assert names(tmp_path) == ["step_00000001"]  # still a checkpoint, a damaged one: refused out loud when loaded
    with pytest.raises(CheckpointDamaged, match=r"trainer_state\.json is missing"):
        verify_checkpoint(path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert "trainer_state.json" in manifest and ".metadata" in manifest


def test_an_interrupt_inside_dcp_stays_an_interrupt_and_changes_nothing(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    save(tmp_path, 1)

    def interrupted(self, plan, planner):
        raise KeyboardInterrupt("signal 15")  # what the CLI's SIGTERM handler raises, here mid-write or mid-read

    monkeypatch.setattr(FileSystemWriter, "write_data", interrupted)
    with pytest.raises(KeyboardInterrupt):  # DCP wraps it in a CheckpointException; the CLI must see Ctrl-C
        save(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
    assert latest_checkpoint(tmp_path).name == "step_00000001"

    monkeypatch.setattr(FileSystemReader, "read_data", interrupted)
    template = {"w": torch.zeros(4)}
    with pytest.raises(KeyboardInterrupt):  # not "written with another config"
        load_state_dicts(tmp_path / "step_00000001", template)
    assert torch.equal(template["w"], torch.zeros(4))


# ---------------------------------------------------------------------------------------------------------------
# A checkpoint that does not verify: refused naming the file, skipped out loud, never deleted


def flip_a_bit(path: Path) -> None:
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))


def without_manifest(path: Path) -> None:
    (path / "manifest.json").unlink()


def manifest_of(text: str) -> Callable[[Path], None]:
    return lambda path: (path / "manifest.json").write_text(text)


def truncated_manifest(path: Path) -> None:
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text[: len(text) // 2])


def manifest_a_directory(path: Path) -> None:
    (path / "manifest.json").unlink()
    (path / "manifest.json").mkdir()


def hashes_not_strings(path: Path) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(dict.fromkeys(manifest, 1)))


NOT_JSON = "manifest.json is not valid JSON ("
NOT_AN_OBJECT = "manifest.json does not hold a JSON object of content hashes"
NO_MANIFEST = "manifest.json is missing (it is written last: the checkpoint is incomplete)"
# case -> (what is done to the newest checkpoint, the start of what its refusal says after "is damaged: ")
DAMAGES = {
    "manifest-deleted": (without_manifest, NO_MANIFEST),
    "manifest-a-directory": (manifest_a_directory, "manifest.json is not a file"),
    "manifest-empty-list": (manifest_of("[]"), NOT_AN_OBJECT),
    "manifest-null": (manifest_of("null"), NOT_AN_OBJECT),
    "manifest-a-string": (manifest_of('"x"'), NOT_AN_OBJECT),
    "manifest-hashes-not-strings": (hashes_not_strings, NOT_AN_OBJECT),
    "manifest-truncated": (truncated_manifest, NOT_JSON),
    "manifest-not-text": (lambda p: (p / "manifest.json").write_bytes(b"\x80\xff{"), NOT_JSON),
    "manifest-nested-too-deep": (manifest_of("[" * 100_000), NOT_JSON),
    "listed-shard-missing": (lambda p: (p / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    "metadata-deleted": (lambda p: (p / ".metadata").unlink(), ".metadata is missing"),
    "state-deleted": (lambda p: (p / "trainer_state.json").unlink(), "trainer_state.json is missing"),
    "extra-file": (lambda p: (p / "notes.txt").write_text("x"), "notes.txt is not in manifest.json"),
    "bit-flip-without-manifest": (lambda p: flip_a_bit(p) or without_manifest(p), NO_MANIFEST),
}


def contents(path: Path) -> dict[str, bytes | None]:
    """Every entry under `path` by relative name: a file's bytes, None for a directory."""
    return {p.relative_to(path).as_posix(): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


@contextlib.contextmanager
def checkpoint_warnings() -> Iterator[list[str]]:
    """The warnings about checkpoints issued inside the block (a refusal is said by its error alone)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        said: list[str] = []
        yield said
    said += [str(w.message) for w in caught if "checkpoint" in str(w.message)]


@pytest.mark.parametrize("case", list(DAMAGES))
def test_a_checkpoint_that_does_not_verify_is_refused_skipped_out_loud_and_moved_aside(tmp_path, case):
    damage, problem = DAMAGES[case]
    for step in (1, 2, 3):
        save(tmp_path, step)
    newest = tmp_path / "step_00000003"
    damage(newest)
    damaged = contents(newest)
    template = {"w": torch.zeros(4)}

    with checkpoint_warnings() as warned, pytest.raises(CheckpointDamaged) as info:
        load_state_dicts(newest, template)
    refusal = str(info.value)
    assert refusal.startswith(f"checkpoint {newest} is damaged: {problem}") and "\n" not in refusal, refusal
    assert warned == [] and torch.equal(template["w"], torch.zeros(4))  # said once; nothing loaded
    assert latest_checkpoint(tmp_path) == newest  # values/export refuse it: never an older one in silence

    said = []
    with checkpoint_warnings() as warned:
        resumed = rundir.resume(tmp_path, "auto", lambda c: load_state_dicts(c, template) and c, said.append)
    assert resumed == tmp_path / "step_00000002" and torch.equal(template["w"], torch.full((4,), 2.0))
    assert said == [f"{refusal}; trying the checkpoint before it"] and warned == []

    with checkpoint_warnings() as warned:
        save(tmp_path, 3)  # the resumed run reaches step 3 again
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("step_00000003.damaged-")]
    assert len(aside) == 1 and contents(aside[0]) == damaged  # renamed next to it, whole: nothing deleted
    assert warned == [f"{refusal.replace(': ', ' (', 1)}): moved aside to {aside[0]} before saving its step again"]
    verify_checkpoint(newest)
    assert names(tmp_path) == ["step_00000001", "step_00000002", "step_00000003"]


def test_resume_stops_when_no_checkpoint_verifies_and_changes_nothing(tmp_path):
    cases = {1: "metadata-deleted", 2: "manifest-null", 3: "manifest-deleted"}
    for step, case in cases.items():
        save(tmp_path, step)
        DAMAGES[case][0](tmp_path / f"step_{step:08d}")
    before, said = contents(tmp_path), []
    refused = r"no checkpoint under .* verifies \(checkpoint .*step_00000003 is damaged: "
    with pytest.raises(ValueError, match=refused) as info:
        rundir.resume(tmp_path, "auto", lambda c: load_state_dicts(c, {"w": torch.zeros(4)}), said.append)
    assert "\n" not in str(info.value) and len(said) == 3  # never a fresh start over the run
    for line, step in zip(said, (3, 2, 1), strict=True):
        assert line.startswith(f"checkpoint {tmp_path / f'step_{step:08d}'} is damaged: {DAMAGES[cases[step]][1]}")
    assert contents(tmp_path) == before


def test_retention_deletes_no_damaged_checkpoint_and_a_whole_one_saved_again_is_replaced(tmp_path):
    for step in (1, 2):
        save(tmp_path, step)
    without_manifest(tmp_path / "step_00000001")
    damaged = contents(tmp_path / "step_00000001")
    with checkpoint_warnings() as warned:
        save(tmp_path, 2)  # it verifies: superseded, as before
        for step in (3, 4):
            save(tmp_path, step, keep_last_n=1)
    assert warned == [] and not [p for p in tmp_path.iterdir() if ".damaged-" in p.name]
    assert names(tmp_path) == ["step_00000001", "step_00000004"]  # step 1 is damaged: kept, not counted
    assert contents(tmp_path / "step_00000001") == damaged


def test_what_holds_no_checkpoint_is_not_one(tmp_path):
    save(tmp_path, 1)
    (tmp_path / "step_00000002").mkdir()  # empty: nothing to load, nothing to lose
    (tmp_path / "step_00000003").write_text("a file")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "notes.txt").write_text("x")
    assert names(tmp_path) == ["step_00000001"]
    for path in (tmp_path / "step_00000002", tmp_path / "elsewhere", tmp_path / "step_00000009"):
        with pytest.raises(FileNotFoundError, match=r"is not a complete checkpoint \(missing \.metadata or trainer"):
            load_state_dicts(path, {"w": torch.zeros(4)})


EXPORT_KILLED = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
import transformers.modeling_utils
from conftest import tiny_config
from ppo_critic import build_value_model
from ppo_critic.run.checkpoint import export_hf
def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
transformers.modeling_utils.safe_save_file = killed
export_hf(build_value_model(tiny_config("qwen2")), sys.argv[1], replace=True)
"""


def test_the_trainers_export_keeps_its_previous_one_until_the_new_one_is_whole(tmp_path):
    """`export_hf(replace=True)` (the trainer's `hf/`) renamed the previous export away before writing: killed while
    writing the weights, the run had no `hf/` (and a `.old-hf-*` left). Now `hf/` stays until the new one is in."""
    from conftest import tiny_config
    from ppo_critic import build_value_model
    from ppo_critic.run.checkpoint import export_hf

    model, hf = build_value_model(tiny_config("qwen2")), tmp_path / "hf"
    export_hf(model, hf)
    before = contents(hf)
    tests = Path(__file__).resolve().parents[1]
    killed = subprocess.run([sys.executable, "-c", EXPORT_KILLED, str(hf), str(tests)], check=False, timeout=120)
    assert killed.returncode == -9 and contents(hf) == before
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    export_hf(model, hf, replace=True)  # removes what the killed export left, and its own previous export
    assert contents(hf) != before and sorted(os.listdir(tmp_path)) == ["hf"]


def test_a_full_disk_during_the_trainers_export_keeps_the_previous_one(tmp_path):
    """safetensors' error on a full disk escaped as SafetensorError; it is ENOSPC naming `hf`, the old one whole."""
    from conftest import tiny_config
    from ppo_critic import build_value_model
    from ppo_critic.run.checkpoint import export_hf
    from test_files import tiny_disk

    model = build_value_model(tiny_config("qwen2"))
    with tiny_disk(tmp_path / "disk", size="600k") as disk:  # one export (340k) fits, two do not
        export_hf(model, disk / "hf")
        before = contents(disk)
        with pytest.raises(OSError) as info:
            export_hf(model, disk / "hf", replace=True)
        assert info.value.errno == errno.ENOSPC and str(info.value).startswith(f"[Errno 28] writing {disk / 'hf'}")
        assert contents(disk) == before
