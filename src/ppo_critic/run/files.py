"""Durable writes and run-directory ownership: the one module through which ppo-critic writes a user's files.

A file is produced under a temporary name in its directory, flushed and fsynced, renamed over the target, and the
directory is fsynced: a crash, a kill or a full disk leaves the old file or the new one, never a torn one, and no
temporary file behind. A directory (an export) is built the same way and renamed into place; what is at its name
makes way only then (`replace`), and a failure leaves it as it was. A path that is in the way is moved aside, never
deleted. `RunDirLock` gives a run directory one writer at a time.

What is written gets the mode a plain `open(path, "w")` / `mkdir` would give: 0666 & ~umask for a new file (a
replaced file keeps its mode), 0777 & ~umask for a directory — whatever mode a library writer used on the temporary
name (transformers' `save_pretrained` leaves 0600 files), so that a run's files are as readable on a shared cluster
as the user's umask says. Temporary names are random, created exclusively (O_EXCL, mkdir), next to the target.

A temporary name carries its writer's host and pid (`.NAME.<host>-<pid>-<hex>.tmp`, `.tmp-NAME-<host>-<pid>-<hex>`),
so the next write of NAME removes what a killed writer on this host left (`remove_stale`); a live writer's, or
another host's, is never touched. Every name built beside a target (a temporary, `<name>.old-<time>`) borrows only
as much of NAME as fits the file system's limit on a name (255 bytes), cut at a character: any legal NAME is writable.
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
NAME_MAX = 255  # bytes in a name, where the file system does not say (pathconf)
_WRITER_ROOM = len(_HOST) + 24  # "<host>-<pid>-<hex>" in a temporary name: a pid of up to 10 digits, 12 hex digits
_DIRECTORY = (".tmp-", "-", "")  # a temporary directory's name: `.tmp-<name>-<host>-<pid>-<hex>`
_FILE = (".", ".", ".tmp")  # a temporary file's: `.<name>.<host>-<pid>-<hex>.tmp`
_OS_ERROR = re.compile(r"\(os error (\d+)\)|\[Errno (\d+)\]")  # an OSError a library put into its own error's text


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
    tmp, created_mode = _new_temp_file(path)
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
        "another output, or pass --force (a file is replaced, a directory moved aside)",
    )


@contextlib.contextmanager
def new_directory(path: str | os.PathLike, replace: bool | Callable[[Path], object] = False) -> Iterator[Path]:
    """Build a directory under a temporary name next to `path` (yielded); when the block succeeds it becomes `path`,
    else it is removed and `path` is as it was. `path` must not exist or be an empty directory, unless `replace`:
    then what is there makes way only once the new directory is whole — deleted (`True`: a directory of our own) or
    moved aside to `<name>.old-<time>` and named to `replace(aside)`, never deleted (a user's, `export --force`)."""
    path = Path(path)
    with explained_os_error(f"cannot create the directory {path.parent}"):
        path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path, _DIRECTORY)
    tmp = _temporary(path, _DIRECTORY)
    try:
        with explained_os_error(f"writing {path} failed", where=path.parent), _named_as(tmp, path):
            tmp.mkdir()  # exclusive: fails if the name exists
            yield tmp
            _settle(tmp)
            _swap_in(tmp, path, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _settle(tmp: Path) -> None:
    """Give everything in the finished directory what open()/mkdir() would have (whatever mode the writer used),
    and make it durable."""
    dir_mode = stat.S_IMODE(tmp.stat().st_mode)  # 0777 & ~umask (or the parent's default ACL)
    for child in tmp.rglob("*"):
        info = child.lstat()
        if stat.S_ISDIR(info.st_mode):
            _set_mode(child, dir_mode)
        elif stat.S_ISREG(info.st_mode):
            _set_mode(child, dir_mode if info.st_mode & stat.S_IXUSR else dir_mode & 0o666)
            _fsync_file(child)
    fsync_dir(tmp)


def _swap_in(tmp: Path, path: Path, replace: bool | Callable[[Path], object]) -> None:
    """Rename the whole directory `tmp` to `path`, what is there first made way for (`new_directory`); if the rename
    fails, that is put back. Ctrl-C and SIGTERM wait for the swap: never neither at `path`."""
    with interrupts_deferred():
        old = _make_way(path, replace)
        try:
            os.rename(tmp, path)  # replaces an empty directory; fails on anything else
        except BaseException as err:
            if old is not None:
                _put_back(old, path)
            if _taken(err, path):
                raise _appeared(path) from err  # made while this one was written (else refused before)
            raise
        fsync_dir(path.parent)
        if old is not None and callable(replace):
            replace(old)
    if old is not None and replace is True:
        _remove(old)


def _put_back(old: Path, path: Path) -> None:
    """Rename `old` (what `_make_way` moved) back to `path`; if another writer took `path` meanwhile, say where the
    previous one is kept."""
    try:
        os.rename(old, path)
    except OSError as err:
        raise FileExistsError(
            errno.EEXIST,
            f"{path} was taken by another writer while this command ran; the previous {path} is at {old}",
        ) from err


def _make_way(path: Path, replace: bool | Callable[[Path], object]) -> Path | None:
    """Rename what is at `path` out of the way, where `replace` allows and it is not an empty directory (that is
    replaced by the rename): to a temporary name for `True` (deleted next; a crash leaves it to `remove_stale`),
    else aside. Returns its new name."""
    if not replace or not os.path.lexists(path) or _empty_directory(path):
        return None
    if replace is not True:
        return move_aside(path)
    doomed = _temporary(path, _DIRECTORY)
    os.rename(path, doomed)
    return doomed


def _taken(err: BaseException, path: Path) -> bool:
    """Whether renaming a directory to `path` failed because something is there: a non-empty directory, a file."""
    if not isinstance(err, OSError):
        return False
    return err.errno in (errno.ENOTEMPTY, errno.EEXIST) or (err.errno == errno.ENOTDIR and not path.is_symlink())


def _empty_directory(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


@contextlib.contextmanager
def _named_as(tmp: Path, path: Path) -> Iterator[None]:
    """An error about a file in the temporary directory names it as it was to be named (`tmp/x` as `path/x`): the
    user knows `path`; `tmp` is gone by the time they read it."""
    try:
        yield
    except OSError as err:
        name = os.fspath(err.filename) if isinstance(err.filename, (str, os.PathLike)) else None
        if name is not None and (name == str(tmp) or name.startswith(f"{tmp}/")):
            err.filename = str(path) + name[len(str(tmp)) :]
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


def move_aside(path: str | os.PathLike, label: str = "old") -> Path:
    """Rename `path` to a free sibling `<name>.<label>-<time>` (nothing is deleted); returns the new name."""
    path = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(_sibling_name(path, f".{label}-{stamp}"))
    while os.path.lexists(target):
        target = path.with_name(_sibling_name(path, f".{label}-{stamp}-{secrets.token_hex(2)}"))
    with explained_os_error(f"cannot move {path} aside"):
        os.rename(path, target)
        fsync_dir(path.parent)
    return target


def _sibling_name(path: Path, suffix: str) -> str:
    """`<name><suffix>`, the name cut short where the whole would pass the file system's limit on a name: a
    directory with a long name can still be moved aside."""
    return _cut(path.name, _name_max(path.parent) - len(suffix.encode())) + suffix


def _temporary(path: Path, form: tuple[str, str, str]) -> Path:
    """A fresh random temporary name of `path` in `form` (`_FILE`, `_DIRECTORY`), beside it."""
    return path.parent / f"{_temp_stem(path, form)}{_writer()}-{secrets.token_hex(6)}{form[2]}"


def _temp_stem(path: Path, form: tuple[str, str, str]) -> str:
    """`<lead><name><sep>` of the temporaries `<stem><host>-<pid>-<hex><tail>` of `path`, the name cut so that they
    fit beside any legal name: the same stem for every writer of `path` (`remove_stale` matches it)."""
    lead, sep, tail = form
    room = _name_max(path.parent) - len(f"{lead}{sep}{tail}".encode()) - _WRITER_ROOM
    return f"{lead}{_cut(path.name, room)}{sep}"


def _cut(name: str, room: int) -> str:
    """`name` cut to at most `room` bytes as the file system stores it, never inside a UTF-8 character."""
    raw = os.fsencode(name)
    if len(raw) <= room:
        return name
    end = max(room, 0)
    while end > 0 and raw[end] & 0xC0 == 0x80:  # a continuation byte: the character began before the cut
        end -= 1
    return os.fsdecode(raw[:end])


def _name_max(directory: Path) -> int:
    """The longest name, in bytes, the file system of `directory` takes (255 where it cannot say)."""
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return NAME_MAX


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
    library's own error (not an OSError: safetensors' SafetensorError, torch's RuntimeError) is the OSError its text
    names (`(os error 28)`), else, on a file system with almost no space left (`where`), ENOSPC."""
    try:
        yield
    except OSError as err:
        if err.errno is None:
            raise
        place = f" ({err.filename})" if err.filename else ""
        raise OSError(err.errno, f"{what}: {err.strerror}{place}{keeps}") from err
    except Exception as err:  # e.g. torch.save's "unexpected pos" when the disk fills
        named = _errno_named(err)
        if named is not None:
            raise OSError(named, f"{what}: {os.strerror(named)}{keeps}") from err
        if where is None or not _almost_full(where):
            raise
        raise OSError(errno.ENOSPC, f"{what}: no space left on the file system of {where}{keeps}") from err


def _errno_named(err: Exception) -> int | None:
    """The errno a library's error quotes from the OSError beneath it (Rust's `(os error N)`, Python's `[Errno N]`)."""
    found = _OS_ERROR.search(str(err))
    return int(found.group(1) or found.group(2)) if found else None


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


def remove_stale(path: Path, form: tuple[str, str, str]) -> None:
    """Remove the temporaries of `path` in `form` that a writer on this host left when it died (its pid runs no
    process): files and directories alike. Others' are kept, and so is anything unreadable."""
    stem, tail = _temp_stem(path, form), form[2]
    pattern = re.compile(re.escape(stem + _HOST) + r"-(\d+)-[0-9a-f]+" + re.escape(tail))
    with contextlib.suppress(OSError):
        for entry in path.parent.iterdir():
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


def _new_temp_file(path: Path) -> tuple[Path, int]:
    """A new empty file next to `path` under a random name (created exclusively: never someone else's file or
    link), and the mode `open(..., "w")` gives a new file there: 0666 & ~umask (mkstemp's 0600 would stick)."""
    remove_stale(path, _FILE)
    while True:
        tmp = _temporary(path, _FILE)
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            continue
        except OSError as err:
            raise OSError(err.errno, f"cannot write in {path.parent}: {err.strerror}") from err
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
