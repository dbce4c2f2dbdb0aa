"""The helpers of bench/gpu/run.sh and bench/gpu/fetch_wheels.sh: the wheel list (wheels.txt) and what is missing from
.whl/, the carry budget, the import-only ray wheel, and the key numbers of each row of the run's table.

Standard library only: it runs on the GPU box before anything is installed, and here before any venv exists.
  python3 bench/gpu/harness.py list                     # group, requirement, how: one wheel a line
  python3 bench/gpu/harness.py missing .whl [--group G]  # the wheels not in .whl/<group>/ (exit 0 either way)
  python3 bench/gpu/harness.py skip-reason .whl GROUP    # 'skipped: ... not carried (...)', or nothing if complete
  python3 bench/gpu/harness.py slim .whl                 # repack the import-only wheels (ray: no cluster daemons)
  python3 bench/gpu/harness.py budget .whl               # sizes; leaves out the groups over the carry limit
  python3 bench/gpu/harness.py dist-info TARGET          # ppo-critic's entry points, for code run from src/
  python3 bench/gpu/harness.py row tests|train|bench|verl FILE  # the key numbers of a step's table row
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


def bench_row(path: Path) -> str:
    """Update and compute_values valid tokens/s of the best path and of the padded baseline, against the targets."""
    if not path.is_file():
        return f"no {path.name}"
    summary = json.loads(path.read_text())
    median, errors = summary.get("median", {}), summary.get("errors", {})
    parts = []
    targets = (("update_critic", "update", UPDATE_TARGET), ("compute_values", "values", VALUES_TARGET))
    for call, short, target in targets:
        if not median:
            break
        best = max(median, key=lambda p, c=call: median[p][c])
        padded = f"{median['padded'][call] / 1e3:.0f}k" if "padded" in median else "-"
        parts.append(
            f"{short} best {median[best][call] / 1e3:.0f}k ({best}) vs padded {padded} (target >= {target // 1000}k)"
        )
    if summary.get("rounds") is not None and summary.get("rounds") != summary.get("config", {}).get("repeats"):
        parts.append(f"partial: {summary['rounds']} of {summary['config']['repeats']} rounds")
    if errors:
        parts.append("errors: " + ", ".join(errors) + " (bench.json, bench.log)")
    return "; ".join(parts) or "no path measured"


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
    row = sub.add_parser("row")
    row.add_argument("step", choices=("tests", "train", "bench", "verl"))
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
    else:
        rows = {"tests": tests_row, "verl": tests_row, "train": train_row, "bench": bench_row}
        print(rows[args.step](args.file))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
