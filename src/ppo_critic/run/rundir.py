"""A run directory and its one writer: the lock, what a new or a resumed run may do with what is already there, the
checkpoint a run resumes from, and the options a resumed run may change (DESIGN §7: the user's files are sacred).

Only the first rank touches the directory; `agree` carries its outcome (or its error) to every rank, so a refusal
ends the whole job at once instead of leaving the other ranks waiting in a collective.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ppo_critic.config.ranks import check_ranks_agree, flat_options
from ppo_critic.run.checkpoint import CheckpointDamaged, checkpoint_step, complete_checkpoints, read_state
from ppo_critic.run.files import RunDirLock, move_aside, write_file
from ppo_critic.run.runlog import METRICS_FILE

CONFIG_FILE = "config.yaml"
MARKER = ".ppo-critic-run"  # in every run directory from its first config.yaml on
SCAN_LIMIT = 20_000  # directories looked into for run directories inside one a command would move aside or fill
CHANGES_FILE = "config_changes.jsonl"
# what `ppo-critic train` writes into a run directory (a directory holding any of these holds a run)
MANAGED = (CONFIG_FILE, CHANGES_FILE, METRICS_FILE, "curves.png", "checkpoints", "hf")
MANAGED += ("tensorboard", "tracking.json", "wandb", "mlruns")  # what the experiment loggers write
# options a resumed run may change: applied from the step it resumes at, reported, and recorded in CHANGES_FILE
CHANGEABLE_ON_RESUME = (
    "trainer.steps",
    "trainer.eval_every",
    "trainer.eval_live_weights",
    "trainer.save_every",
    "trainer.keep_last_n",
    "trainer.progress",
    "trainer.log_every",
    "trainer.logger",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.export_hf",
    "trainer.dist_timeout_s",
    "trainer.device",
    "critic.optim.lr",
)
# options a backend cannot change on resume, and why: refused there like any other difference, the reason given
FIXED_ON_RESUME = {
    "megatron": {
        "critic.optim.lr": "megatron-core builds its optimizer's parameter groups itself, without the per-group "
        "ratio a new rate is applied through, and saves none of them in its checkpoints",
    },
}
NOT_COMPARED = ("trainer.resume", "trainer.run_dir")  # how the run is found, not what it is
# options added after runs were saved: the value a saved config without them meant (such a run stays resumable)
ADDED_OPTIONS = {
    "trainer.length_adaptive_scope": "response",
    "critic.value_norm_decay": 1.0,
    "trainer.shared_prefix_returns": False,
    "trainer.eval_live_weights": False,
    "trainer.replay_rows": 0,
    "trainer.replay_window": 4,
    "trainer.replay_decay": 0.5,
    "trainer.surprise_z": None,
    "trainer.surprise_steps": 20,
    "trainer.surprise_lr_scale": 2.0,
    "trainer.surprise_mc_targets": False,
    "critic.targets_lam": None,
    "critic.targets_gamma": 1.0,
}
T = TypeVar("T")


def holds_a_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in MANAGED)


def same_options(options: dict[str, Any]) -> None:
    """Under torchrun, every rank must run the same options: a rank started otherwise (another seed, rate, run
    directory, data file, size) would train apart or abort in a collective. The keys that differ are named."""
    check_ranks_agree(options, "the ranks were started with different options", "start every rank alike")


def agree(lead: bool, action: Callable[[], T], share: bool = False) -> T | None:
    """`action()` on the first rank; its error, if any, raised on every rank (under torchrun). Returns the
    result on the first rank; elsewhere None, or with `share` the first rank's result (one every rank acts on)."""
    import torch.distributed as dist

    result, error = None, None
    if lead:
        try:
            result = action()
        except (OSError, ValueError) as err:
            error = err
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error, result if share else None]
        dist.broadcast_object_list(box, src=0)
        error, result = box[0], box[1] if share else result
    if error is not None:
        raise error
    return result


def claim(run_dir: Path, resume: str, overwrite: bool, say: Callable[[str], None]) -> RunDirLock:
    """Lock `run_dir` for this run. A new run (`resume=never`) does not start over an existing one: that is an
    error, or with `overwrite` the old run is moved aside (renamed, never deleted)."""
    if run_dir.is_symlink() and not run_dir.exists():
        raise ValueError(
            f"trainer.run_dir={run_dir} is a symlink to {os.readlink(run_dir)}, which does not exist; create the "
            "directory it names, or give another trainer.run_dir"
        )
    lock = RunDirLock(run_dir).acquire()
    if resume != "never" or not holds_a_run(run_dir):
        return lock
    if not overwrite:
        lock.release()
        raise ValueError(
            f"trainer.resume=never, but {run_dir} holds a run ({', '.join(_contents(run_dir))}); choose another "
            "trainer.run_dir, continue it with trainer.resume=auto, or pass --overwrite to move it aside"
        )
    aside = move_aside(run_dir)  # our lock moves with it and is still held: nobody slips in
    fresh = RunDirLock(run_dir).acquire()
    lock.release()
    say(f"moved the previous run aside to {aside}")
    return fresh


def resume(ckpt_root: Path, resume: str, load: Callable[[Path], T], say: Callable[[str], None]) -> T | None:
    """`load(checkpoint)` of the checkpoint to resume from: `resume=auto` takes the newest complete one that
    verifies (saying which damaged ones it skipped; none at all verifying is an error), a path takes that one,
    `never` none."""
    if resume == "never":
        return None
    if resume != "auto":
        check_nothing_newer(ckpt_root, Path(resume))
        return load(Path(resume))
    candidates = complete_checkpoints(ckpt_root)[::-1]
    problems = []
    for checkpoint in candidates:
        try:
            result = load(checkpoint)
        except CheckpointDamaged as err:
            problems.append(str(err))
            say(f"{err}; trying the checkpoint before it")
            continue
        return result
    if problems:
        raise ValueError(
            f"no checkpoint under {ckpt_root} verifies ({'; '.join(problems)}); restore them from a copy, or start "
            "a new run (another trainer.run_dir, or trainer.resume=never --overwrite to move this one aside)"
        )
    return None


def check_nothing_newer(ckpt_root: Path, named: Path) -> None:
    """`trainer.resume=<a checkpoint>` older than one the run holds would replace the newer checkpoints and their
    metrics as it trains on: refused, naming the newer steps and the ways out. (A checkpoint that does not read is
    left to the load's own message.)"""
    try:
        step = read_state(named).get("worker_step")
    except (OSError, ValueError):
        return
    if isinstance(step, bool) or not isinstance(step, int):
        return
    newer = [c for c in complete_checkpoints(ckpt_root) if (checkpoint_step(c) or 0) > step]
    if newer:
        steps = ", ".join(str(checkpoint_step(c)) for c in newer)
        raise ValueError(
            f"trainer.resume={named} is step {step}, but {ckpt_root} holds newer checkpoints (step {steps}); "
            f"training on from step {step} would replace them and the metrics after it. Resume from the newest "
            f"(trainer.resume=auto), or start a new run from step {step} (another trainer.run_dir, same trainer.resume)"
        )


def check_nothing_to_lose(run_dir: Path) -> None:
    """A run starting at step 0 in a directory whose metrics record steps (no checkpoint was saved: e.g.
    `trainer.save_every=0`, killed before the last step) would replace them: refused, naming the way out."""
    rows = _metrics_rows(run_dir / METRICS_FILE)
    if rows:
        raise ValueError(
            f"{run_dir} records {rows} step(s) in {METRICS_FILE} but holds no checkpoint to resume them from (saved "
            "every trainer.save_every steps; 0: at the last one only); starting again would replace them: pass "
            "trainer.resume=never --overwrite to move the run aside and start afresh, or choose another trainer.run_dir"
        )


def _metrics_rows(path: Path) -> int:
    """The number of rows of a metrics file (0 when it is absent)."""
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def changeable_on_resume(strategy: str) -> tuple[str, ...]:
    """The options a resumed run of `critic.strategy` may change: CHANGEABLE_ON_RESUME but its FIXED_ON_RESUME."""
    fixed = FIXED_ON_RESUME.get(strategy, {})
    return tuple(key for key in CHANGEABLE_ON_RESUME if key not in fixed)


def why_fixed(strategy: str) -> dict[str, str]:
    """Why each option of FIXED_ON_RESUME cannot change under `critic.strategy`, for the refusal's message."""
    return {
        key: f"strategy={strategy} cannot change it on resume: {why}"
        for key, why in FIXED_ON_RESUME.get(strategy, {}).items()
    }


def option_changes(
    run_dir: Path, current: dict[str, Any], changeable: tuple[str, ...], why: dict[str, str] | None = None
) -> dict[str, list[Any]]:
    """The options of this invocation that differ from the saved run's (`key: [saved, now]`): those in
    `changeable`; any other difference is an error listing them all (with `why[key]` where a reason is known). A run
    that never trained a step (no checkpoint, no metric row: its start failed) holds nothing the options made, so it
    takes the new ones."""
    import yaml

    saved_file = run_dir / CONFIG_FILE
    if not saved_file.is_file() or not (
        complete_checkpoints(run_dir / "checkpoints") or _metrics_rows(run_dir / METRICS_FILE)
    ):
        return {}
    saved = {**ADDED_OPTIONS, **flat_options(yaml.safe_load(saved_file.read_text()) or {})}
    now = {**ADDED_OPTIONS, **flat_options(current)}
    differ = {k: [saved.get(k), now.get(k)] for k in sorted(saved.keys() | now.keys()) if saved.get(k) != now.get(k)}
    differ = {k: v for k, v in differ.items() if k not in NOT_COMPARED}
    refused = {k: v for k, v in differ.items() if k not in changeable}
    if refused:
        reasons = {k: f" ({why[k]})" for k in refused if k in (why or {})}
        listed = "; ".join(f"{k}: {old!r} -> {new!r}{reasons.get(k, '')}" for k, (old, new) in refused.items())
        raise ValueError(
            f"these options differ from the run being resumed in {run_dir} (saved -> now): {listed}. They cannot "
            f"change mid-run: keep them as saved (see {saved_file}; --config {saved_file} resumes with all of them), "
            "or start a new run (another trainer.run_dir, or trainer.resume=never --overwrite). Options that may "
            f"change on resume: {', '.join(changeable)}"
        )
    return differ


def record_changes(run_dir: Path, step: int, changes: dict[str, list[Any]]) -> None:
    """Append `{"step", "changed": {key: [old, new]}}` to the run's history of option changes."""
    path = run_dir / CHANGES_FILE
    old = path.read_text() if path.is_file() else ""
    write_file(path, old + json.dumps({"step": step, "changed": changes}) + "\n")


def _contents(run_dir: Path) -> list[str]:
    return [name for name in MANAGED if (run_dir / name).exists()]


def is_run_dir(path: Path) -> bool:
    """A run directory, whatever its name: it holds our marker, or (a run written before the marker) a config.yaml."""
    path = Path(path)
    return (path / MARKER).is_file() or (path / CONFIG_FILE).is_file()


def mark(run_dir: Path, finished_step: int | None = None) -> None:
    """Say in `run_dir` that it holds a run (written with its first config.yaml), and once its final outputs (curves,
    HF export) are written, for which step."""
    if finished_step is not None or not (run_dir / MARKER).is_file():
        write_file(run_dir / MARKER, json.dumps({"ppo_critic_run": True, "finished_step": finished_step}) + "\n")


def finished_step(run_dir: Path) -> int | None:
    """The step whose final outputs the run last wrote, from its marker; None when not recorded (or unreadable)."""
    try:
        record = json.loads((run_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    step = record.get("finished_step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def runs_touched(path: Path, own: Path | None = None) -> list[tuple[str, Path]]:
    """The run directories, other than `own`, whose files a command writing at `path` would touch: those it is or
    lies in, and (a directory) those it holds; each as (how, run). Symlinks are followed, `..` resolved."""
    target = Path(path).resolve()
    own = Path(own).resolve() if own is not None else None
    found = [("is" if run == target else "is inside", run) for run in (target, *target.parents) if is_run_dir(run)]
    found += [("holds", run) for run in _runs_below(target)]
    return [(how, run) for how, run in found if run != own]


def _runs_below(root: Path) -> list[Path]:
    """The first run directory strictly below `root` (symlinks not followed: moving `root` leaves their targets)."""
    looked = 0
    for parent, dirs, _ in os.walk(root):
        looked += len(dirs)
        if looked > SCAN_LIMIT:
            raise ValueError(
                f"{root} holds more than {SCAN_LIMIT} directories, too many to check that no run directory is among "
                "them; name a new or an empty directory"
            )
        runs = [Path(parent, d) for d in dirs if is_run_dir(Path(parent, d))]
        if runs:
            return runs[:1]
    return []


def check_place(path: Path, what: str, own: Path | None = None) -> None:
    """Refuse `path` (named `what` in the message) when a command writing there would touch another run directory's
    files, or replace the working directory (an empty or unset path reads as `.`)."""
    target = Path(path).resolve()
    if target == Path.cwd().resolve() or target in Path.cwd().resolve().parents:
        raise ValueError(
            f"{what}={str(path)!r} is the working directory or holds it (an empty or unset variable?); name a new "
            "directory"
        )
    for how, run in runs_touched(target, own):
        whose = ", whose files ppo-critic manages" if how != "holds" else ""
        raise ValueError(f"{what}={path} {how} the run directory {run}{whose}; write elsewhere")


def check_output(out: Path, kind: str, inputs: list[Path], force: bool, move: bool = True) -> Path | None:
    """Refuse an output path that would destroy something: the working directory, one in, at or above any run
    directory, one that is an input of the command, or an existing `kind` ("file" or "directory") — unless `force`,
    which replaces a file or moves a directory aside (renamed, never deleted; returned). `move=False` only checks:
    a command calls it again to move once everything else it reads has verified."""
    target = Path(out).resolve()
    check_place(out, "out_dir" if kind == "directory" else "out")
    for source in inputs:
        if Path(source).exists() and target.exists() and target.samefile(source) and not force:
            raise ValueError(
                f"out={out} is the input {source}: it would be overwritten; choose another out= (or --force)"
            )
    if not target.exists():
        return None
    if kind == "file":
        if target.is_dir():
            raise ValueError(f"out={out} is a directory; name a file")
        if not target.is_file():  # --force replaces files, never a device, a pipe or a socket
            raise ValueError(f"out={out} is not a regular file (a device or a pipe?); name a file")
        if not force:
            raise ValueError(f"out={out} exists; choose a new file, or pass --force to replace it")
        return None
    if target.is_dir() and not any(target.iterdir()):
        return None
    if not force:
        raise ValueError(f"{out} exists and is not empty; choose a new directory, or pass --force to move it aside")
    return move_aside(target) if move else None
