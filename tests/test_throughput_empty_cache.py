"""No path of `ppo-critic bench` empties the CUDA cache while the paths are measured: an emptied cache makes the next
measured call (the next round's padded baseline, after the megatron path) pay fresh cudaMallocs, and inflates every
"x padded" ratio. Run as a script, this file is the bench under a counting `torch.cuda.empty_cache` (megatron on the
CPU through tests/megatron_cpu.py), which prints what it counted as JSON."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
TINY = ["layers=1", "hidden=32", "heads=2", "kv_heads=1", "vocab=64", "batch=4", "prompt=8", "response=8", "micro=2"]


def counting_empty_cache(monkeypatch=None) -> collections.Counter:
    """Replace `torch.cuda.empty_cache` by a counter of its calls: "measuring" while a path is measured (the bench's
    `_measure`), "outside" otherwise."""
    from ppo_critic import throughput

    calls: collections.Counter = collections.Counter()
    stage = ["outside"]
    measure = throughput._measure

    def measured(*args, **kwargs):
        stage[0] = "measuring"
        try:
            return measure(*args, **kwargs)
        finally:
            stage[0] = "outside"

    patch = setattr if monkeypatch is None else monkeypatch.setattr
    patch(torch.cuda, "empty_cache", lambda: calls.update([stage[0]]))
    patch(throughput, "_measure", measured)
    return calls


def bench_with_megatron() -> dict:
    """The bench's rounds over padded and megatron under the counter; then the megatron critic's own release turned
    back on, under the same counter, so that a test can tell the counter sees it."""
    sys.path.insert(0, str(TESTS))
    from megatron_cpu import redirect_cuda_to_cpu

    redirect_cuda_to_cpu()
    from ppo_critic import throughput

    calls = counting_empty_cache()
    built = []
    make = throughput.make_worker
    throughput.make_worker = lambda cfg, path: built.append(make(cfg, path)) or built[-1]
    summary = throughput.run(throughput.parse_options(["paths=padded,megatron", "repeats=2", "device=cpu", *TINY]))
    during = dict(calls)
    megatron = built[-1]
    megatron.critic.release_cache = True
    batch = throughput.rollouts(4, 8, 8, 0.6, 64, 0)
    megatron.compute_values(batch)
    megatron.update_critic(batch)
    return {"during_bench": during, "after_release_on": dict(calls), "median": summary["median"]}


def test_no_path_empties_the_cuda_cache_during_the_bench():
    """The megatron critic empties the cache after every call, as verl's does; the bench turns that off, and nothing
    else in it empties the cache: the rounds (warm-up, measured) and profiles of every path run on a warm cache."""
    pytest.importorskip("megatron.core")
    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert set(report["median"]) == {"padded", "megatron"}  # both paths were measured
    assert report["during_bench"] == {}
    # the counter is not blind: the megatron critic's release, once on, is seen after each call
    assert report["after_release_on"] == {"outside": 2}


def test_a_failing_path_leaves_the_cache_to_the_next(monkeypatch):
    """A path that fails in a measured round gives its tensors back (garbage-collected) without emptying the cache:
    the caching allocator hands them to the next path, and frees its cache itself before it would report an OOM."""
    from ppo_critic import throughput

    calls = counting_empty_cache(monkeypatch)
    errors: dict[str, str] = {}

    def failing():
        raise torch.OutOfMemoryError("CUDA out of memory")

    assert throughput._isolated("packed", "measuring", failing, errors) is None
    assert errors["packed"].startswith("error: OutOfMemoryError") and calls == {}


if __name__ == "__main__":
    print(json.dumps(bench_with_megatron()))
