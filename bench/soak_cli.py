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
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import torch

import ppo_critic.cli as cli
import ppo_critic.train  # noqa: F401  (warm: a forked command imports nothing, as the docstring promises)
from ppo_critic.run.checkpoint import complete_checkpoints, latest_checkpoint, verify_checkpoint
from ppo_critic.run.files import LOCK_FILE, write_file
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
}
CROSS = ("cross-export", "cross-values", "cross-train")
ROW = {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "reward": 1.0}


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
        self.log = root / "command.log"
        self.data = root / "rollouts.jsonl"
        self.data.write_text(json.dumps(ROW) + "\n")
        self.outcomes: collections.Counter = collections.Counter()
        self.violations: list[str] = []

    def train_argv(self, *extra: str) -> list[str]:
        return ["train", *RUN_ARGS, f"trainer.run_dir={self.run}", f"trainer.steps={self.steps}", *extra]

    def other_argv(self) -> list[str]:
        return ["train", *RUN_ARGS, f"trainer.run_dir={self.other}", f"trainer.steps={self.other_steps}"]

    def command(self, kind: str, argv: list[str], own: Path | None = None) -> str:
        """Run `argv`; it may write only into the run directory `own` (a `train`'s), every other stays as it was."""
        others = [r for r in (self.run, self.other) if r != own and r.exists()]
        before = {r: tree(r) for r in others}
        result = outcome(fork(argv, self.log))
        self.outcomes[(kind, result)] += 1
        if result not in ("exit 0", "exit 2"):
            self.violations.append(f"{kind} {argv[:1]} ended with {result}: {self.log.read_text()[-1500:]}")
        for run, files in before.items():
            if tree(run) != files:
                self.violations.append(f"{kind} {argv} changed {run}: {self.log.read_text()[-500:]}")
        return result

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
            argv = ["train", *RUN_ARGS, f"trainer.run_dir={where}", "trainer.steps=2"]
            self.command(kind, argv, own=where if where.resolve() != self.root.resolve() else None)

    def killed(self, kind: str, sig: signal.Signals) -> None:
        self.steps += self.rng.randint(2, 6)
        pid = fork(self.train_argv(), self.log)
        time.sleep(self.rng.uniform(0.3, 4.0))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        result = outcome(pid)
        self.outcomes[(kind, result)] += 1
        if result not in ("exit 0", "exit 2", f"signal {int(sig)}"):
            self.violations.append(f"{kind} ended with {result}: {self.log.read_text()[-1500:]}")

    def second_writer(self) -> None:
        self.steps += 4
        first = fork(self.train_argv(), self.root / "first.log")
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
        pids = [fork(argv, self.root / f"{kind}-{n}.log") for n in range(2)]
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

    def full_disk(self) -> None:
        filler = self.root / "filler"
        free = os.statvfs(self.root).f_bavail * os.statvfs(self.root).f_frsize
        keep = self.rng.randint(50_000, 2_000_000)
        with open(filler, "wb") as f:
            f.truncate(0)
            f.write(b"\0" * max(0, free - keep))
        self.steps += self.rng.randint(1, 4)
        try:
            self.command("full-disk", self.train_argv(), own=self.run)
        finally:
            filler.unlink()

    def step(self) -> None:
        kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
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
            self.killed(kind, {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigint": signal.SIGINT}[kind])
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
        else:
            self.full_disk()
        self.check()

    def check(self) -> None:
        """Every complete checkpoint verifies; config.yaml parses; the input file is intact."""
        import yaml

        for checkpoint in complete_checkpoints(self.run / "checkpoints"):
            try:
                verify_checkpoint(checkpoint)
            except ValueError as err:
                self.violations.append(str(err))
        if (self.run / "config.yaml").exists():
            try:
                yaml.safe_load((self.run / "config.yaml").read_text())
            except yaml.YAMLError as err:
                self.violations.append(f"config.yaml does not parse: {err}")
        if json.loads(self.data.read_text()) != ROW:
            self.violations.append("the rollout file changed")

    def finish(self) -> dict:
        """Resume the run to its last step: metrics.jsonl must hold exactly the steps of the final checkpoint."""
        self.command("final", self.train_argv(), own=self.run)
        newest = latest_checkpoint(self.run / "checkpoints")
        rows = read_metrics(self.run / "metrics.jsonl")
        final = int(newest.name.split("_")[1]) if newest else 0
        if [r["step"] for r in rows] != list(range(1, final + 1)):
            self.violations.append(f"metrics.jsonl steps {[r['step'] for r in rows]} != 1..{final}")
        self.check()
        leftovers = [p.name for p in (self.run / "checkpoints").iterdir() if p.name.startswith(".")]
        if leftovers:
            self.violations.append(f"temporaries left in checkpoints/ after the final train: {leftovers}")
        return {"final_step": final, "checkpoints": [p.name for p in complete_checkpoints(self.run / "checkpoints")]}


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
            for i in range(args.commands):
                soak.step()
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
