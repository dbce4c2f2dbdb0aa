"""A training run's directory from claim to finish, as one object (DESIGN §7: the user's files): its lock, the
resume or the refusal, the options changed on resume, and what the run writes once at its last step.

`train` is the loop; everything it does to the run directory goes through `Run`. Only the first rank touches the
files; `rundir.agree` gives every rank the outcome, so a refusal ends the whole job at once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ppo_critic.config.train import TrainerConfig
from ppo_critic.run import rundir
from ppo_critic.run.checkpoint import complete_checkpoints
from ppo_critic.run.console import summary
from ppo_critic.run.files import RunDirLock, write_file
from ppo_critic.run.plots import plot_curves
from ppo_critic.run.runlog import CURVES_FILE, METRICS_FILE, read_metrics

T = TypeVar("T")


def config_yaml(options: dict[str, Any]) -> str:
    """The options as the YAML a run prints and saves in its config.yaml."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(options))


class Run:
    """One `train` call's run directory (`trainer.run_dir`): `claim` it, `check_options`, `resume`, `start`, then
    `finish` at the last step (or `complete` a run already there); used as a context manager, the lock is released
    however the call ends. `say` prints (a no-op but on the first rank)."""

    def __init__(self, trainer: TrainerConfig, lead: bool, say: Callable[[str], None]):
        self.trainer, self.lead, self.say = trainer, lead, say
        self.path = Path(trainer.run_dir)
        self.checkpoints = self.path / "checkpoints"
        self.changes: dict[str, list[Any]] = {}  # the options changed on resume, `key: [saved, now]`
        self.resumed: Any = None  # what `load` returned for the checkpoint resumed from
        self.lock: RunDirLock | None = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        """Release the lock (the first rank's), however the call ended; a call that failed before writing anything
        leaves no lock file (nor a directory it created) behind."""
        if self.lock is not None:
            (self.lock.release if kind is None else self.lock.abandon)()

    def _agree(self, action: Callable[[], T], share: bool = False) -> T | None:
        """`action()` on the first rank, its error raised on every rank (`rundir.agree`)."""
        return rundir.agree(self.lead, action, share)

    def claim(self, overwrite: bool) -> Run:
        """Refuse a place where the run would touch another run's files, then lock it: a new run never starts over
        an existing one (`overwrite` moves that aside)."""
        self._agree(lambda: rundir.check_place(self.path, "trainer.run_dir", own=self.path))  # before it is created
        self.lock = self._agree(lambda: rundir.claim(self.path, self.trainer.resume, overwrite, self.say))
        return self

    def check_options(self, options: dict[str, Any], strategy: str) -> dict[str, list[Any]]:
        """The options that differ from the saved run's, before anything loads: refused (every key listed) unless
        `rundir.changeable_on_resume(strategy)`; every rank gets them (each applies a new rate to its optimizer)."""
        if self.trainer.resume != "never":
            changeable, why = rundir.changeable_on_resume(strategy), rundir.why_fixed(strategy)
            changes = self._agree(lambda: rundir.option_changes(self.path, options, changeable, why), share=True)
            self.changes = changes or {}
        return self.changes

    def resume(self, load: Callable[[Path], T]) -> T | None:
        """`load(checkpoint)` of the checkpoint `trainer.resume` names (auto: the newest that verifies), saying the
        options changed; None for a fresh start, refused when it would replace recorded steps."""
        self.resumed = rundir.resume(self.checkpoints, self.trainer.resume, load, self.say)
        if self.resumed is not None and self.changes:
            changed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in self.changes.items())
            self.say(f"options changed on resume: {changed}")
        if self.resumed is None and self.trainer.resume == "auto":
            self._agree(lambda: rundir.check_nothing_to_lose(self.path))
        return self.resumed

    def start(self, options: dict[str, Any], step: int) -> None:
        """Before the first step of this call (a refused or failed resume leaves the files as they were): save the
        options, mark the directory as a run's, and record the changes since the saved run at `step`."""
        if not self.lead:
            return
        write_file(self.path / rundir.CONFIG_FILE, config_yaml(options))
        rundir.mark(self.path)
        if self.resumed is not None and self.changes:
            rundir.record_changes(self.path, step, self.changes)

    def finish(self, step: int, export: Callable[[Path], object], title: str, eval_name: str | None) -> None:
        """What a run writes once at its last step: the curves (`title`), `export(path)` of the HF model (every rank
        calls it), and in its marker that both are done."""
        if self.lead and "jsonl" in self.trainer.logger:
            plot_curves(self.path / METRICS_FILE, self.path / CURVES_FILE, title, eval_name)
        if self.trainer.export_hf:
            export(self.path / "hf")
        if self.lead:
            rundir.mark(self.path, finished_step=step)

    def complete(self, step: int, export: Callable[[Path], object], title: str, eval_name: str | None) -> dict:
        """A run already at its last `step`: say so, and return its final metrics. Nothing is written, unless the
        call that saved the last checkpoint ended before `finish` (killed): it finishes now."""
        rows = read_metrics(self.path / METRICS_FILE)
        final = {k: v for k, v in (rows[-1] if rows else {}).items() if k != "step"}
        if self.finished(step):
            self.say(summary("run complete", step, final, eval_name) + f" | {self.path} (nothing to do)")
            return final
        self.finish(step, export, title, eval_name)
        self.say(summary("done", step, final, eval_name) + f" | {self.path} (curves and export written)")
        return final

    def finished(self, step: int) -> bool:
        """`finish` ran at `step`, says the marker; a run older than the marker: what `finish` writes is there."""
        if (self.path / rundir.MARKER).is_file():
            return rundir.finished_step(self.path) == step
        curves = "jsonl" not in self.trainer.logger or (self.path / CURVES_FILE).is_file()
        return curves and (not self.trainer.export_hf or (self.path / "hf").is_dir())

    def resumes_from(self, step: int) -> str:
        """Where a rerun after an interrupt at `step` resumes: the newest complete checkpoint up to `step` (not a
        damaged newer one that resume skipped), or the start."""
        done = [c for c in complete_checkpoints(self.checkpoints) if int(c.name[5:]) <= step]
        newest = done[-1] if done else None
        return f"step {newest.name.split('_')[-1].lstrip('0') or 0} ({newest})" if newest else "the start"
