"""The helpers of bench/gpu/run.sh and bench/gpu/fetch_wheels.sh: the wheel list (wheels.txt) and what is missing from
.whl/, the carry budget, the import-only ray wheel, each step's time box and estimated cost (`STEPS`), and the key
numbers of each row of the run's table.

Standard library only: it runs on the GPU box before anything is installed, and here before any venv exists.
  python3 bench/gpu/harness.py list                     # group, requirement, how: one wheel a line
  python3 bench/gpu/harness.py missing .whl [--group G]  # the wheels not in .whl/<group>/ (exit 0 either way)
  python3 bench/gpu/harness.py skip-reason .whl GROUP    # 'skipped: ... not carried (...)', or nothing if complete
  python3 bench/gpu/harness.py slim .whl                 # repack the import-only wheels (ray: no cluster daemons)
  python3 bench/gpu/harness.py budget .whl               # sizes; leaves out the groups over the carry limit
  python3 bench/gpu/harness.py dist-info TARGET          # ppo-critic's entry points, for code run from src/
  python3 bench/gpu/harness.py plan                     # each step's estimated cost beside its time box
  python3 bench/gpu/harness.py boxes                    # the time boxes, as shell assignments for run.sh
  python3 bench/gpu/harness.py row tests|train|bench|compile|verl FILE  # the key numbers of a step's table row
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WHEELS = HERE / "wheels.txt"
LEFT_OUT = "left_out.txt"
CARRY_LIMIT_MIB = 64.0  # the device call's limit on everything that travels: working tree + carried paths
MARGIN_MIB = 2.0  # room for files the working tree gains between the fetch and the call (logs, new tests)
HOWS = ("wheel", "sdist", "import-only")
# what `import ray` in one process never touches: the Java workers' jar and the cluster's daemons (started by
# ray.init), and the dashboard's JavaScript source maps; 53 of the wheel's 76 MiB
SLIM_PREFIXES = ("ray/jars/",)
SLIM_FILES = ("ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet")
SLIM_SUFFIXES = (".js.map",)
UPDATE_TARGET, VALUES_TARGET = 150_000, 500_000  # issue 29's targets, valid tokens/s (physical limit ~370k / 1.1M)
RUN_LIMIT_S = 480  # the whole run, under 8 minutes: the device time of a session is 15 minutes, start included
KILL_GRACE_S = 5  # what a step past its box may add: `timeout -k 5` kills it 5 s after the SIGINT
SCRIPT_S = 5  # run.sh's own work around the boxes: its harness calls between steps, the table
BOX_MARGIN = 1.25  # each box holds its step's estimate with this much to spare


@dataclass(frozen=True)
class Cost:
    """A piece of a step's work on the H200 box (16 CPU cores): `count` times `each` seconds; `per` names what
    `count` counts in the step's command line (path, round, profile, step, test), where it follows from it."""

    what: str
    each: float
    count: int = 1
    per: str = ""


@dataclass(frozen=True)
class Step:
    """A step of bench/gpu/run.sh: its time box (seconds), what it does, and its estimated cost."""

    box: int
    does: str
    costs: tuple[Cost, ...]

    @property
    def estimate(self) -> float:
        return sum(c.each * c.count for c in self.costs)

    def counted(self, per: str) -> int:
        return sum(c.count for c in self.costs if c.per == per)


# Qwen2.5-0.5B in the bench: 358M non-embedding parameters, 32 rollouts of 512 + 1024 padded tokens at ~50 % fill
# (49k tokens padded, ~25k valid); an update is ~2.5 GFLOP a padded token (forward + backward, attention included),
# ~1.2e14 FLOPs padded: ~0.35 s at a third of the H200's ~990 TFLOP/s bf16, ~0.1 s for compute_values, half that
# packed. torch.compile cold: no inductor or Triton cache on a fresh box; three graphs per model (the inference
# forward, the training forward and backward), Triton kernels built on 16 workers.
STEPS = {
    "env": Step(
        30,
        "nvidia-smi, the carried wheels installed, versions probed",
        (
            Cost("nvidia-smi", 1),
            Cost("pip install --no-deps of the main and megatron wheels (~4 MiB)", 6),
            Cost("probe: import torch, transformers, triton, tensordict, megatron.core", 9),
        ),
    ),
    "tests": Step(
        135,
        "every @pytest.mark.cuda test, in the files that hold one (found at run time)",
        (
            Cost("pytest start, collecting those ~12 files (imports torch, transformers, hypothesis)", 8),
            Cost("CUDA context and cuBLAS, at the first CUDA test", 4),
            Cost("cold torch.compile of the tiny packed layers (test_compile)", 30, 1, "test"),
            Cost(
                "torchrun: megatron TP=1/PP=1 against the data-parallel critic (start, imports, NCCL, run)",
                25,
                1,
                "test",
            ),
            Cost(
                "any other CUDA test (room for 26): tiny models, one-rank NCCL groups, dynamo traces", 1.5, 26, "test"
            ),
        ),
    ),
    "train": Step(
        30,
        "ppo-critic train, 50 steps on CUDA (the tiny default model, counting task)",
        (
            Cost("start: imports, CUDA context, the worker built", 8),
            Cost("step: 192 rollouts, compute_values, GAE, update_critic (2 mini-batches)", 0.2, 50, "step"),
            Cost("evaluation on 512 rollouts, every 10 steps", 0.6, 5),
            Cost("checkpoint at the last step (DCP, hashed)", 1),
        ),
    ),
    "bench": Step(
        115,
        "ppo-critic bench at the Qwen2.5-0.5B shape: padded, packed, +dyn, +fused, +bf16p, megatron, all resident; "
        "profiled",
        (
            Cost("start: imports torch, transformers", 6),
            Cost("building a 0.5B path: 494M parameters initialised, moved to the GPU, optimizer", 6, 5, "path"),
            Cost("building the megatron path: megatron-core, HF -> megatron weights, DDP, optimizer", 15, 1, "path"),
            Cost("first calls of the warm-up round: cuBLAS, kernels loaded, the allocator growing", 5),
            Cost("round: every path's compute_values and update_critic (~0.5 s padded, ~0.3 s packed)", 3, 4, "round"),
            Cost("profiling one update of a path: CUPTI, the trace, its operator table", 4, 6, "profile"),
        ),
    ),
    "compile": Step(
        90,
        "ppo-critic bench of packed+dyn+fused+compile at the same shape: the cold compile in a box of its own",
        (
            Cost("start: imports torch, transformers", 6),
            Cost("building the 0.5B path", 6, 1, "path"),
            Cost("cold torch.compile of the 0.5B decoder layer: inference, training forward and backward", 45),
            Cost("round: the compiled path's compute_values and update_critic", 0.5, 4, "round"),
            Cost("profiling one update", 5, 1, "profile"),
        ),
    ),
    "verl": Step(
        60,
        "the verl 0.9.1 engine suite's CUDA tests (tests/with_verl/engine -m cuda)",
        (
            Cost("pip install --no-deps of the 35 verl wheels (~35 MiB; ray import-only)", 18),
            Cost("pytest start, collecting the suite (imports verl, ray, datasets, transformers 5.10)", 12),
            Cost("CUDA context and cuBLAS", 4),
            Cost("a CUDA test: one process, a tiny model through verl's TrainingWorker", 4, 3, "test"),
        ),
    ),
}


def deadline() -> int:
    """The seconds into the run by which every box has ended: the sum of the boxes."""
    return sum(step.box for step in STEPS.values())


def boxes_shell() -> str:
    """The boxes as shell assignments for run.sh: T_ENV=30 ... DEADLINE=..."""
    boxes = " ".join(f"T_{name.upper()}={step.box}" for name, step in STEPS.items())
    return f"{boxes} DEADLINE={deadline()} KILL_GRACE={KILL_GRACE_S}"


def plan_lines() -> list[str]:
    """Each step's estimated cost on the H200 beside its time box, and what the run may take at most."""
    lines = ["== the plan: estimated seconds on the H200 beside each step's time box", "step     estimate   box  does"]
    lines += [f"{name:8} {step.estimate:8.0f} {step.box:5d}  {step.does}" for name, step in STEPS.items()]
    most = deadline() + KILL_GRACE_S + SCRIPT_S
    estimate = sum(step.estimate for step in STEPS.values())
    lines.append(
        f"{'total':8} {estimate:8.0f} {deadline():5d}  at most {most} s with a step killed past its box "
        f"({KILL_GRACE_S} s) and the script's own work ({SCRIPT_S} s), of {RUN_LIMIT_S}"
    )
    return lines


@dataclass(frozen=True)
class Wheel:
    """One line of wheels.txt."""

    group: str
    name: str
    version: str
    how: str = "wheel"

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def stem(self) -> str:
        """The start of its file name: the name normalised as wheel file names spell it (PEP 427), the version."""
        return f"{re.sub(r'[-_.]+', '_', self.name).lower()}-{self.version}-"


def read_list(path: Path = WHEELS) -> list[Wheel]:
    """The wheels of wheels.txt in order; a malformed line is an error naming it."""
    wheels = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) not in (2, 3) or fields[1].count("==") != 1 or (len(fields) == 3 and fields[2] not in HOWS):
            raise ValueError(f"{path}:{number}: expected 'group name==version [{'|'.join(HOWS)}]', got {line!r}")
        name, version = fields[1].split("==")
        wheels.append(Wheel(fields[0], name, version, *fields[2:]))
    return wheels


def groups(wheels: list[Wheel]) -> list[str]:
    """The groups in the order they first appear (the order they are carried in while they fit)."""
    return list(dict.fromkeys(w.group for w in wheels))


def wheel_file(folder: Path, wheel: Wheel) -> Path | None:
    """The file of `wheel` in folder/<group>/, if fetched."""
    for path in sorted((folder / wheel.group).glob("*.whl")):
        if path.name.lower().startswith(wheel.stem):
            return path
    return None


def missing(wheels: list[Wheel], folder: Path) -> list[Wheel]:
    return [w for w in wheels if wheel_file(folder, w) is None]


def prune(wheels: list[Wheel], folder: Path) -> list[Path]:
    """Delete the wheels in `folder` that the list no longer names (another version would be installed beside the
    listed one, and two versions of a package stop the whole install); the paths deleted."""
    listed = {wheel_file(folder, w) for w in wheels}
    stale = [p for p in sorted(folder.glob("*.whl")) + sorted(folder.glob("*/*.whl")) if p not in listed]
    for path in stale:
        path.unlink()
    return stale


def left_out(folder: Path) -> dict[str, str]:
    """Group -> why fetch_wheels.sh left it out (its .whl/left_out.txt)."""
    path = folder / LEFT_OUT
    lines = path.read_text().splitlines() if path.is_file() else []
    return dict(line.split("\t", 1) for line in lines if "\t" in line)


def skip_reason(wheels: list[Wheel], folder: Path, group: str) -> str:
    """Why a step needing `group` cannot run ('' when every wheel of the group is in `folder`)."""
    absent = missing([w for w in wheels if w.group == group], folder)
    if not absent:
        return ""
    first = f"{absent[0].name}-{absent[0].version}" + (f" (+{len(absent) - 1} more)" if len(absent) > 1 else "")
    why = left_out(folder).get(group) or f"not in {folder}/{group}/: run bash bench/gpu/fetch_wheels.sh here"
    return f"skipped: {first} not carried ({why})"


def slim(path: Path) -> tuple[int, int]:
    """Rewrite ray's wheel without SLIM_* files (and their RECORD lines); its sizes before and after. Idempotent."""

    def dropped(name: str) -> bool:
        return name.startswith(SLIM_PREFIXES) or name in SLIM_FILES or name.endswith(SLIM_SUFFIXES)

    before = path.stat().st_size
    with zipfile.ZipFile(path) as src:
        if not any(dropped(name) for name in src.namelist()):
            return before, before  # repacked already
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if dropped(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not dropped(line.split(",", 1)[0])]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(info, data, zipfile.ZIP_DEFLATED)
    os.replace(tmp, path)
    return before, path.stat().st_size


def mib(size: float) -> float:
    return size / 2**20


def tree_size(root: Path = ROOT, untracked: bool = True) -> tuple[int, list[tuple[str, int]]]:
    """Bytes of the working tree that travels (tracked and, with `untracked`, untracked-not-ignored files), and its
    largest top-level entries; (0, []) outside a git checkout."""
    command = ["git", "ls-files", "-z", "--cached", *(["--others", "--exclude-standard"] if untracked else [])]
    try:
        listed = subprocess.run(command, cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0, []
    tops: dict[str, int] = {}
    for name in filter(None, listed.decode().split("\0")):
        path = root / name
        if path.is_file() and not path.is_symlink():
            top = name.split("/", 1)[0]
            tops[top] = tops.get(top, 0) + path.stat().st_size
    return sum(tops.values()), sorted(tops.items(), key=lambda kv: -kv[1])[:3]


def budget(wheels: list[Wheel], folder: Path, tree_bytes: int, limit_mib: float = CARRY_LIMIT_MIB) -> list[str]:
    """Leave out (delete the fetched wheels of) each group that no longer fits under the limit, in the list's order,
    and record why in left_out.txt; the report lines."""
    room = limit_mib - MARGIN_MIB - mib(tree_bytes)
    lines, reasons, used = [], {}, 0.0
    for group in groups(wheels):
        files = [p for w in wheels if w.group == group and (p := wheel_file(folder, w))]
        size = mib(sum(p.stat().st_size for p in files))
        lines += [f"    {mib(p.stat().st_size):7.2f} MiB  {p.name}" for p in files]
        if used + size <= room:
            used += size
            lines.append(f"  {group:10} {size:7.1f} MiB  carried")
            continue
        why = (
            f"size: the {group} wheels are {size:.1f} MiB, and {used:.1f} MiB of wheels + {mib(tree_bytes):.1f} MiB "
            f"of working tree already travel under the {limit_mib:.0f} MiB carry limit"
        )
        reasons[group] = why
        for path in files:
            path.unlink()
        lines.append(f"  {group:10} {size:7.1f} MiB  LEFT OUT ({why})")
    (folder / LEFT_OUT).write_text("".join(f"{g}\t{r}\n" for g, r in reasons.items()))
    lines.append(f"  total      {used:7.1f} MiB of wheels carried; working tree {mib(tree_bytes):.1f} MiB")
    return lines


def write_dist_info(target: Path, pyproject: Path = ROOT / "pyproject.toml") -> Path:
    """ppo-critic's metadata and entry points in `target` (the code itself comes from src/ on PYTHONPATH): verl finds
    its plugin by the `verl.plugins` entry point, which a bare PYTHONPATH does not provide."""
    import tomllib  # Python >= 3.11: here and on the box

    project = tomllib.loads(pyproject.read_text())["project"]
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    info = target / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    entries = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in e.items()) + "\n" for g, e in groups.items())
    (info / "entry_points.txt").write_text(entries)
    (info / "INSTALLER").write_text("bench/gpu/run.sh\n")
    return info


def pytest_counts(log: Path) -> dict[str, int]:
    """The counts of pytest's last summary line in `log` (also after an interrupt): passed, failed, skipped, ..."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    summaries = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error|deselected)", line)]
    if not summaries:
        return {}
    found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", summaries[-1])
    return {("error" if kind.startswith("error") else kind): int(n) for n, kind in found}


def tests_row(log: Path) -> str:
    counts = pytest_counts(log)
    if not counts:
        return "no pytest summary (see the log)"
    shown = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "skipped"))
    return shown + (f", {counts['error']} errors" if counts.get("error") else "")


def train_row(metrics: Path) -> str:
    """The final eval/ev_true, steps/s and the median tokens/s of update_critic in a run's metrics.jsonl."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    if not rows:
        return f"no metrics ({metrics.name} missing or empty)"
    evals = [r["eval/ev_true"] for r in rows if "eval/ev_true" in r]
    last = rows[-1]
    speed = [r["perf/tokens_per_s"] for r in rows if "perf/tokens_per_s" in r]
    parts = [f"step {last.get('step')}", f"ev_true {evals[-1]:.3f}" if evals else "no ev_true"]
    if last.get("elapsed_s"):
        parts.append(f"{last['step'] / last['elapsed_s']:.1f} steps/s")
    if speed:
        parts.append(f"update {statistics.median(speed) / 1e3:.1f}k tok/s")
    return ", ".join(parts)


def bench_row(path: Path, baseline: Path | None = None) -> str:
    """Update and compute_values valid tokens/s of the best path and of the padded baseline, against the targets;
    the baseline from `baseline` (the bench step's JSON: the same rollouts and weights) when `path` has none."""
    if not path.is_file():
        return f"no {path.name}"
    summary = json.loads(path.read_text())
    median, errors = summary.get("median", {}), summary.get("errors", {})
    padded = median.get("padded") or _padded(baseline)
    parts = []
    targets = (("update_critic", "update", UPDATE_TARGET), ("compute_values", "values", VALUES_TARGET))
    for call, short, target in targets:
        if not median:
            break
        best = max(median, key=lambda p, c=call: median[p][c])
        padded_k = f"{padded[call] / 1e3:.0f}k" if padded else "-"
        parts.append(
            f"{short} best {median[best][call] / 1e3:.0f}k ({best}) vs padded {padded_k} (target >= {target // 1000}k)"
        )
    if summary.get("rounds") is not None and summary.get("rounds") != summary.get("config", {}).get("repeats"):
        parts.append(f"partial: {summary['rounds']} of {summary['config']['repeats']} rounds")
    if errors:
        parts.append("errors: " + ", ".join(errors) + f" ({path.name}, {path.stem}.log)")
    return "; ".join(parts) or "no path measured"


def _padded(path: Path | None) -> dict[str, float] | None:
    """The padded baseline's medians in a bench JSON, if it has them."""
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text()).get("median", {}).get("padded")


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list")
    for name in ("missing", "budget", "prune"):
        command = sub.add_parser(name)
        command.add_argument("folder", type=Path)
        command.add_argument("--group")
    skip = sub.add_parser("skip-reason")
    skip.add_argument("folder", type=Path)
    skip.add_argument("group")
    sub.add_parser("slim").add_argument("folder", type=Path)
    sub.add_parser("dist-info").add_argument("target", type=Path)
    sub.add_parser("plan")
    sub.add_parser("boxes")
    row = sub.add_parser("row")
    row.add_argument("step", choices=("tests", "train", "bench", "compile", "verl"))
    row.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    wheels = read_list()
    if args.command == "list":
        print("\n".join(f"{w.group} {w.requirement} {w.how}" for w in wheels))
    elif args.command == "missing":
        chosen = [w for w in wheels if args.group in (None, w.group)]
        for wheel in missing(chosen, args.folder):
            print(f"{wheel.group} {wheel.requirement} {wheel.how}")
    elif args.command == "prune":
        for path in prune(wheels, args.folder):
            print(f"removed {path} (not in {WHEELS.name})")
    elif args.command == "skip-reason":
        print(skip_reason(wheels, args.folder, args.group))
    elif args.command == "slim":
        for path in filter(None, (wheel_file(args.folder, w) for w in wheels if w.how == "import-only")):
            before, after = slim(path)
            if after != before:
                print(f"repacked {path.name} import-only: {mib(before):.1f} -> {mib(after):.1f} MiB")
    elif args.command == "dist-info":
        write_dist_info(args.target)
    elif args.command == "budget":
        size, tops = tree_size()
        if mib(size) > CARRY_LIMIT_MIB - MARGIN_MIB:  # the call fails whatever is carried: budget as if it were fixed
            largest = ", ".join(f"{name} {mib(n):.0f} MiB" for name, n in tops)
            print(
                f"WARNING: the working tree that would travel is {mib(size):.0f} MiB (largest: {largest}): a device "
                "call refuses over 64 MiB; ignore what does not belong (.gitignore or .git/info/exclude). The wheels "
                "are budgeted against the tracked files alone."
            )
            size, _ = tree_size(untracked=False)
        print("\n".join(budget(wheels, args.folder, size)))
    elif args.command == "plan":
        print("\n".join(plan_lines()))
    elif args.command == "boxes":
        print(boxes_shell())
    else:
        rows = {"tests": tests_row, "verl": tests_row, "train": train_row, "bench": bench_row}
        rows["compile"] = lambda path: bench_row(path, baseline=path.with_name("bench.json"))
        print(rows[args.step](args.file))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
