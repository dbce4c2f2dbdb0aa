"""The benchmark scripts stay runnable (tiny CPU sizes; speed itself is measured in bench/, not here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("script", "paths", "key", "ratio"),
    [
        ("packing.py", ("padded", "packed"), "median_tokens_per_s", "packed/padded"),
        ("megatron_vs_dp.py", ("dp", "megatron"), "median", "megatron/dp"),
    ],
)
def test_benchmarks_run_and_report_both_paths(tmp_path, script, paths, key, ratio):
    if script.startswith("megatron"):
        pytest.importorskip("megatron.core")
    out = tmp_path / "result.json"
    args = ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--vocab", "64", "--batch", "4"]
    args += ["--prompt", "8", "--response", "8", "--micro", "2", "--repeats", "1", "--out", str(out)]
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "update_critic" in result.stdout and ratio in result.stdout
    summary = json.loads(out.read_text())
    for path in paths:
        assert all(summary[key][path][k] > 0 for k in ("compute_values", "update_critic"))


def test_gpu_scripts_are_valid_bash():
    for script in (ROOT / "bench" / "gpu").glob("*.sh"):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, script


def test_ulysses_memory_benchmark_runs_single_process():
    args = ["--tokens", "64", "--layers", "1", "--hidden", "32", "--heads", "2"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ulysses_memory.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["sp"] == 1 and row["tokens"] == 64 and row["peak_activation_mib"] >= 0
