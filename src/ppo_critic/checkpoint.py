"""Checkpoints with `torch.distributed.checkpoint` (DCP), written atomically; HF export.

A checkpoint is written to a hidden temporary directory and renamed to `step_XXXXXXXX` only when complete, then
the `latest` marker is replaced. A crash at any point leaves the previous checkpoints usable, and
`latest_checkpoint` never returns a half-written one. Nothing is unpickled on load: tensors come from DCP,
everything else from JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

STEP_DIR = re.compile(r"^step_(\d{8})$")
STATE_FILE = "trainer_state.json"
LATEST = "latest"


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, Tensor],
    state: dict[str, Any],
    keep_last_n: int | None = None,
) -> Path:
    """Write model + optimizer + `tensors` (DCP) and `state` (JSON) as `root/step_<step>`; keep the newest n."""
    root, lead = Path(root), _rank() <= 0
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}"  # one name on every rank (DCP writes a shard per rank into it)
    if lead:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
    _barrier()
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with _single_process_ok():
            dcp.save({"model": model_sd, "optim": optim_sd, "extra": tensors}, checkpoint_id=str(tmp))
        if lead:
            _write_text(tmp / STATE_FILE, json.dumps({"step": step, **state}, indent=1))
            _fsync_dir(tmp)
            if final.exists():  # the same step saved again after a resume: replace it whole
                shutil.rmtree(final)
            os.rename(tmp, final)
    except BaseException:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if lead:
        _fsync_dir(root)
        _write_text(root / LATEST, final.name + "\n")
        if keep_last_n:
            for old in _complete_steps(root)[:-keep_last_n]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `root` (temporary and damaged directories are ignored)."""
    steps = _complete_steps(Path(root)) if Path(root).is_dir() else []
    return steps[-1] if steps else None


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Restore model and optimizer in place; return the saved `tensors` (shaped like the templates) and state."""
    path = Path(path)
    if not (path / ".metadata").is_file() or not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (missing .metadata or {STATE_FILE})")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state_dict = {"model": model_sd, "optim": optim_sd, "extra": dict(tensors)}
    with _single_process_ok():
        dcp.load(state_dict, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])
    return state_dict["extra"], json.loads((path / STATE_FILE).read_text())


def export_hf(model: nn.Module, out_dir: str | os.PathLike, state_dict: dict[str, Tensor] | None = None) -> Path:
    """Write safetensors + config loadable by transformers, atomically (a temp dir renamed into place).

    `state_dict` (full, HF names) replaces the model's own weights, e.g. gathered from megatron shards; `model`
    then only provides the architecture and may live on the meta device.

    Token-classification critics load with `AutoModelForTokenClassification.from_pretrained(out_dir)`. A generic
    critic (backbone + head) is saved as the backbone plus `value_head.safetensors`; load it with
    `ppo_critic.build_value_model(out_dir)`.
    """
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ppo_critic.models.hf import VALUE_HEAD_FILE, ValueModel

    out = Path(out_dir)
    full = state_dict
    if full is None:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=_rank() >= 0))
    if _rank() > 0:  # under data parallelism the first rank writes; the others only helped gather the weights
        _barrier()
        return out
    model = getattr(model, "module", model)  # DDP / FSDP1
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    try:
        if isinstance(model, ValueModel):
            backbone = {k.removeprefix("model."): v for k, v in full.items() if k.startswith("model.")}
            model.model.save_pretrained(tmp, state_dict=backbone, safe_serialization=True)
            head = {k: v.detach().contiguous().cpu() for k, v in full.items() if k.startswith("score.")}
            save_file(head, str(tmp / VALUE_HEAD_FILE))
        elif hasattr(model, "save_pretrained"):
            model.save_pretrained(tmp, state_dict=full, safe_serialization=True)
        else:
            raise TypeError(f"{type(model).__name__} is not a transformers model; HF export needs save_pretrained")
        _fsync_dir(tmp)
        old = out.parent / f".old-{out.name}-{uuid.uuid4().hex[:8]}"
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    return out


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


def _complete_steps(root: Path) -> list[Path]:
    found = [
        p
        for p in root.iterdir()
        if STEP_DIR.match(p.name) and (p / ".metadata").is_file() and (p / STATE_FILE).is_file()
    ]
    return sorted(found, key=lambda p: p.name)


def _write_text(path: Path, text: str) -> None:
    """Write a small file atomically: temp file, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
