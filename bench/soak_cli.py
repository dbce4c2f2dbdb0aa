"""Soak of the CLI's data safety: random commands over run directories on a small real file system.

200 commands (by default) drawn at random: `train` (resuming, with options that may or may not change mid-run, new
runs with and without `--overwrite`), `export` and `values` (to fresh paths, existing ones, with `--force`, into the
run directory, over their own input; padded or packed), a `train` killed with SIGKILL, SIGTERM or SIGINT (Ctrl-C) at
a random moment (and SIGTERM while it saves a checkpoint every step: the clean exit 2 is promised), a second writer
while one trains, two `values` or `export`s started together to one new output (one result, whole, no temporaries),
and a `train` on a disk that fills up. Cross-run commands aim at
a second run beside the first (`other/`): exports, values and new runs into it, inside its checkpoints and `hf/`,
over the directory holding both, `""` and `.`; and `other/` itself resumed. Every command must end with exit code 0
or 2 (never a traceback), and leave every run directory but its own (`train`'s) file for file as it was; after each,
every complete checkpoint must verify, `config.yaml` must parse and the rollout file must be intact. At the end one
more `train` resumes the run to its last step, and `metrics.jsonl` must hold exactly the steps of the final checkpoint.

Five more surfaces (issue 52), each a kind of its own with runs of its own beside the two (their options fixed at the
start, drawn from the seed), checked by the same invariants (and no temporary left anywhere outside a run directory):
- replay: a run with `trainer.replay_rows=<whole mini-batches>` resumed, killed (SIGKILL / SIGTERM) and resumed, or
  resumed with a replay option changed: a resume ends 0 at its last step, a change is refused (exit 2, naming it, the
  run left as it was);
- drift: two runs of a built-in task drifting (`task.drift=ramp` and `step`, its start, length and end drawn), the same;
- objectives: a `bce` (value_norm off) and a `huber` (PopArt) run, the same; `values` of them and of their exports told
  what the outputs mean (`critic.vf_loss_type`, `critic.value_norm`: exit 2 naming it, no output) or how the forward
  runs (exit 0, every row's values, bce's in [0, 1]); an export whose config.json lost its objective (exit 2 naming
  config.json, unless `critic.vf_loss_type` is given); bce on the scale task (exit 2, then the same directory starts
  with mse);
- full-export: `export` (new path or an existing export, with and without `--force`) and `values` on a disk filled to
  a few bytes or kilobytes: exit 0 with the output whole (a previous export moved aside whole as `<name>.old-<time>`),
  or exit 2 with one error line naming a file and the old output as it was;
- long-names: the same on an output named with 200-255 bytes (ASCII, 2- and 3-byte UTF-8), never "File name too long".
The kinds are dealt from a shuffled deck in proportion to their weights, so 300 commands hold each new kind >= 10 times.

Runs as root (it mounts a tmpfs). Commands run in forked children of this warmed-up process (no import per command):
    python bench/soak_cli.py [--commands 200] [--seed 0] [--out bench/results/soak_cli.json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import torch

import ppo_critic.cli as cli
import ppo_critic.train  # noqa: F401  (warm: a forked command imports nothing, as the docstring promises)
from ppo_critic.config.modes import EXPORTED_OBJECTIVE, VALUE_NORM_MODES, VF_LOSS_TYPES
from ppo_critic.models.hf import check_trained_critic
from ppo_critic.run.checkpoint import complete_checkpoints, latest_checkpoint, verify_checkpoint
from ppo_critic.run.files import LOCK_FILE, write_file
from ppo_critic.run.rundir import is_run_dir
from ppo_critic.run.runlog import read_metrics

RUN_ARGS = [
    "trainer.rollout_batch_size=8",
    "trainer.eval_size=16",
    "trainer.eval_every=2",
    "trainer.save_every=2",
    "trainer.keep_last_n=3",
    "trainer.progress=false",
    "trainer.logger=[console,jsonl]",
    "critic.ppo_mini_batch_size=4",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "critic.model.override_config.hidden_size=32",
    "critic.model.override_config.intermediate_size=64",
]
MINI = 4  # critic.ppo_mini_batch_size of RUN_ARGS: replay_rows takes whole mini-batches
# command kind -> how often it is drawn
KINDS = {
    "resume": 20,
    "changed": 6,
    "refused": 5,
    "never": 3,
    "overwrite": 2,
    "export": 12,
    "values": 12,
    "sigkill": 10,
    "sigterm": 6,
    "sigint": 5,
    "second-writer": 5,
    "full-disk": 15,
    "cross-export": 30,
    "cross-values": 25,
    "cross-train": 25,
    "other-resume": 4,
    "same-values": 8,
    "same-export": 6,
    "kill-in-save": 10,
    "replay": 12,
    "drift": 12,
    "objectives": 20,
    "full-export": 15,
    "long-names": 12,
}
CROSS = ("cross-export", "cross-values", "cross-train")
ROW = {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "reward": 1.0}
# `values` options of how the forward runs (or a saved value repeated): never refused
FORWARD_OPTIONS = (
    "critic.forward_micro_batch_size_per_gpu=1",
    "critic.ppo_micro_batch_size_per_gpu=1",
    "critic.model.use_remove_padding=false",
    "critic.model.use_remove_padding=true",
    "critic.use_dynamic_bsz=true",
    "critic.dtype=bfloat16",
)
DRIFTED = {"counting": (0.05, 0.95), "dense": (0.05, 0.95), "scale": (1.0, 50.0)}  # task -> its drift_to's range
LONG_CHARS = ("a", "é", "漢")  # 1-, 2- and 3-byte UTF-8


@dataclass
class Line:
    """A run of a new kind: the options it was started with, and those a resume of it must refuse."""

    path: Path
    options: list[str]
    fixed: list[str]
    objective: str = "mse"
    norm: str = "popart"
    steps: int = 2


def meanings(objective: str, norm: str) -> list[str]:
    """The options that would change what a critic of `objective` / `norm` outputs: every other one."""
    other = [f"critic.vf_loss_type={name}" for name in VF_LOSS_TYPES if name != objective]
    return other + [f"critic.value_norm={mode}" for mode in VALUE_NORM_MODES if mode != norm]


def replay_line(root: Path, rng: random.Random) -> Line:
    """A run replaying a drawn number of whole mini-batches from a drawn window; other replay options are refused."""
    rows, window = rng.choice([MINI, 2 * MINI, 3 * MINI, 4 * MINI]), rng.randint(1, 4)
    fixed = [f"trainer.replay_rows={rows + MINI}", "trainer.replay_rows=0", f"trainer.replay_rows={rows + 2}"]
    fixed += [f"trainer.replay_window={window + 1}", "trainer.replay_decay=1.0"]
    return Line(root / "replay", [f"trainer.replay_rows={rows}", f"trainer.replay_window={window}"], fixed)


def drift_line(root: Path, rng: random.Random, mode: str) -> Line:
    """A run of a drawn built-in task drifting (`mode`: ramp or step) from a drawn step to a drawn end."""
    task, (low, high) = rng.choice(list(DRIFTED.items()))
    start, steps, end = rng.randint(0, 3), rng.randint(1, 4), round(rng.uniform(low, high), 2)
    moved = high if end < (low + high) / 2 else low  # another end, never the same
    options = [f"task.name={task}", f"task.drift={mode}", f"task.drift_start={start}", f"task.drift_to={end}"]
    options += [f"task.drift_steps={steps}"] * (mode == "ramp")
    fixed = ["task.drift=none", f"task.drift_start={start + 1}", f"task.drift_to={moved}"]
    return Line(root / f"drift-{mode}", options, fixed + [f"task.drift_steps={steps + 1}"] * (mode == "ramp"))


def objective_lines(root: Path, rng: random.Random) -> dict[str, Line]:
    """A bce run (value_norm off, the counting task's 0/1 rewards) and a huber run under the recipe's PopArt."""
    bce = Line(root / "bce", ["critic.vf_loss_type=bce", "critic.value_norm=off"], [], "bce", "off")
    delta = rng.choice(["0.5", "1.0", "2.0"])
    huber = Line(root / "huber", ["critic.vf_loss_type=huber", f"critic.huber_delta={delta}"], [], "huber")
    for line in (bce, huber):
        line.fixed = meanings(line.objective, line.norm)
    return {"bce": bce, "huber": huber}


def deck(rng: random.Random, commands: int) -> list[str]:
    """`commands` kinds in a random order, each as often as its share of KINDS (largest remainders get the rest):
    every kind's count is fixed by `commands`, not left to chance."""
    total = sum(KINDS.values())
    shares = {kind: commands * weight / total for kind, weight in KINDS.items()}
    counts = {kind: int(share) for kind, share in shares.items()}
    for kind in sorted(KINDS, key=lambda k: counts[k] - shares[k])[: commands - sum(counts.values())]:
        counts[kind] += 1
    kinds = [kind for kind, n in counts.items() for _ in range(n)]
    rng.shuffle(kinds)
    return kinds


def long_name(rng: random.Random, suffix: str) -> str:
    """A file name of 200-255 bytes (the file system's limit) with `suffix`: one 1-, 2- or 3-byte character repeated."""
    char = rng.choice(LONG_CHARS)
    width = len(char.encode())
    return char * rng.randint(-(-(200 - len(suffix)) // width), (255 - len(suffix)) // width) + suffix


def train_of(run: Path, steps: int, *extra: str) -> list[str]:
    """`ppo-critic train` of `run` to `steps` with the soak's small options and `extra`."""
    return ["train", *RUN_ARGS, f"trainer.run_dir={run}", f"trainer.steps={steps}", *extra]


def fork(argv: list[str], log: Path) -> int:
    """`ppo-critic <argv>` in a forked child; its pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal, however run
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = cli.main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def tree(path: Path) -> dict[str, str]:
    """Every file under `path` (its lock file aside) -> its sha256: what "left as it was" compares."""
    files = (p for p in sorted(path.rglob("*")) if p.is_file() and p.name != LOCK_FILE)
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def content(path: Path) -> dict[str, str] | None:
    """What is at `path` (a directory's tree, a file's sha256 under ""), None when nothing: "untouched" compares it."""
    if path.is_dir():
        return tree(path)
    return {"": hashlib.sha256(path.read_bytes()).hexdigest()} if path.is_file() else None


def value_rows(path: Path) -> list[list[float]] | None:
    """The values a `values` output holds (one row of ROW's response length each), None when it is missing or torn."""
    try:
        rows = [json.loads(line)["values"] for line in path.read_text(encoding="utf-8").splitlines()]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rows if len(rows) == 1 and len(rows[0]) == len(ROW["response_ids"]) else None


def export_whole(path: Path) -> bool:
    """An export is whole: config.json naming its objective, and every weight file a critic needs, each loadable."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        check_trained_critic(path)
        named = EXPORTED_OBJECTIVE in json.loads((path / "config.json").read_text(encoding="utf-8"))
        return named and all(load_file(f) is not None for f in path.glob("*.safetensors"))
    except (OSError, ValueError, SafetensorError):
        return False


def temporaries(root: Path) -> list[str]:
    """The temporaries (`.tmp-*`, `.*.tmp`) under `root` outside run directories (a killed `train` leaves its own,
    which its next save removes): a write that failed or finished left none behind."""
    found = []
    for where, dirs, files in os.walk(root):
        if is_run_dir(Path(where)):
            dirs.clear()
            continue
        names = [n for n in dirs + files if n.startswith(".tmp-") or (n.startswith(".") and n.endswith(".tmp"))]
        found += [os.path.join(where, n) for n in names]
    return found


def remove(path: Path) -> None:
    """Delete the soak's own output at `path` (a file or a directory), if any: room on its small disk."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def outcome(pid: int) -> str:
    _, status = os.waitpid(pid, 0)
    return f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"


class Soak:
    def __init__(self, root: Path, seed: int):
        self.root, self.rng = root, random.Random(seed)
        self.run = root / "run"
        self.other = root / "other"  # a second run beside the first, aimed at by the cross-run commands
        self.other_steps = 2
        self.steps = 2
        self.log = root.parent / "command.log"  # off the soak's disk: a full disk still takes the command's output
        self.data = root / "rollouts.jsonl"
        self.data.write_text(json.dumps(ROW) + "\n")
        self.outcomes: collections.Counter = collections.Counter()
        self.drawn: collections.Counter = collections.Counter()
        self.violations: list[str] = []
        self.seen: set[str] = set()  # temporaries already reported
        self.decks: dict[str, list] = {}  # per choice, what `dealt` has not dealt yet
        self.lines = {"replay": replay_line(root, self.rng), **objective_lines(root, self.rng)}
        self.lines |= {f"drift-{mode}": drift_line(root, self.rng, mode) for mode in ("ramp", "step")}

    def dealt(self, name: str, options: list) -> object:
        """The next of `options` from a shuffled deck of them kept under `name`: every option comes once in each
        round, so a rare kind still meets all of its actions (a plain draw left one out of 21 objectives commands)."""
        if not self.decks.get(name):
            self.decks[name] = self.rng.sample(options, len(options))
        return self.decks[name].pop()

    def train_argv(self, *extra: str) -> list[str]:
        return train_of(self.run, self.steps, *extra)

    def other_argv(self) -> list[str]:
        return train_of(self.other, self.other_steps)

    def line_argv(self, line: Line, *extra: str) -> list[str]:
        return train_of(line.path, line.steps, *line.options, *extra)

    def values_argv(self, source: Path, out: Path, *extra: str) -> list[str]:
        return ["values", str(source), f"data={self.data}", f"out={out}", *extra]

    def runs(self) -> list[Path]:
        """The run directories the invariants watch: the two, and every new kind's."""
        return [self.run, self.other, *(line.path for line in self.lines.values())]

    def fail(self, kind: str, argv: list[str], why: str) -> None:
        """A violation: the command, what it broke, and the end of its output."""
        self.violations.append(f"{kind} {argv}: {why}: {self.log.read_text(errors='replace')[-1500:]}")

    def command(self, kind: str, argv: list[str], own: Path | None = None) -> str:
        """Run `argv`; it may write only into the run directory `own` (a `train`'s), every other stays as it was."""
        others = [r for r in self.runs() if r != own and r.exists()]
        before = {r: tree(r) for r in others}
        result = outcome(fork(argv, self.log))
        self.outcomes[(kind, result)] += 1
        if result not in ("exit 0", "exit 2"):
            self.violations.append(f"{kind} {argv[:1]} ended with {result}: {self.log.read_text()[-1500:]}")
        for run, files in before.items():
            if tree(run) != files:
                self.violations.append(f"{kind} {argv} changed {run}: {self.log.read_text()[-500:]}")
        return result

    def start_lines(self) -> None:
        """Start every new kind's run: each must train to its first checkpoint."""
        for name, line in self.lines.items():
            if self.command(f"start-{name}", self.line_argv(line), own=line.path) != "exit 0":
                self.fail(f"start-{name}", self.line_argv(line), "a new kind's run did not start")

    def cross(self, kind: str) -> None:
        """A command of the first run aimed at the second's paths, or a new run placed in or over a run."""
        newest = latest_checkpoint(self.other / "checkpoints") or self.other / "checkpoints" / "step_00000002"
        inside = [self.other, self.other / "checkpoints", newest, newest / "hf", self.other / "hf", self.root]
        inside += [self.other / "checkpoints" / ".." / "tensorboard", Path(""), Path(".")]
        force = self.rng.choice([[], ["--force"]])
        if kind == "cross-export":
            self.command(kind, ["export", str(self.run), str(self.rng.choice(inside)), *force])
        elif kind == "cross-values":
            target = self.rng.choice([self.other / "metrics.jsonl", newest / "v.jsonl", self.other / "config.yaml"])
            self.command(kind, ["values", str(self.run), f"data={self.data}", f"out={target}", *force])
        else:
            where = self.rng.choice([newest / "sub", self.other / "hf" / "runB", self.root, self.other / "x" / "y"])
            self.command(kind, train_of(where, 2), own=where if where.resolve() != self.root.resolve() else None)

    def killed(self, kind: str, sig: signal.Signals, argv: list[str]) -> None:
        """`train` killed with `sig` at a random moment: exit 0 or 2 (finished, or stopped cleanly), or the signal."""
        pid = fork(argv, self.log)
        time.sleep(self.rng.uniform(0.3, 4.0))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        result = outcome(pid)
        self.outcomes[(kind, result)] += 1
        if result not in ("exit 0", "exit 2", f"signal {int(sig)}"):
            self.violations.append(f"{kind} ended with {result}: {self.log.read_text()[-1500:]}")

    def second_writer(self) -> None:
        self.steps += 4
        first = fork(self.train_argv(), self.root.parent / "first.log")
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.command("second-writer", self.train_argv(), own=self.run)
        with contextlib.suppress(ProcessLookupError):
            os.kill(first, signal.SIGKILL)
        outcome(first)

    def same_target(self, kind: str) -> None:
        """Two `values` (or `export`s) started together with one new output: each ends 0 or 2, exactly one result
        is there and whole, and no temporary is left beside it."""
        target = self.root / f"same-{self.rng.randint(0, 10**9)}"
        if kind == "same-values":
            target = target.with_suffix(".jsonl")
            argv = ["values", str(self.run), f"data={self.data}", f"out={target}"]
        else:
            argv = ["export", str(self.run), str(target)]
        pids = [fork(argv, self.root.parent / f"{kind}-{n}.log") for n in range(2)]
        results = [outcome(pid) for pid in pids]
        for result in results:
            self.outcomes[(kind, result)] += 1
        exported = (target / "config.json").is_file() if kind == "same-export" else target.is_file()
        whole = exported and (kind == "same-export" or json.loads(target.read_text().splitlines()[0]))
        leftovers = [p.name for p in self.root.iterdir() if p.name.startswith(".") and target.name in p.name]
        wrote = results.count("exit 0")  # none when the run had no checkpoint yet (both refused, nothing written)
        if any(r not in ("exit 0", "exit 2") for r in results) or wrote > 1 or bool(wrote) != bool(whole):
            self.violations.append(f"{kind}: {results}, output whole: {bool(whole)}")
        if leftovers:
            self.violations.append(f"{kind}: temporaries left beside {target.name}: {leftovers}")

    def kill_in_save(self) -> None:
        """SIGTERM while `train` saves a checkpoint every step (so the signal often lands inside a write): the
        promised clean end is exit 2 with "resume from" (or exit 0 when it finished first), never a traceback."""
        self.steps += self.rng.randint(3, 8)
        pid = fork(self.train_argv("trainer.save_every=1"), self.log)
        time.sleep(self.rng.uniform(1.0, 4.0))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        result = outcome(pid)
        self.outcomes[("kill-in-save", result)] += 1
        text = self.log.read_text()
        if result not in ("exit 0", "exit 2") or (result == "exit 2" and "resume from" not in text):
            self.violations.append(f"kill-in-save ended with {result}: {text[-1500:]}")

    @contextlib.contextmanager
    def filled(self, room: int) -> Iterator[None]:
        """The soak's disk filled by a filler file up to `room` free bytes while the command inside runs."""
        filler = self.root / "filler"
        disk = os.statvfs(self.root)
        with open(filler, "wb") as f, contextlib.suppress(OSError):  # no room at all: the disk is as full as it gets
            f.write(b"\0" * max(0, disk.f_bavail * disk.f_frsize - room))
        try:
            yield
        finally:
            filler.unlink()

    def full_disk(self) -> None:
        self.steps += self.rng.randint(1, 4)
        with self.filled(self.rng.randint(50_000, 2_000_000)):
            self.command("full-disk", self.train_argv(), own=self.run)

    def line_kind(self, kind: str, line: Line) -> None:
        """A new kind's run resumed, killed (SIGKILL / SIGTERM) at a random moment and resumed, or resumed with an
        option it must keep."""
        action = self.rng.choices(["resume", "kill", "refuse"], weights=[2, 2, 1])[0]
        if action == "refuse":
            self.refuse(kind, line)
            return
        if action == "kill":
            line.steps += self.rng.randint(2, 6)
            sig = self.rng.choice([signal.SIGKILL, signal.SIGTERM])
            self.killed(f"{kind}:{sig.name}", sig, self.line_argv(line))
        self.resume(kind, line)

    def resume(self, kind: str, line: Line) -> None:
        """A resume (after a kill too) must end 0 with the run's newest checkpoint at its last step."""
        line.steps += self.rng.randint(0, 2)
        argv = self.line_argv(line)
        result = self.command(f"{kind}:resume", argv, own=line.path)
        newest = latest_checkpoint(line.path / "checkpoints")
        if result != "exit 0" or newest is None or int(newest.name.split("_")[1]) != line.steps:
            self.fail(kind, argv, f"did not resume to step {line.steps} ({result}, newest {newest})")

    def refuse(self, kind: str, line: Line) -> None:
        """A resume changing an option the run must keep: exit 2 naming it, the run left as it was."""
        option = self.rng.choice(line.fixed)
        argv = self.line_argv(line, option, f"trainer.steps={line.steps + 1}")
        before = tree(line.path)
        result = self.command(f"{kind}:refused", argv, own=line.path)
        if result != "exit 2" or option.split("=")[0] not in self.log.read_text() or tree(line.path) != before:
            self.fail(kind, argv, f"a changed {option.split('=')[0]} was not refused with the run left as it was")

    def objectives(self) -> None:
        """bce and huber: their runs, exports, and `values` of both told what the outputs mean or how to run."""
        line = self.lines[self.rng.choice(["bce", "huber"])]
        action = self.dealt("objectives", ["train", "export", "meaning", "forward", "unnamed", "bce-scale"])
        if action == "train":
            self.line_kind("objectives", line)
        elif action == "export":
            self.export_of(line, fresh=True)
        elif action == "meaning":
            self.meaning(line)
        elif action == "forward":
            self.forward(line)
        elif action == "unnamed":
            self.unnamed(line)
        else:
            self.bce_scale()

    def export_of(self, line: Line, fresh: bool = False) -> Path | None:
        """The line's export (made now when it has none yet, or `fresh`): where it is, None when it failed."""
        target = self.root / f"{line.path.name}-export"
        if fresh or not target.exists():
            remove(target)  # the soak's own export, remade
            argv = ["export", str(line.path), str(target)]
            if self.command("objectives:export", argv) != "exit 0" or not export_whole(target):
                self.fail("objectives:export", argv, "the export failed or is not whole")
                return None
        return target

    def source_of(self, line: Line) -> tuple[Path, str]:
        """The run or its export, drawn, and the value_norm it declares (an export folds it: off)."""
        export = self.export_of(line) if self.rng.random() < 0.5 else None
        return (export, "off") if export else (line.path, line.norm)

    def fresh_out(self) -> Path:
        """A values output path nothing is at yet."""
        return self.root / f"values-{self.rng.randint(0, 10**9)}.jsonl"

    def meaning(self, line: Line) -> None:
        """`values` told what the outputs mean on the command line: exit 2 naming the option, no output file."""
        source, norm = self.source_of(line)
        option, out = self.rng.choice(meanings(line.objective, norm)), self.fresh_out()
        argv = self.values_argv(source, out, option)
        result = self.command("objectives:meaning", argv)
        named = option.split("=")[0].rsplit(".", 1)[-1] in self.log.read_text()
        if result != "exit 2" or not named or out.exists():
            self.fail("objectives:meaning", argv, f"not refused naming the option, without output ({result})")

    def forward(self, line: Line) -> None:
        """`values` with an option of how the forward runs (or the saved objective repeated): exit 0, every row's
        values there, a bce critic's in [0, 1]."""
        source, _ = self.source_of(line)
        option, out = self.rng.choice([*FORWARD_OPTIONS, f"critic.vf_loss_type={line.objective}"]), self.fresh_out()
        argv = self.values_argv(source, out, option)
        result = self.command("objectives:forward", argv)
        rows = value_rows(out)
        if result != "exit 0" or rows is None or (line.objective == "bce" and not all(0 <= v <= 1 for v in rows[0])):
            self.fail("objectives:forward", argv, f"no values, or a bce value outside [0, 1] ({result}: {rows})")
        out.unlink(missing_ok=True)

    def unnamed(self, line: Line) -> None:
        """An export whose config.json lost its objective: `values` refuses it naming config.json (no output),
        unless the command line says `critic.vf_loss_type`."""
        export, copy = self.export_of(line), self.root / f"{line.path.name}-unnamed"
        if export and not copy.exists():
            shutil.copytree(export, copy)
            config = json.loads((copy / "config.json").read_text(encoding="utf-8"))
            del config[EXPORTED_OBJECTIVE]
            (copy / "config.json").write_text(json.dumps(config), encoding="utf-8")
        if not copy.exists():
            return  # no export to copy: export_of said why
        given = self.dealt("unnamed", [False, True])
        out = self.fresh_out()
        argv = self.values_argv(copy, out, *[f"critic.vf_loss_type={line.objective}"] * given)
        result = self.command(f"objectives:unnamed{'+given' * given}", argv)
        if given and (result != "exit 0" or value_rows(out) is None):
            self.fail("objectives:unnamed", argv, "an objective given on the command line was not taken")
        elif not given and (result != "exit 2" or "config.json" not in self.log.read_text() or out.exists()):
            self.fail("objectives:unnamed", argv, "an export naming no objective was not refused naming config.json")
        out.unlink(missing_ok=True)

    def bce_scale(self) -> None:
        """bce on the scale task (rewards outside [0, 1]): exit 2 before any step; the same run directory then
        starts with mse (a run that never trained a step takes new options)."""
        where = self.root / "bce-scale"
        argv = train_of(where, 1, "task.name=scale", "critic.value_norm=off")
        if self.command("objectives:bce-scale", [*argv, "critic.vf_loss_type=bce"], own=where) != "exit 2":
            self.fail("objectives:bce-scale", argv, "bce on rewards outside [0, 1] was not refused")
        result = self.command("objectives:then-mse", [*argv, "critic.vf_loss_type=mse"], own=where)
        if result != "exit 0" or latest_checkpoint(where / "checkpoints") is None:
            self.fail("objectives:then-mse", argv, "the refused run's directory did not take mse")
        remove(where)  # the soak's room; a new one next time

    def full_export(self) -> None:
        """`export` (new path or an existing export, with and without --force) or `values` on a disk filled to a
        few bytes or kilobytes of room."""
        values = self.rng.random() < 0.35
        target = self.root / f"full-{self.rng.randint(0, 1)}{'.jsonl' if values else ''}"
        self.new_or_existing("full-export", target, values)
        rooms = [0, self.rng.randint(1, 8192), self.rng.randint(8192, 150_000), self.rng.randint(150_000, 400_000)]
        with self.filled(self.rng.choice(rooms)):  # an export takes ~100 kB: it fits in the last
            self.replace_output("full-export", target, values)

    def long_names(self) -> None:
        """`export` or `values` to a new name of 200-255 bytes, with nothing or an output there first (so that
        --force replaces one)."""
        values = self.rng.random() < 0.35
        target = self.root / long_name(self.rng, ".jsonl" if values else "")
        self.new_or_existing("long-names", target, values)
        self.replace_output("long-names", target, values)
        remove(target)  # checked: the soak's room back

    def new_or_existing(self, kind: str, target: Path, values: bool) -> None:
        """Nothing at `target` (a new path) or, as often, an output written there first (on a disk with room)."""
        if self.rng.random() < 0.5:
            remove(target)
        elif not target.exists():
            self.command(f"{kind}:first", self.output_argv(target, values))

    def output_argv(self, target: Path, values: bool) -> list[str]:
        """`values` or `export` of the second run to `target`."""
        return self.values_argv(self.other, target) if values else ["export", str(self.other), str(target)]

    def replace_output(self, kind: str, target: Path, values: bool) -> None:
        """`values` or `export` of the second run to `target`, with or without --force: exit 0 with the output
        whole (and a previous export moved aside whole as `<name>.old-<time>`), or exit 2 with one error line naming
        a file and the old output as it was; never "File name too long"."""
        force = self.rng.random() < 0.5
        argv = self.output_argv(target, values) + ["--force"] * force
        before, names = content(target), set(os.listdir(self.root))
        result = self.command(f"{kind}:{'values' if values else 'export'}{'+force' * force}", argv)
        aside = [self.root / n for n in set(os.listdir(self.root)) - names if ".old-" in n]
        for problem in self.output_problems(result, target, before, aside, force, values):
            self.fail(kind, argv, problem)
        for path in aside:
            remove(path)  # checked: the soak's room back

    def output_problems(
        self, result: str, target: Path, before: dict | None, aside: list[Path], force: bool, values: bool
    ) -> list[str]:
        """What an `export` / `values` to `target` broke of its promise, given what was there `before`."""
        text = self.log.read_text(errors="replace")
        errors = [line for line in text.splitlines() if ": error: " in line]
        problems = ["an OSError 'File name too long' escaped"] * ("File name too long" in text)
        if result == "exit 0":
            whole = value_rows(target) is not None if values else export_whole(target)
            problems += ["exit 0 but the output is not whole"] * (not whole)
            problems += ["an existing output replaced without --force"] * (before is not None and not force)
            moved = [content(p) for p in aside]
            expected = [before] if before is not None and not values else []
            problems += [f"the previous output not moved aside whole ({len(aside)} aside)"] * (moved != expected)
        elif result == "exit 2":
            one = len(errors) == 1 and str(self.root) in errors[0] and "Traceback" not in text
            problems += ["exit 2 without one error line naming a file"] * (not one)
            problems += ["exit 2 but the output is not as it was"] * (content(target) != before)
            problems += [f"exit 2 but {len(aside)} moved aside"] * bool(aside)
        return problems

    def step(self, kind: str) -> None:
        self.drawn[kind] += 1
        out = self.root / f"out-{self.rng.randint(0, 3)}"
        if kind == "resume":
            self.steps += self.rng.randint(0, 3)
            self.command(kind, self.train_argv(), own=self.run)
        elif kind == "changed":
            self.steps += 1
            lr = self.rng.choice(["0.001", "0.002", "0.0005"])
            self.command(kind, self.train_argv(f"critic.optim.lr={lr}"), own=self.run)
        elif kind == "refused":
            self.command(kind, self.train_argv("critic.loss_agg_mode=seq-mean-token-mean"), own=self.run)
        elif kind in ("never", "overwrite"):
            extra = ["trainer.resume=never"] + (["--overwrite"] if kind == "overwrite" else [])
            if kind == "overwrite":
                self.steps = 2
            self.command(kind, self.train_argv(*extra), own=self.run)
        elif kind == "export":
            target = self.rng.choice([out, self.run, self.run / "checkpoints", self.root])
            self.command(kind, ["export", str(self.run), str(target), *self.rng.choice([[], ["--force"]])])
        elif kind == "values":
            target = self.rng.choice([out.with_suffix(".jsonl"), self.data, self.run / "v.jsonl"])
            layout = f"critic.model.use_remove_padding={self.rng.choice(['true', 'false'])}"
            argv = ["values", str(self.run), f"data={self.data}", f"out={target}", layout]
            force = target != self.data and self.rng.random() < 0.5  # a forced write over the input is wanted
            self.command(kind, argv + ["--force"] * force)
        elif kind.startswith("sig"):
            self.steps += self.rng.randint(2, 6)
            sig = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigint": signal.SIGINT}[kind]
            self.killed(kind, sig, self.train_argv())
        elif kind == "second-writer":
            self.second_writer()
        elif kind in CROSS:
            self.cross(kind)
        elif kind in ("same-values", "same-export"):
            self.same_target(kind)
        elif kind == "kill-in-save":
            self.kill_in_save()
        elif kind == "other-resume":
            self.other_steps += self.rng.randint(0, 2)
            self.command(kind, self.other_argv(), own=self.other)
        elif kind in ("replay", "drift"):
            names = [name for name in self.lines if name.startswith(kind)]
            self.line_kind(kind, self.lines[self.rng.choice(names)])
        elif kind == "objectives":
            self.objectives()
        elif kind == "full-export":
            self.full_export()
        elif kind == "long-names":
            self.long_names()
        else:
            self.full_disk()
        self.check(kind)

    def check(self, kind: str) -> None:
        """Every complete checkpoint verifies; config.yaml parses; the input file is intact; no temporary is left
        outside a run directory."""
        import yaml

        for run in self.runs():
            for checkpoint in complete_checkpoints(run / "checkpoints"):
                try:
                    verify_checkpoint(checkpoint)
                except ValueError as err:
                    self.violations.append(str(err))
            if (run / "config.yaml").exists():
                try:
                    yaml.safe_load((run / "config.yaml").read_text())
                except yaml.YAMLError as err:
                    self.violations.append(f"{run.name}/config.yaml does not parse: {err}")
        if json.loads(self.data.read_text()) != ROW:
            self.violations.append("the rollout file changed")
        left = [path for path in temporaries(self.root) if path not in self.seen]
        if left:
            self.seen.update(left)
            self.violations.append(f"temporaries left after a {kind} command: {left}")

    def final(self, argv: list[str], run: Path) -> int:
        """Resume `run` to its last step: metrics.jsonl must hold exactly the steps of its final checkpoint."""
        self.command(f"final-{run.name}", argv, own=run)
        newest = latest_checkpoint(run / "checkpoints")
        rows = read_metrics(run / "metrics.jsonl")
        final = int(newest.name.split("_")[1]) if newest else 0
        if [r["step"] for r in rows] != list(range(1, final + 1)):
            self.violations.append(f"{run.name}/metrics.jsonl steps {[r['step'] for r in rows]} != 1..{final}")
        leftovers = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
        if leftovers:
            self.violations.append(f"temporaries left in {run.name}/checkpoints/ after the final train: {leftovers}")
        return final

    def finish(self) -> dict:
        """Resume the run, and every new kind's, to its last step; then the invariants once more."""
        final = self.final(self.train_argv(), self.run)
        lines = {name: self.final(self.line_argv(line), line.path) for name, line in self.lines.items()}
        self.check("final")
        checkpoints = [p.name for p in complete_checkpoints(self.run / "checkpoints")]
        return {"final_step": final, "checkpoints": checkpoints, "new_kind_runs": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", default="64m", help="the size of the tmpfs the run lives on")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = args.out.resolve() if args.out else None  # before the chdir onto the soak's disk
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "disk"
        root.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.size}", "tmpfs", str(root)], check=True)
        try:
            soak = Soak(root, args.seed)
            os.chdir(root)  # `""` and `.` targets mean the disk holding both runs, never the caller's directory
            start = time.perf_counter()
            soak.command("other-resume", soak.other_argv(), own=soak.other)  # the second run, for cross-run commands
            soak.start_lines()
            for i, kind in enumerate(deck(soak.rng, args.commands)):
                soak.step(kind)
                if (i + 1) % 20 == 0:
                    print(f"{i + 1} commands, {len(soak.violations)} violations", flush=True)
            summary = soak.finish()
            elapsed = time.perf_counter() - start
        finally:
            os.chdir(tmp)
            subprocess.run(["umount", "--lazy", str(root)], check=True)
    result = {
        "commands": args.commands,
        "cross_run_commands": sum(n for (kind, _), n in soak.outcomes.items() if kind in CROSS),
        "seed": args.seed,
        "seconds": round(elapsed, 1),
        "kinds": dict(sorted(soak.drawn.items())),
        "outcomes": {f"{k} -> {v}": n for (k, v), n in sorted(soak.outcomes.items())},
        "violations": soak.violations,
        **summary,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        write_file(out, text + "\n")
    sys.exit(1 if soak.violations else 0)


if __name__ == "__main__":
    main()
