"""The examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs_and_prints_a_row_per_step():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "2", "--batch-size", "16"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].split()[:2] == ["step", "vf_loss"] and [line.split()[0] for line in lines[1:]] == ["1", "2"]
