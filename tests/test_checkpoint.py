"""Checkpoint files on their own: retention by step, manifests that catch changed bytes, and no half-written state."""

from __future__ import annotations

import json

import pytest
import torch

from ppo_critic.checkpoint import (
    CheckpointDamaged,
    complete_checkpoints,
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
    assert names(tmp_path) == []  # not complete any more: never a resume candidate
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
