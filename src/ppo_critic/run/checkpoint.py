"""Checkpoints with `torch.distributed.checkpoint` (DCP), written atomically and verified on load; HF export.

A checkpoint is written to a hidden temporary directory and renamed to `step_XXXXXXXX` only when complete, then
the `latest` marker is replaced; old checkpoints are renamed away before they are deleted. A crash at any point
leaves the previous checkpoints usable, and `latest_checkpoint` never returns a half-written or half-deleted one.
Each checkpoint ends with `manifest.json`, a content hash of every file in it (written last); loading checks it
first and names the file that differs, is missing or was added, so a damaged checkpoint never loads. One without a
manifest (or with one that is not a JSON object of hashes) is incomplete and never used: every layout this project
released carries one. A damaged checkpoint is never deleted: saving its step again moves it aside
(`step_XXXXXXXX.damaged-<time>`), and retention leaves it alone.

Loading executes no code from the files: DCP's `.metadata` pickle is read by an unpickler that only builds DCP's
own metadata classes, the non-tensor entries (optimizer hyper-parameters) with `torch.load(weights_only=True)`,
tensors by DCP with `weights_only=True`, and our own state from JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ppo_critic.run.files import (
    explained_os_error,
    fsync_dir,
    interrupts_deferred,
    move_aside,
    new_directory,
    write_file,
)

STEP_DIR = re.compile(r"^step_(\d{8,})$")  # zero-padded to 8 digits, longer past 10**8
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
INTACT = "; the previous checkpoints are intact"
LATEST = "latest"
METADATA = ".metadata"
_TMP_PREFIX = ".tmp-step_"  # a checkpoint being written
_DEL_PREFIX = ".del-step_"  # an old checkpoint being deleted
_FRESH_OPTIMIZER = "optimizer_fresh"  # in the JSON state of a checkpoint saved before the optimizer's first step
_OWN_FILES = (MANIFEST, METADATA, STATE_FILE)  # what every checkpoint holds, besides DCP's `__<rank>_<n>.distcp` shards


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, Tensor],
    state: dict[str, Any],
    keep_last_n: int | None = None,
) -> Path:
    """Write model + optimizer + `tensors` (DCP) and `state` (JSON) as `root/step_<step>`; keep the newest n.

    Saving changes nothing: an optimizer that has not stepped yet gets zero state from `get_state_dict` (one lr=0
    step, so Adam's step count would be one ahead); it is made fresh again, and so is the one a load restores.
    """
    fresh = not optimizer.state
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {**state, _FRESH_OPTIMIZER: True} if fresh else state
    try:
        return save_state_dicts(
            root, step, {"model": model_sd, "optim": optim_sd, "extra": tensors}, state, keep_last_n
        )
    finally:
        if fresh:
            optimizer.state.clear()


def save_state_dicts(
    root: str | os.PathLike, step: int, state_dict: dict[str, Any], state: dict[str, Any], keep_last_n: int | None
) -> Path:
    """Write a (DCP) `state_dict`, a JSON `state` and the manifest atomically as `root/step_<step>`; keep the newest
    `keep_last_n` by step (never the one just written). Ctrl-C or SIGTERM waits until the checkpoint is written."""
    with interrupts_deferred():
        return _save_state_dicts(root, step, state_dict, state, keep_last_n)


def _save_state_dicts(
    root: str | os.PathLike, step: int, state_dict: dict[str, Any], state: dict[str, Any], keep_last_n: int | None
) -> Path:
    """`save_state_dicts` itself."""
    root, lead = Path(root), _rank() <= 0
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}"  # one name on every rank (DCP writes a shard per rank into it)
    if lead:
        with explained_os_error(f"cannot create the checkpoint directory {root}"):
            root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)  # temporary and half-deleted directories left by a crash
    _barrier()
    try:
        with explained_os_error(f"writing checkpoint {final} failed", INTACT, root), _single_process_ok():
            with _dcp_errors_as_os_errors():
                dcp.save(state_dict, checkpoint_id=str(tmp))
            if lead:
                write_file(tmp / STATE_FILE, json.dumps({"step": step, **state}, indent=1))
                write_file(tmp / MANIFEST, json.dumps(_hashes(tmp), indent=1))  # last: it vouches for the rest
                if os.path.lexists(final):  # the same step saved again after a resume: make way for it
                    _make_way(final)
                os.rename(tmp, final)
    except BaseException:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if lead:
        with explained_os_error(f"checkpoint {final} is complete, but updating {root / LATEST} failed"):
            fsync_dir(root)
            write_file(root / LATEST, final.name + "\n")
        if keep_last_n:
            for old in [p for p in complete_checkpoints(root) if _whole(p)][:-keep_last_n]:
                if old == final:
                    continue
                try:
                    delete_checkpoint(old)
                except OSError as err:  # the new checkpoint is saved; an old one that stays is no reason to stop
                    warnings.warn(f"could not delete old checkpoint {old}: {err}", stacklevel=2)
    _barrier()
    return final


class CheckpointDamaged(ValueError):
    """A checkpoint that does not verify: no readable manifest, or a file that differs from it, is missing or was
    added (nothing was loaded from it)."""


class CheckpointMovedAside(UserWarning):
    """A damaged checkpoint renamed out of the way of a new one at its step (nothing was deleted)."""


def _make_way(final: Path) -> None:
    """Clear `final` for the checkpoint saved again at its step: one that verifies is superseded (deleted, as
    retention would), one that does not is moved aside, named in a warning, never deleted."""
    problem = _manifest_problem(final)  # the first rank alone writes: no broadcast here
    if problem is None:
        delete_checkpoint(final)
        return
    aside = move_aside(final, "damaged")
    warnings.warn(
        f"checkpoint {final} is damaged ({problem}): moved aside to {aside} before saving its step again",
        CheckpointMovedAside,
        stacklevel=3,
    )


def _whole(path: Path) -> bool:
    """Whether a checkpoint holds all of its own files (cheap, no hashing): retention deletes no other."""
    return all((path / name).is_file() for name in _OWN_FILES)


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Check every file of a checkpoint against its manifest; raise CheckpointDamaged (a ValueError) naming the first
    that differs, is missing or was added, or what is wrong with the manifest — never another exception. Under
    torchrun the first rank reads the files and tells the others."""
    problem = _manifest_problem(Path(path)) if _rank() <= 0 else None
    if _rank() >= 0:
        import torch.distributed as dist

        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise CheckpointDamaged(f"checkpoint {path} is damaged: {problem}")


def _manifest_problem(path: Path) -> str | None:
    """What keeps a checkpoint directory from verifying, in one line naming the file; None when every file matches."""
    try:
        if not path.is_dir():
            return "it is not a directory"
        expected = _read_manifest(path)
        if isinstance(expected, str):
            return expected
        actual = _hashes(path)
    except OSError as err:
        return f"{Path(err.filename).name if err.filename else path} cannot be read ({err.strerror or err})"
    for name in sorted(expected.keys() | actual.keys() | {METADATA, STATE_FILE}):
        if name not in actual:
            return f"{name} is missing"
        if name not in expected:
            return f"{name} is not in {MANIFEST}"
        if actual[name] != expected[name]:
            return f"{name} does not match its content hash in {MANIFEST} (bit rot, or a partial copy)"
    return None


def _read_manifest(path: Path) -> dict[str, str] | str:
    """The manifest of a checkpoint directory (relative path -> content hash), or what is wrong with it."""
    manifest = path / MANIFEST
    if not os.path.lexists(manifest):
        return f"{MANIFEST} is missing (it is written last: the checkpoint is incomplete)"
    if not manifest.is_file():
        return f"{MANIFEST} is not a file"
    try:
        expected = json.loads(manifest.read_bytes())
    except (ValueError, RecursionError) as err:
        return f"{MANIFEST} is not valid JSON ({err})"
    if not isinstance(expected, dict) or not all(isinstance(v, str) for v in expected.values()):
        return f"{MANIFEST} does not hold a JSON object of content hashes"
    return expected


def _hashes(path: Path) -> dict[str, str]:
    """A content hash (BLAKE2b-128) of every file in a checkpoint directory but the manifest, by relative path."""
    out = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p != path / MANIFEST):
        digest = hashlib.blake2b(digest_size=16)
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        out[file.relative_to(path).as_posix()] = digest.hexdigest()
    return out


@contextlib.contextmanager
def _dcp_errors_as_os_errors() -> Iterator[None]:
    """DCP wraps a rank's write failure in a CheckpointException: surface the error inside (an interrupt, an OSError
    such as a full disk or a read-only file system, or the library's own), so it is reported like any other."""
    try:
        yield
    except CheckpointException as err:
        causes = _causes(err)
        _raise_interrupt(err)
        for cause in sorted(causes, key=lambda c: not isinstance(c, OSError)):
            if isinstance(cause, OSError | RuntimeError | ValueError):
                raise cause from err
        raise


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """transformers draws a "Writing model shards" bar per export, which in a log file is a line of carriage returns;
    the trainer's own output says what is written."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint under `root` (temporary, half-deleted and empty directories are ignored), damaged or
    not: loading it verifies it first, so a damaged one is refused naming the file, never passed over in silence."""
    steps = complete_checkpoints(root)
    return steps[-1] if steps else None


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, Tensor],
    check_state: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Restore model and optimizer in place; return the saved `tensors` (shaped like the templates) and state.

    Nothing changes unless the files verify against the manifest and `check_state(state)` accepts the JSON state.
    """
    fresh_optimizer = not optimizer.state
    model_sd, optim_sd = get_state_dict(model, optimizer)  # a fresh optimizer gets zero state (one lr=0 step)
    state_dict = {"model": model_sd, "optim": optim_sd, "extra": dict(tensors)}
    try:
        state = load_state_dicts(path, state_dict, check_state)
    except Exception:  # incomplete, unsafe or mismatching checkpoint
        if fresh_optimizer:  # nothing was loaded into it: make it fresh again
            optimizer.state.clear()
        raise
    set_state_dict(model, optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])
    if state.pop(_FRESH_OPTIMIZER, False):  # saved before the first step: the optimizer had no state
        optimizer.state.clear()
    return state_dict["extra"], state


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON state of a complete checkpoint (FileNotFoundError for an incomplete one, ValueError for a damaged
    one)."""
    path = _complete(path)
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except ValueError as err:
        raise ValueError(f"{path / STATE_FILE} is not valid JSON ({err}); the checkpoint is damaged") from err
    if not isinstance(state, dict):
        raise ValueError(f"{path / STATE_FILE} does not hold a JSON object; the checkpoint is damaged")
    return state


def _complete(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not (path / METADATA).is_file() or not (path / STATE_FILE).is_file():
        raise _not_a_checkpoint(path)
    return path


def _not_a_checkpoint(path: Path) -> FileNotFoundError:
    return FileNotFoundError(f"{path} is not a complete checkpoint (missing {METADATA} or {STATE_FILE})")


def _holds_checkpoint(path: Path) -> bool:
    """Whether `path` holds a checkpoint, whole or damaged: a directory with one of a checkpoint's own files, or a
    non-empty `step_*` directory (only complete checkpoints are renamed there, so any content is a damaged one)."""
    try:
        if not path.is_dir():
            return False
        if any(os.path.lexists(path / name) for name in _OWN_FILES):
            return True
        return bool(STEP_DIR.match(path.name)) and next(path.iterdir(), None) is not None
    except OSError:  # unreadable: verification says what cannot be read
        return True


def load_state_dicts(
    path: str | os.PathLike, state_dict: dict[str, Any], check_state: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Load a checkpoint into `state_dict` (templates, filled in place) and return its JSON state — after the files
    verify and `check_state(state)` accepts it, so a refused checkpoint changes nothing."""
    path = Path(path)
    if not _holds_checkpoint(path):  # no such directory, an empty one, or one with none of a checkpoint's files
        raise _not_a_checkpoint(path)
    verify_checkpoint(path)
    state = read_state(path)
    if check_state is not None:
        check_state(state)
    check_metadata(path / METADATA)
    try:
        with _single_process_ok():
            dcp.load(state_dict, storage_reader=FileSystemReader(path), planner=_WeightsOnlyLoadPlanner())
    except CheckpointException as err:
        _raise_interrupt(err)
        causes = "; ".join(f"{type(e).__name__}: {e}" for e in _causes(err)) or str(err)
        raise ValueError(
            f"cannot load checkpoint {path} into this model and optimizer ({causes}); it was written with another "
            "critic.model / critic.optim config (or, with megatron, another layout)"
        ) from err
    return state


# ---------------------------------------------------------------------------------------------------------------
# Loading without executing code from the files

# What DCP pickles into `.metadata` (torch 2.6 - 2.13): its metadata dataclasses, sizes, dtypes, layouts, paths.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {
    *(
        (_DCP_METADATA, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *((module, cls) for module in ("pathlib", "pathlib._local") for cls in ("PosixPath", "WindowsPath", "Path")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the classes DCP metadata is made of; any other global (a callable that would run) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in checkpoint metadata")


def check_metadata(path: str | os.PathLike) -> None:
    """Parse a DCP `.metadata` file with the restricted unpickler; raise ValueError if it holds anything else.

    DCP itself reads the file with a plain `pickle.load`, so it is checked first: a file that passes builds only
    metadata objects, whoever unpickles it.
    """
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as err:
        raise ValueError(
            f"{path} is not plain DCP checkpoint metadata ({err}); refusing to load it (checkpoints are read "
            "without executing code from them)"
        ) from err


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but non-tensor entries are unpickled by `torch.load(weights_only=True)` (DCP: False)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)  # raises UnpicklingError for anything but plain data
        plain = io.BytesIO()
        torch.save(obj, plain)  # re-encoded from plain data only: DCP's own (unrestricted) load is now harmless
        plain.seek(0)
        super().load_bytes(read_item, plain)


def _causes(err: CheckpointException) -> list[BaseException]:
    """The exceptions DCP collected from the ranks (each wrapped as `(exception, traceback)`)."""
    failures = getattr(err, "failures", None) or {}
    return [f[0] if isinstance(f, tuple) else f for f in failures.values() if isinstance(f, (tuple, BaseException))]


def _raise_interrupt(err: CheckpointException) -> None:
    """Ctrl-C or SIGTERM that landed inside DCP's reader or writer: raise it as the interrupt it is, not as a failed
    read or write."""
    interrupt = next((c for c in _causes(err) if isinstance(c, KeyboardInterrupt)), None)
    if interrupt is not None:
        raise interrupt from err


def export_hf(
    model: nn.Module,
    out_dir: str | os.PathLike,
    state_dict: dict[str, Tensor] | None = None,
    replace: bool | Callable[[Path], object] = False,
) -> Path:
    """Write safetensors + config loadable by transformers, atomically (a temp dir renamed into place).

    `out_dir` must not exist or be empty — unless `replace` (`run.files.new_directory`): what is there makes way
    only once the new export is whole, deleted (`True`: the trainer's own `hf/`) or moved aside and named to
    `replace(aside)` (`export --force`: a user's directory, never deleted); a failure leaves it as it was.
    `state_dict` (full, HF names) replaces the model's own weights, e.g. gathered from megatron shards; `model` then
    only provides the architecture and may live on the meta device.

    Token-classification critics load with `AutoModelForTokenClassification.from_pretrained(out_dir)`. A generic
    critic (backbone + head) is saved as the backbone plus `value_head.safetensors`; load it with
    `ppo_critic.build_value_model(out_dir)`.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ppo_critic.models.hf import ValueModel

    out = Path(out_dir)
    full = state_dict
    if full is None:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=_rank() >= 0))
    if _rank() > 0:  # under data parallelism the first rank writes; the others only helped gather the weights
        _barrier()
        return out
    model = getattr(model, "module", model)  # DDP / FSDP1
    if not isinstance(model, ValueModel) and not hasattr(model, "save_pretrained"):
        raise TypeError(f"{type(model).__name__} is not a transformers model; HF export needs save_pretrained")
    with new_directory(out, replace) as tmp, _no_progress_bar():
        _save_hf(model, full, tmp)
    _barrier()
    return out


def _save_hf(model: nn.Module, full: dict[str, Tensor], directory: Path) -> None:
    """Write `model` with the weights `full` into `directory` as transformers saves it (a generic critic: its
    backbone, and the head as `value_head.safetensors`)."""
    from safetensors.torch import save_file

    from ppo_critic.models.hf import VALUE_HEAD_FILE, ValueModel

    if not isinstance(model, ValueModel):
        model.save_pretrained(directory, state_dict=full, safe_serialization=True)
        return
    backbone = {k.removeprefix("model."): v for k, v in full.items() if k.startswith("model.")}
    model.model.save_pretrained(directory, state_dict=backbone, safe_serialization=True)
    head = {k: v.detach().contiguous().cpu() for k, v in full.items() if k.startswith("score.")}
    save_file(head, str(directory / VALUE_HEAD_FILE))


def _rank() -> int:
    """This process's rank, or -1 without a process group (single process)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else -1


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """Silence DCP's notice that it runs without a process group: single-process use is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step a checkpoint directory's name says (`step_00000004` -> 4); None for another name."""
    match = STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The checkpoints under `root`, oldest step first (ordered by the step number, not the name): every non-empty
    `step_*` directory, since only complete ones are renamed there. One may be damaged since: loading verifies it."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and _holds_checkpoint(p)]
    return sorted(found, key=checkpoint_step)


def delete_checkpoint(path: Path) -> None:
    """Remove a checkpoint directory (one `save_checkpoint` wrote): first renamed out of the `step_*` namespace
    (atomic), then deleted, so a crash while deleting never leaves a damaged directory that looks like one. A `latest`
    beside it that names it goes too: no pointer is left to a checkpoint that is gone."""
    path = Path(path)
    doomed = path.with_name(f".del-{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, doomed)
    pointer = path.parent / LATEST
    with contextlib.suppress(OSError):
        if pointer.read_text().strip() == path.name:
            pointer.unlink()
    shutil.rmtree(doomed, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    """Delete temporary (`.tmp-step_*`) and half-deleted (`.del-step_*`) directories: checkpoints are written one
    at a time, so any that exist when a new one starts were left by a crash."""
    for p in root.iterdir():
        if p.name.startswith((_TMP_PREFIX, _DEL_PREFIX)) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
