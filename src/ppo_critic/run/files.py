"""Durable writes and run-directory ownership: the one module through which ppo-critic writes a user's files.

A file is produced under a temporary name in its directory, flushed and fsynced, renamed over the target, and the
directory is fsynced: a crash, a kill or a full disk leaves the old file or the new one, never a torn one, and no
temporary file behind. A directory (an export) is built the same way and renamed into place. A path that is in the
way is moved aside, never deleted. `RunDirLock` gives a run directory one writer at a time.

What is written gets the mode a plain `open(path, "w")` / `mkdir` would give: 0666 & ~umask for a new file (a
replaced file keeps its mode), 0777 & ~umask for a directory — whatever mode a library writer used on the temporary
name (transformers' `save_pretrained` leaves 0600 files), so that a run's files are as readable on a shared cluster
as the user's umask says. Temporary names are random, created exclusively (O_EXCL, mkdir), next to the target.

A temporary name carries its writer's host and pid (`.NAME.<host>-<pid>-<hex>.tmp`, `.tmp-NAME-<host>-<pid>-<hex>`),
so the next write of NAME removes what a killed writer on this host left (`remove_stale`); a live writer's, or
another host's, is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

LOCK_FILE = ".lock"
_HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:32]  # in temporary names: whose writer left them
_LOW_SPACE = 1 << 20  # a write that failed with less than this free on its file system failed for lack of space


def write_file(path: str | os.PathLike, data: str | bytes) -> Path:
    """Atomically replace `path` with `data` (text is written as UTF-8)."""
    payload = data.encode() if isinstance(data, str) else data
    return write_with(path, lambda tmp: tmp.write_bytes(payload))


def write_with(path: str | os.PathLike, produce: Callable[[Path], object], replace: bool = True) -> Path:
    """Atomically replace `path` with what `produce(tmp)` writes to the temporary path `tmp` (a library's own
    writer: parquet, PNG, safetensors). Any failure removes `tmp` and leaves `path` as it was. `replace=False`: a
    `path` that exists by the time the file is complete (another writer's) is never replaced: FileExistsError."""
    path = Path(path)
    parent = path.parent
    with explained_os_error(f"cannot create the directory {parent}"):
        parent.mkdir(parents=True, exist_ok=True)
    tmp, created_mode = _new_temp_file(parent, path.name)
    mode = _mode_of_existing_file(path, created_mode)
    try:
        with explained_os_error(f"writing {path} failed", where=parent):
            produce(tmp)
            _set_mode(tmp, mode)  # the writer may have replaced the temporary file by one of its own (mkstemp: 0600)
            _fsync_file(tmp)
            (os.replace if replace else _place_new)(tmp, path)
            fsync_dir(parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    return path


def _place_new(tmp: Path, path: Path) -> None:
    """Give the complete file `tmp` the name `path` unless that name exists: a hard link is created atomically or
    not at all (rename would replace), then `tmp` is unlinked. Where the file system has no hard links, the name is
    checked just before the rename."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise _appeared(path) from None
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        if path.exists():
            raise _appeared(path) from None
        os.replace(tmp, path)
        return
    os.remove(tmp)


def _appeared(path: Path) -> FileExistsError:
    """The refusal of an output another writer created while this one worked."""
    return FileExistsError(
        errno.EEXIST,
        f"{path} appeared while this command ran (another writer?) and was kept; nothing was written: choose "
        "another output, or pass --force to replace it",
    )


@contextlib.contextmanager
def new_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Build a directory under a temporary name next to `path`; when the block succeeds it becomes `path` (which
    must not exist, or be an empty directory), else it is removed. Yields the temporary directory."""
    path = Path(path)
    with explained_os_error(f"cannot create the directory {path.parent}"):
        path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path.parent, f".tmp-{path.name}-", "")
    tmp = path.parent / f".tmp-{path.name}-{_writer()}-{secrets.token_hex(4)}"
    try:
        with explained_os_error(f"writing {path} failed", where=path.parent):
            tmp.mkdir()  # exclusive: fails if the name exists
            dir_mode = stat.S_IMODE(tmp.stat().st_mode)  # 0777 & ~umask (or the parent's default ACL)
            yield tmp
            for child in tmp.rglob("*"):  # what open()/mkdir() would have given, whatever the writer used
                info = child.lstat()
                if stat.S_ISDIR(info.st_mode):
                    _set_mode(child, dir_mode)
                elif stat.S_ISREG(info.st_mode):
                    executable = info.st_mode & stat.S_IXUSR
                    _set_mode(child, dir_mode if executable else dir_mode & 0o666)
                    _fsync_file(child)
            _set_mode(tmp, dir_mode)
            fsync_dir(tmp)
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()  # an empty directory holds nothing to lose
            os.rename(tmp, path)
            fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait for the block to end (a checkpoint being written is finished first), then reach the
    handlers they would have reached: a signal landing inside torch's C++ writer would surface as a RuntimeError
    instead of the interrupt. A second signal during the block interrupts at once. (Main thread only.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if pending:
            raise KeyboardInterrupt(f"signal {signum}")
        pending.append(signum)

    previous = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if pending:
        signal.raise_signal(pending[0])


def move_aside(path: str | os.PathLike) -> Path:
    """Rename `path` to a free sibling `<name>.old-<time>` (nothing is deleted); returns the new name."""
    path = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(_sibling_name(path, f".old-{stamp}"))
    while target.exists():
        target = path.with_name(_sibling_name(path, f".old-{stamp}-{secrets.token_hex(2)}"))
    with explained_os_error(f"cannot move {path} aside"):
        os.rename(path, target)
        fsync_dir(path.parent)
    return target


def _sibling_name(path: Path, suffix: str, limit: int = 255) -> str:
    """`<name><suffix>`, the name cut short where the whole would pass the file system's limit on a name (255 bytes
    on most): a run directory with a long name can still be moved aside."""
    room = limit - len(suffix.encode())
    name = path.name.encode()[:room].decode(errors="ignore")
    return f"{name}{suffix}"


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def explained_os_error(what: str, keeps: str = "", where: str | os.PathLike | None = None) -> Iterator[None]:
    """Re-raise a failed write as an OSError that says what was being written and what is intact (`keeps`). A
    library error (not an OSError) on a file system with almost no space left is reported as ENOSPC."""
    try:
        yield
    except OSError as err:
        if err.errno is None:
            raise
        place = f" ({err.filename})" if err.filename else ""
        raise OSError(err.errno, f"{what}: {err.strerror}{place}{keeps}") from err
    except (RuntimeError, ValueError) as err:  # e.g. torch.save's "unexpected pos" when the disk fills
        if where is None or not _almost_full(where):
            raise
        raise OSError(errno.ENOSPC, f"{what}: no space left on the file system of {where}{keeps}") from err


class RunDirLock:
    """One writer per run directory: an exclusive `flock` on `<run_dir>/.lock`, which names the holder (pid, host,
    start time). The lock goes with the process, however it ends; a second writer gets an error naming the first."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None
        self.created = False

    def acquire(self) -> RunDirLock:
        self.created = not self.path.parent.exists()  # then `abandon` may remove the directory again
        with explained_os_error(f"cannot create the run directory {self.path.parent}"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise OSError(
                errno.EBUSY,
                f"{self.path.parent} is in use by {holder}; wait for it to finish, or use another trainer.run_dir",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.ctime()}\n".encode(), 0)
        self.fd = fd
        return self

    def abandon(self) -> None:
        """Release, and leave no trace where nothing else was written: the lock file removed (while still held),
        and the directory too if `acquire` created it. A run refused before its first write leaves what it found."""
        if self.fd is not None and [p.name for p in self.path.parent.iterdir()] == [LOCK_FILE]:
            with contextlib.suppress(OSError):
                self.path.unlink()
                if self.created:
                    self.path.parent.rmdir()
        self.release()

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _writer() -> str:
    """`<host>-<pid>` of this process, as temporary names carry it."""
    return f"{_HOST}-{os.getpid()}"


def remove_stale(directory: Path, prefix: str, suffix: str) -> None:
    """Remove the temporaries `prefix<host>-<pid>-<hex>suffix` in `directory` that a writer on this host left when it
    died (its pid runs no process): files and directories alike. Others' are kept, and so is anything unreadable."""
    pattern = re.compile(re.escape(prefix + _HOST) + r"-(\d+)-[0-9a-f]+" + re.escape(suffix))
    with contextlib.suppress(OSError):
        for entry in directory.iterdir():
            found = pattern.fullmatch(entry.name)
            if found and not _running(int(found.group(1))):
                _remove(entry)


def _running(pid: int) -> bool:
    """Whether a process `pid` exists on this host (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _remove(path: Path) -> None:
    """Delete a stale temporary: a directory tree or a file (a symlink itself, never its target)."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _new_temp_file(directory: Path, base: str) -> tuple[Path, int]:
    """A new empty file next to the target under a random name (created exclusively: never someone else's file or
    link), and the mode `open(..., "w")` gives a new file there: 0666 & ~umask (mkstemp's 0600 would stick)."""
    remove_stale(directory, f".{base}.", ".tmp")
    while True:
        tmp = directory / f".{base}.{_writer()}-{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            continue
        except OSError as err:
            raise OSError(err.errno, f"cannot write in {directory}: {err.strerror}") from err
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
        return tmp, mode


def _mode_of_existing_file(path: Path, default: int) -> int:
    """The permission bits `open(path, "w")` would leave: those of the file it replaces, else `default`."""
    try:
        info = os.stat(path)
    except OSError:
        return default
    return info.st_mode & 0o777 if stat.S_ISREG(info.st_mode) else default


def _set_mode(path: Path, mode: int) -> None:
    """chmod unless already so; a symbolic link is left alone (chmod would change what it points to)."""
    info = path.lstat()
    if not stat.S_ISLNK(info.st_mode) and stat.S_IMODE(info.st_mode) != mode:
        os.chmod(path, mode)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _almost_full(path: str | os.PathLike) -> bool:
    try:
        return shutil.disk_usage(path).free < _LOW_SPACE
    except OSError:
        return False
