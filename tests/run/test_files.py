"""files: durable writes (a real full disk on a small tmpfs, a failing writer), directories built aside, moving aside,
and the run-directory lock against a real second process."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ppo_critic.run.files import LOCK_FILE, RunDirLock, move_aside, new_directory, write_file, write_with


@contextlib.contextmanager
def tiny_disk(path: Path, size: str = "64k", inodes: int | None = None):
    """A real file system of `size` bytes (and `inodes` files) at `path` (tmpfs; the tests run as root, as CI does)."""
    path.mkdir()
    options = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)  # a failed writer may still hold a file open


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def mkstemp_writer(tmp: Path) -> None:
    """A library writer that writes its own temporary file (mkstemp: 0600) and renames it over the given path."""
    fd, name = tempfile.mkstemp(dir=tmp.parent)
    os.write(fd, b"weights")
    os.close(fd)
    os.replace(name, tmp)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_written_files_and_directories_get_the_mode_of_a_plain_open_and_mkdir(tmp_path, mask):
    with umask(mask):
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain" / "open.txt").write_text("x")  # what a plain open(..., "w") / mkdir gives
        config = write_file(tmp_path / "sub" / "config.yaml", "a: 1\n")
        values = write_with(tmp_path / "values.jsonl", lambda tmp: tmp.write_text("{}\n"))
        weights = write_with(tmp_path / "model.safetensors", mkstemp_writer)
        with new_directory(tmp_path / "export") as building:
            (building / "config.json").write_text("{}")
            mkstemp_writer(building / "model.safetensors")
            Path(tempfile.mkdtemp(dir=building)).rename(building / "nested")  # mkdtemp: 0700
            mkstemp_writer(building / "nested" / "shard")
            (building / "run.sh").write_text("#!/bin/sh\n")
            (building / "run.sh").chmod(0o700)  # an executable stays executable, for whom the umask allows
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    assert mode(tmp_path / "plain" / "open.txt") == file_mode and mode(tmp_path / "plain") == dir_mode
    for path in (config, values, weights, *(tmp_path / "export" / n for n in ("config.json", "model.safetensors"))):
        assert mode(path) == file_mode, path
    assert mode(tmp_path / "export" / "nested" / "shard") == file_mode
    assert mode(tmp_path / "export") == mode(tmp_path / "export" / "nested") == mode(tmp_path / "sub") == dir_mode
    assert mode(tmp_path / "export" / "run.sh") == dir_mode
    assert weights.read_bytes() == b"weights" and leftovers(tmp_path) == [] and leftovers(tmp_path / "export") == []


def test_a_replaced_file_keeps_its_mode_as_with_a_plain_open(tmp_path):
    """The user narrowed (or widened) a file's mode: rewriting it does not undo that, whatever the umask."""
    target = tmp_path / "config.yaml"
    write_file(target, "a: 1\n")
    for kept in (0o600, 0o664):
        target.chmod(kept)
        with umask(0o022):
            write_file(target, "a: 2\n")
            write_with(target, mkstemp_writer)
        assert mode(target) == kept and target.read_bytes() == b"weights" and leftovers(tmp_path) == []


def test_an_hf_export_is_readable_as_the_umask_says(tmp_path):
    """transformers' save_pretrained writes its shards through mkstemp (0600): the export still gets 0666 & ~umask."""
    from conftest import tiny_config
    from ppo_critic import build_value_model
    from ppo_critic.run.checkpoint import export_hf

    with umask(0o027):
        export_hf(build_value_model(tiny_config("qwen2")), tmp_path / "hf")
    files = sorted((tmp_path / "hf").iterdir())
    assert "model.safetensors" in [f.name for f in files]
    assert {f.name: mode(f) for f in files} == {f.name: 0o640 for f in files}
    assert mode(tmp_path / "hf") == 0o750


def test_a_full_disk_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path):
    with tiny_disk(tmp_path / "disk") as disk:
        write_file(disk / "metrics.jsonl", "old\n")
        with pytest.raises(OSError) as info:
            write_file(disk / "metrics.jsonl", "x" * 200_000)
        assert info.value.errno == errno.ENOSPC
        assert str(info.value).startswith(f"[Errno 28] writing {disk / 'metrics.jsonl'} failed: No space left")
        assert (disk / "metrics.jsonl").read_text() == "old\n" and leftovers(disk) == []


def test_a_library_writer_failing_on_a_full_disk_is_reported_as_no_space(tmp_path):
    """torch.save says 'unexpected pos ...' (a RuntimeError) when the disk fills: reported as ENOSPC all the same."""
    import torch

    with tiny_disk(tmp_path / "disk") as disk:
        with pytest.raises(OSError) as info:
            write_with(disk / "weights.pt", lambda tmp: torch.save(torch.zeros(100_000), tmp))
        assert info.value.errno == errno.ENOSPC and "no space left on the file system" in str(info.value).lower()
        assert list(disk.iterdir()) == []


def test_a_failing_writer_leaves_the_target_as_it_was(tmp_path):
    target = tmp_path / "values.jsonl"
    target.write_text("kept\n")

    def broken(tmp: Path) -> None:
        tmp.write_text("half")
        raise ValueError("the writer failed")

    with pytest.raises(ValueError, match="the writer failed"):
        write_with(target, broken)
    assert target.read_text() == "kept\n" and leftovers(tmp_path) == []


def test_new_directory_appears_whole_or_not_at_all(tmp_path):
    with new_directory(tmp_path / "export") as building:
        (building / "config.json").write_text("{}")
        assert not (tmp_path / "export").exists()
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["config.json"]
    with pytest.raises(RuntimeError), new_directory(tmp_path / "failed") as building:
        (building / "half").write_text("x")
        raise RuntimeError("interrupted")
    assert not (tmp_path / "failed").exists() and leftovers(tmp_path) == []
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("user data")
    with pytest.raises(OSError, match="appeared while this command ran"), new_directory(tmp_path / "full") as building:
        (building / "config.json").write_text("{}")
    assert (tmp_path / "full" / "mine.txt").read_text() == "user data"


def test_move_aside_renames_and_never_deletes(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("rows\n")
    first = move_aside(tmp_path / "run")
    (tmp_path / "run").mkdir()
    second = move_aside(tmp_path / "run")
    assert first != second and first.name.startswith("run.old-") and second.name.startswith("run.old-")
    assert (first / "metrics.jsonl").read_text() == "rows\n" and not (tmp_path / "run").exists()


HOLDER = """
import sys, time
from ppo_critic.run.files import RunDirLock
RunDirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_writer_is_refused_with_the_holders_name_until_it_ends(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OSError) as info:
            RunDirLock(run).acquire()
        assert info.value.errno == errno.EBUSY
        assert f"{run} is in use by pid {holder.pid} on " in str(info.value) and "another trainer.run_dir" in str(
            info.value
        )
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 10
    while True:  # the kernel drops a dead process's lock
        try:
            lock = RunDirLock(run).acquire()
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert f"pid {os.getpid()} on " in (run / LOCK_FILE).read_text()
    lock.release()


def test_a_new_file_never_replaces_one_another_writer_made_meanwhile(tmp_path):
    target = tmp_path / "out.jsonl"

    def produce_while_another_writer_finishes(tmp: Path) -> None:
        tmp.write_text("mine\n")
        target.write_text("theirs\n")  # the other command's result lands between our check and our rename

    with pytest.raises(OSError, match="appeared while this command ran") as err:
        write_with(target, produce_while_another_writer_finishes, replace=False)
    assert err.value.errno == errno.EEXIST
    assert target.read_text() == "theirs\n" and sorted(os.listdir(tmp_path)) == ["out.jsonl"]
    write_with(tmp_path / "new.jsonl", lambda tmp: tmp.write_text("mine\n"), replace=False)
    assert (tmp_path / "new.jsonl").read_text() == "mine\n" and len(os.listdir(tmp_path)) == 2


def test_without_hard_links_a_new_file_is_still_refused_over_another(tmp_path, monkeypatch):
    def no_links(*args: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    write_with(tmp_path / "a", lambda tmp: tmp.write_text("a"), replace=False)
    assert (tmp_path / "a").read_text() == "a"
    with pytest.raises(OSError, match="appeared while this command ran"):
        write_with(tmp_path / "a", lambda tmp: tmp.write_text("b"), replace=False)
    assert (tmp_path / "a").read_text() == "a" and os.listdir(tmp_path) == ["a"]


def test_a_write_removes_the_temporaries_a_killed_writer_of_that_name_left_and_no_others(tmp_path):
    from ppo_critic.run import files

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone, host = int(dead.stdout), files._HOST
    stale = [f".out.jsonl.{host}-{gone}-0123456789ab.tmp", f".tmp-export-{host}-{gone}-01234567"]
    kept = [
        f".out.jsonl.{host}-{os.getpid()}-0123456789ab.tmp",  # a live writer's (this process)
        f".out.jsonl.otherhost-{gone}-0123456789ab.tmp",  # another host's: its pids mean nothing here
        f".other.jsonl.{host}-{gone}-0123456789ab.tmp",  # another name's
        "notes.txt",
    ]
    for name in [*stale, *kept]:
        (tmp_path / name).write_text("x")
    (tmp_path / stale[1]).unlink()
    (tmp_path / stale[1]).mkdir()
    (tmp_path / stale[1] / "model.safetensors").write_text("half")
    write_file(tmp_path / "out.jsonl", "new\n")
    with new_directory(tmp_path / "export") as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "out.jsonl", "export"])


def test_an_interrupt_during_a_deferred_block_arrives_after_it_and_a_second_one_at_once():
    import signal

    from ppo_critic.run.files import interrupts_deferred

    finished = []
    # Python's own Ctrl-C handler, also where the suite was started with SIGINT ignored (in the background)
    started_with = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            finished.append("the write")  # the block runs to its end
        assert finished == ["the write"]
        with pytest.raises(KeyboardInterrupt, match="signal"), interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # the user insists
            finished.append("never")
        assert finished == ["the write"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, started_with)


def test_a_directory_with_a_long_name_is_moved_aside_under_a_name_the_file_system_takes(tmp_path):
    """Issue 43 family 8: `<name>.old-<time>` passed the 255-byte limit on a name (ENAMETOOLONG) for a long name."""
    long = tmp_path / ("x" * 250)
    long.mkdir()
    (long / "kept").write_text("data")
    aside = move_aside(long)
    assert not long.exists() and (aside / "kept").read_text() == "data"
    assert len(aside.name.encode()) <= 255 and ".old-" in aside.name and aside.name.startswith("x" * 200)


# Issue 52 family 4: the edges of the file contract.

LONGEST = {"ascii": "n" * 255, "utf-8": "é" * 127 + "n", "cjk": "値" * 85}  # each 255 bytes: NAME_MAX


def names_fit(directory: Path) -> None:
    """Every name in `directory` (recursively) within NAME_MAX, and no temporary left."""
    for path in directory.rglob("*"):
        assert len(os.fsencode(path.name)) <= 255, path.name
    assert [p for p in directory.rglob(".*")] == []


@pytest.mark.parametrize("name", LONGEST.values(), ids=LONGEST.keys())
def test_a_name_as_long_as_the_file_system_takes_is_written_replaced_built_and_moved_aside(tmp_path, name):
    """Temporary names borrowed the whole target name (`.<name>.<host>-<pid>-<hex>.tmp`, `.tmp-<name>-...`) and
    overflowed the 255-byte limit on a name: a legal 255-byte target could not be written (ENAMETOOLONG)."""
    assert len(name.encode()) == 255
    assert write_file(tmp_path / name, "first").read_text() == "first"
    write_with(tmp_path / name, lambda tmp: tmp.write_text("second"), replace=True)
    write_with(tmp_path / "new" / name, lambda tmp: tmp.write_text("new"), replace=False)
    assert (tmp_path / name).read_text() == "second" and (tmp_path / "new" / name).read_text() == "new"
    export = tmp_path / "exports" / name
    with new_directory(export) as building:
        (building / "config.json").write_text("1")
    moved: list[Path] = []
    with new_directory(export, replace=moved.append) as building:
        (building / "config.json").write_text("2")
    (aside,) = moved
    assert (export / "config.json").read_text() == "2" and (aside / "config.json").read_text() == "1"
    again = move_aside(export)
    assert (again / "config.json").read_text() == "2" and not export.exists()
    names_fit(tmp_path)


KILLED = """
import os, signal, sys
from pathlib import Path
from ppo_critic.run.files import new_directory, write_with
target = Path(sys.argv[1])
def die(tmp):
    Path(tmp, "half").write_text("x") if tmp.is_dir() else tmp.write_text("half")
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "file":
    write_with(target, die)
else:
    with new_directory(target) as tmp:
        die(tmp)
"""


@pytest.mark.parametrize("kind", ["file", "directory"])
@pytest.mark.parametrize("name", [LONGEST["utf-8"], "short"], ids=["longest", "short"])
def test_what_a_killed_writer_of_a_long_name_left_is_removed_by_the_next_write(tmp_path, kind, name):
    """Cut to fit, a temporary name still tells the next write of the same target that it is its own to remove."""
    target = tmp_path / name
    subprocess.run([sys.executable, "-c", KILLED, str(target), kind], check=False, timeout=60)
    assert len(leftovers(tmp_path)) == 1
    if kind == "file":
        write_file(target, "whole")
    else:
        with new_directory(target) as building:
            (building / "whole").write_text("x")
    assert leftovers(tmp_path) == []


def test_a_library_error_on_a_full_disk_while_building_a_directory_is_no_space_naming_it(tmp_path):
    """safetensors raises SafetensorError (not an OSError) on a full disk: it escaped `ppo-critic export` as a
    traceback (exit 1). It is reported as ENOSPC naming the directory, and nothing is left behind."""
    import torch
    from safetensors.torch import save_file

    with tiny_disk(tmp_path / "disk") as disk:
        with pytest.raises(OSError) as info, new_directory(disk / "export") as building:
            save_file({"w": torch.zeros(100_000)}, str(building / "model.safetensors"))
        assert info.value.errno == errno.ENOSPC
        assert str(info.value).startswith(f"[Errno 28] writing {disk / 'export'} failed: ")
        assert list(disk.iterdir()) == []


def test_a_library_error_that_names_an_os_error_is_that_os_error():
    """A Rust writer's `I/O error: ... (os error N)` is errno N (a user's disk quota: EDQUOT, with space left)."""
    from ppo_critic.run.files import explained_os_error

    class LibraryError(Exception):
        pass

    with pytest.raises(OSError) as info, explained_os_error("writing out failed", where="."):
        raise LibraryError("Error while serializing: I/O error: Disk quota exceeded (os error 122)")
    assert info.value.errno == errno.EDQUOT and str(info.value) == "[Errno 122] writing out failed: Disk quota exceeded"
    with pytest.raises(LibraryError), explained_os_error("writing out failed", where="."):
        raise LibraryError("a bug, with space left")


@pytest.mark.parametrize("old", ["directory", "file", "empty", None])
def test_a_replacing_directory_moves_the_old_one_aside_only_once_the_new_one_is_whole(tmp_path, old):
    """`export --force` moved OUT aside before writing: a failure then left neither OUT nor an export. The old one
    now makes way only for a whole new one; a failure before leaves it where it was, and no temporary."""
    out = tmp_path / "out"
    if old == "file":
        out.write_text("user file")
    elif old is not None:
        out.mkdir()
        if old == "directory":
            (out / "notes.txt").write_text("user data")
    before = {p.relative_to(tmp_path): p.is_dir() or p.read_text() for p in tmp_path.rglob("*")}
    moved: list[Path] = []
    with pytest.raises(RuntimeError), new_directory(out, replace=moved.append) as building:
        (building / "config.json").write_text("{}")
        raise RuntimeError("the disk filled")
    assert {p.relative_to(tmp_path): p.is_dir() or p.read_text() for p in tmp_path.rglob("*")} == before
    assert moved == []
    with new_directory(out, replace=moved.append) as building:
        (building / "config.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    if old in ("directory", "file"):
        (aside,) = moved
        assert aside.name.startswith("out.old-") and aside.parent == tmp_path
        assert (aside / "notes.txt").read_text() == "user data" if old == "directory" else aside.read_text()
    else:
        assert moved == []
    assert leftovers(tmp_path) == []


def test_the_old_directory_is_put_back_when_the_new_one_cannot_be_renamed_in(tmp_path, monkeypatch):
    """The last rename failing (ENOSPC: a directory that needs a new block) puts the old directory back."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("user data")
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".tmp-out-") and Path(dst) == out:
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    moved: list[Path] = []
    with pytest.raises(OSError) as info, new_directory(out, replace=moved.append) as building:
        (building / "config.json").write_text("{}")
    assert info.value.errno == errno.ENOSPC and f"writing {out} failed" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["out"] and (out / "notes.txt").read_text() == "user data"
    assert moved == []


def test_an_output_taken_by_another_writer_during_the_swap_says_where_the_old_one_is(tmp_path, monkeypatch):
    """Another writer fills OUT between the move aside and the rename in: the old one cannot be put back; the error
    names where it is (it said nothing of it), and nothing is deleted."""
    import ppo_critic.run.files as files

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("user data")
    make_way = files._make_way

    def and_another_writer(path, replace):
        old = make_way(path, replace)
        path.mkdir()
        (path / "theirs.txt").write_text("another writer's")
        return old

    monkeypatch.setattr(files, "_make_way", and_another_writer)
    with pytest.raises(FileExistsError) as info, new_directory(out, replace=lambda aside: None) as building:
        (building / "config.json").write_text("{}")
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("out.old-")]
    assert f"{out} was taken by another writer while this command ran; the previous {out} is at {aside}" in str(
        info.value
    )
    assert (aside / "notes.txt").read_text() == "user data" and (out / "theirs.txt").is_file()


def test_replace_true_deletes_the_old_directory_once_the_new_one_is_in_place(tmp_path):
    """The trainer's own `hf/`: the previous export goes, but only after the new one is whole and renamed in."""
    out = tmp_path / "hf"
    with new_directory(out) as building:
        (building / "old").write_text("1")
    with new_directory(out, replace=True) as building:
        assert (out / "old").is_file()
        (building / "new").write_text("2")
    assert os.listdir(tmp_path) == ["hf"] and os.listdir(out) == ["new"]
