"""Megatron (TP=1/PP=1) vs the data-parallel packed critic: `ppo-critic bench paths=packed,megatron`, runnable on
CPU too — there megatron-core's CUDA assumptions are redirected by the test-only helper tests/megatron_cpu.py
(which the library never imports).

    python bench/megatron_vs_dp.py layers=2 hidden=128 batch=8 prompt=64 response=128 repeats=5
    python bench/megatron_vs_dp.py device=cuda      # the Qwen2.5-0.5B shape in bf16 (any `ppo-critic bench` option)
"""

from __future__ import annotations

import sys
from pathlib import Path

from ppo_critic.parallel.mesh import resolve_device
from ppo_critic.throughput import BenchConfig, main

if __name__ == "__main__":
    options = ["paths=packed,megatron", *sys.argv[1:]]
    device = dict(o.split("=", 1) for o in options if "=" in o).get("device", BenchConfig.device)
    if resolve_device(device).type == "cpu":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from megatron_cpu import redirect_cuda_to_cpu

        redirect_cuda_to_cpu()
    main(options)
