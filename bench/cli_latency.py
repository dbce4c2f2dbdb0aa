"""How long `ppo-critic` takes to answer without training: help, version and an option error, each a fresh process,
beside `python -c 'import torch'` for scale (these paths never import torch; tests/test_cli.py checks that).

    python bench/cli_latency.py                      # median of 7 runs each; JSON to bench/results/cli_latency.json
    python bench/cli_latency.py --runs 15 --out latency.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ppo_critic.run.files import write_file

SCRIPT = Path(sys.executable).parent / "ppo-critic"  # the installed console script, what users run
CLI = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "ppo_critic"]
COMMANDS = {
    "ppo-critic --help": [*CLI, "--help"],
    "ppo-critic train --help": [*CLI, "train", "--help"],
    "ppo-critic bench --help": [*CLI, "bench", "--help"],
    "ppo-critic --version": [*CLI, "--version"],
    "ppo-critic train critic.optim.lrr=1": [*CLI, "train", "critic.optim.lrr=1"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
}


def measure(argv: list[str], runs: int) -> dict[str, float | int]:
    """Wall seconds of `runs` fresh runs of `argv` (after one unmeasured run that warms the file cache)."""
    subprocess.run(argv, capture_output=True, check=False)
    times, code = [], 0
    for _ in range(runs):
        start = time.perf_counter()
        code = subprocess.run(argv, capture_output=True, check=False).returncode
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "exit_code": code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="measured runs per command (the median is reported)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cli_latency.json")
    args = parser.parse_args()
    results = {name: measure(argv, args.runs) for name, argv in COMMANDS.items()}
    width = max(map(len, results))
    print(f"{'command':<{width}}  median s  min s  max s  exit")
    for name, r in results.items():
        print(f"{name:<{width}}  {r['median_s']:8.3f}  {r['min_s']:5.3f}  {r['max_s']:5.3f}  {r['exit_code']:4d}")
    machine = {
        "python": platform.python_version(),
        "arch": platform.machine(),
        "cpus": os.cpu_count(),
        "runs": args.runs,
    }
    write_file(args.out, json.dumps({"machine": machine, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
