"""The benchmark scripts stay runnable (tiny CPU sizes; speed itself is measured in bench/, not here)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


TINY = ["layers=1", "hidden=32", "heads=2", "kv_heads=1", "vocab=64", "batch=4", "prompt=8", "response=8", "micro=2"]


@pytest.mark.parametrize(
    ("command", "paths"),
    [
        ([sys.executable, "-m", "ppo_critic", "bench"], ("padded", "packed")),
        ([sys.executable, str(ROOT / "bench" / "megatron_vs_dp.py")], ("packed", "megatron")),
    ],
)
def test_bench_reports_every_path_against_the_padded_baseline(tmp_path, command, paths):
    if "megatron" in paths:
        pytest.importorskip("megatron.core")
    out = tmp_path / "result.json"
    result = subprocess.run([*command, *TINY, "repeats=1", f"out={out}"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert all(f"\n{path} " in result.stdout for path in paths), result.stdout
    summary = json.loads(out.read_text())
    assert tuple(summary["median"]) == paths and summary["valid_tokens"] > 0
    for path in paths:
        m = summary["median"][path]
        assert m["compute_values"] > 0 and m["update_critic"] > 0
        assert 0 < m["compute_values_mfu"] <= 1 and 0 < m["update_critic_mfu"] <= 1
    if "padded" in paths:
        assert summary["vs_padded"]["padded"] == {"compute_values": 1.0, "update_critic": 1.0}
        ratio = summary["median"]["packed"]["update_critic"] / summary["median"]["padded"]["update_critic"]
        assert summary["vs_padded"]["packed"]["update_critic"] == ratio  # the same float64 quotient; JSON keeps it
        header = next(line for line in result.stdout.splitlines() if line.startswith("path "))
        assert header.split()[-6:] == ["values", "x", "padded", "update", "x", "padded"]


def test_the_report_says_which_ratio_is_values_and_which_is_update():
    from ppo_critic.throughput import report

    config = {"dtype": "float32", "layers": 1, "hidden": 32, "batch": 4, "prompt": 8, "response": 8}
    row = {"compute_values_mfu": 0.1, "update_critic_mfu": 0.2, "peak_gb": 0.0}
    summary = {
        "device": "cpu",
        "torch": "2",
        "config": config,
        "fill": 0.5,
        "valid_tokens": 32,
        "median": {
            "padded": {"compute_values": 100.0, "update_critic": 50.0, **row},
            "packed": {"compute_values": 300.0, "update_critic": 75.0, **row},
        },
        "vs_padded": {
            "padded": {"compute_values": 1.0, "update_critic": 1.0},
            "packed": {"compute_values": 3.0, "update_critic": 1.5},
        },
    }
    lines = report(summary).splitlines()
    assert "values = compute_values, update = update_critic" in lines[1]
    header, padded, packed = lines[2:5]
    columns = ["values tok/s", "update tok/s", "values MFU", "update MFU", "peak GiB", "values x padded"]
    columns.append("update x padded")
    for row_line, cells in [
        (packed, ["300", "75", "0.100", "0.200", "0.00", "3.00x", "1.50x"]),
        (padded, ["100", "50", "0.100", "0.200", "0.00", "1.00x", "1.00x"]),
    ]:
        for name, cell in zip(columns, cells, strict=True):  # each number right-aligned under its own header
            end = header.index(name) + len(name)
            assert row_line[end - len(cell) : end] == cell and row_line[end - len(cell) - 1] == " ", (name, row_line)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["paths=padded,fast"], "paths='padded,fast'"),
        (["paths=packed+turbo"], "levers from ('dyn', 'fused', 'compile', 'bf16p')"),
        (["paths=packed+bf16p", "device=cpu"], "the bf16p lever stores the parameters in bf16, which compute in bf16"),
        (["paths=verl+fused"], "verl paths take dyn only"),
        (["batch=6", "micro=4"], "batch=6 must be a multiple of micro=4"),
        (["fill=0"], "fill=0"),
        (["repeat=2"], "did you mean 'repeats'"),
        (["layers"], "key=value"),
    ],
)
def test_bench_rejects_bad_options_by_name(options, message):
    from ppo_critic.throughput import main

    with pytest.raises(ValueError, match=re.escape(message)):
        main(options)


def test_verl_paths_without_verl_say_where_verl_is(monkeypatch):
    from importlib import metadata

    from ppo_critic.throughput import main

    def version(name):
        if name == "verl":
            raise metadata.PackageNotFoundError(name)
        return metadata.version(name)

    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(ValueError, match=re.escape("verl is not installed; run the bench in the environment")):
        main(["paths=padded,verl_packed+dyn"])
    monkeypatch.setattr(metadata, "version", lambda name: "0.9.1")
    with pytest.raises(ValueError, match=re.escape("verl 0.9.1 is installed")):
        main(["paths=verl"])


def test_the_report_gives_every_path_against_the_fastest_verl_path():
    from ppo_critic.throughput import report

    config = {"dtype": "float32", "layers": 1, "hidden": 32, "batch": 4, "prompt": 8, "response": 8}
    row = {"compute_values_mfu": 0.1, "update_critic_mfu": 0.2, "peak_gb": 0.0}
    median = {
        "packed+dyn": {"compute_values": 300.0, "update_critic": 80.0, **row},
        "verl": {"compute_values": 100.0, "update_critic": 50.0, **row},
        "verl_packed": {"compute_values": 150.0, "update_critic": 40.0, **row},
    }
    best = {"compute_values": 150.0, "update_critic": 50.0}
    vs_verl = {p: {k: m[k] / best[k] for k in best} for p, m in median.items()}
    summary = {"device": "cpu", "torch": "2", "config": config, "fill": 0.5, "valid_tokens": 32}
    lines = report(summary | {"median": median, "vs_padded": {}, "vs_verl": vs_verl}).splitlines()
    header, ours, verl = lines[2:5]
    for name, cell in [("values MFU", "0.100"), ("values x verl", "2.00x"), ("update x verl", "1.60x")]:
        end = header.index(name) + len(name)
        assert ours[end - len(cell) : end] == cell, (name, ours)
    end = header.index("values MFU") + len("values MFU")
    assert verl[end - 1] == "-" and verl.split()[-2:] == ["0.67x", "1.00x"]  # verl reports no FLOPs
    assert (
        lines[-1]
        == "ppo-critic's fastest / verl's fastest: compute_values 2.00x (packed+dyn), update_critic 1.60x (packed+dyn)"
    )


@pytest.mark.parametrize("fill", [0.2, 0.3, 0.5, 0.7, 0.9])
def test_rollouts_fill_their_widths_as_asked(fill):
    from ppo_critic.throughput import rollouts

    batch = rollouts(2048, 256, 256, fill, 64, 0)
    # lengths uniform on a range of mean fill·256: the sample mean's standard error is ≤ 256/sqrt(12·2048) ≈ 1.6
    # tokens (0.0063 of the width); 0.03 is > 4 of them plus the range's rounding (≤ 1/256); fills 0.3 and 0.5 once
    # gave the same rollouts
    assert abs(float(batch["attention_mask"].float().mean()) - fill) < 0.03
    assert torch.equal(batch["response_mask"], batch["attention_mask"][:, 256:])


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


def test_bench_levers_build_their_workers_and_profile_names_the_top_operators(tmp_path):
    from ppo_critic.models.compile import decoder_layers
    from ppo_critic.throughput import BenchConfig, main, make_worker, resolved

    cfg = resolved(BenchConfig(**{k: int(v) for k, v in (o.split("=") for o in TINY)}))
    assert cfg.budget == 2 * 2 * (8 + 8)  # default: twice the padded tokens of a micro-batch
    w = make_worker(cfg, "packed+dyn+fused+compile")
    assert w.critic.config.use_dynamic_bsz and w.critic.config.ppo_max_token_len_per_gpu == cfg.budget
    assert w.optimizer.defaults["fused"] is True and w.critic.use_remove_padding
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(w.model))

    out = tmp_path / "result.json"
    summary = main([*TINY, "paths=padded,packed+dyn+fused", "repeats=1", "profile=true", f"out={out}"])
    assert set(summary["profile"]) == {"padded", "packed+dyn+fused"}
    for ops in summary["profile"].values():
        assert ops and all(o["ms"] >= 0 and o["calls"] >= 1 for o in ops)
        # float64 shares e / total of the events' sum (hundreds of terms): over 1 by <= ~n·2**-53 ~ 1e-13, not 1e-9
        assert sum(o["share"] for o in ops) <= 1.0 + 1e-9
        assert [o["ms"] for o in ops] == sorted((o["ms"] for o in ops), reverse=True)
    assert json.loads(out.read_text())["profile"] == summary["profile"]


def test_the_bf16p_lever_builds_bf16_parameters_with_float32_master_weights():
    from ppo_critic.parallel.master_weights import MasterWeightOptimizer
    from ppo_critic.throughput import BenchConfig, make_worker, resolved

    cfg = resolved(BenchConfig(**{k: int(v) for k, v in (o.split("=") for o in TINY)}, device="cpu", dtype="bf16"))
    w = make_worker(cfg, "packed+bf16p")
    assert w.config.param_dtype == "bfloat16" and isinstance(w.optimizer, MasterWeightOptimizer)
    assert {p.dtype for p in w.model.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in w.optimizer.masters.values()} == {torch.float32}
    assert len(w.optimizer.masters) == len(list(w.model.parameters()))
    assert {p.dtype for p in make_worker(cfg, "packed").model.parameters()} == {torch.float32}


def test_a_path_that_cannot_build_is_an_error_row_and_the_others_are_measured(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("megatron builds on CUDA; this checks the row of a path that cannot build")
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "ppo_critic", "bench", *TINY, "paths=padded,megatron,packed", "repeats=1"]
    # a process of its own: megatron's build joins a process group before it finds no CUDA
    result = subprocess.run([*command, f"out={out}"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    error = summary["errors"]["megatron"]  # megatron needs CUDA (or megatron-core): it cannot build here
    assert error.startswith("error: ") and error.endswith("(while building)") and "\n" not in error
    assert list(summary["median"]) == ["padded", "packed"]
    for path in ("padded", "packed"):
        assert summary["median"][path]["update_critic"] > 0 and summary["median"][path]["compute_values"] > 0
    assert summary["vs_padded"]["packed"]["update_critic"] > 0
    rows = [line.split()[0] for line in result.stdout.splitlines()[3:]]
    assert rows == ["padded", "megatron", "packed"]  # in the order asked, the error in its place
    assert f"\nmegatron{' ' * 11}{error}\n" in result.stdout
    assert "path megatron failed while building" in result.stderr and "Traceback" in result.stderr


def test_a_baseline_failing_while_running_leaves_the_other_paths_and_says_there_is_no_ratio(monkeypatch, capsys):
    import ppo_critic.throughput as bench

    built = bench.make_worker

    def make_worker(cfg, path):
        worker = built(cfg, path)
        if path == "padded":

            def out_of_memory(batch):
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail on a second line")

            worker.update_critic = out_of_memory
        return worker

    monkeypatch.setattr(bench, "make_worker", make_worker)
    summary = bench.main([*TINY, "paths=padded,packed+dyn", "repeats=1"])
    assert summary["errors"] == {
        "padded": "error: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (while warming up)"
    }
    assert list(summary["median"]) == ["packed+dyn"] and summary["median"]["packed+dyn"]["update_critic"] > 0
    assert summary["vs_padded"] == {}
    lines = capsys.readouterr().out.splitlines()
    header, padded, packed = lines[2:5]
    assert padded.split(None, 1) == ["padded", summary["errors"]["padded"]]
    assert packed.split()[-4:] == ["no", "baseline", "no", "baseline"]
    assert header.index("update x padded") + len("update x padded") == len(packed)  # aligned under its header
    assert lines[5] == f"x padded: none, the padded baseline failed ({summary['errors']['padded']})"


def test_a_run_stopped_early_leaves_the_medians_of_the_rounds_it_finished(tmp_path, monkeypatch):
    import ppo_critic.throughput as bench

    built = bench.make_worker

    def make_worker(cfg, path):
        worker = built(cfg, path)
        calls = []
        values = worker.compute_values

        def compute_values(batch):
            calls.append(1)
            if len(calls) == 3:  # warm-up, round 1, then the time box's SIGINT in round 2
                raise KeyboardInterrupt
            return values(batch)

        worker.compute_values = compute_values
        return worker

    monkeypatch.setattr(bench, "make_worker", make_worker)
    out = tmp_path / "result.json"
    with pytest.raises(KeyboardInterrupt):  # an interrupt is not a path's failure: it stops the bench
        bench.main([*TINY, "paths=packed", "repeats=3", f"out={out}"])
    partial = json.loads(out.read_text())
    assert partial["rounds"] == 1 and partial["config"]["repeats"] == 3
    assert len(partial["runs"]["packed"]["update_critic"]) == 1 and partial["median"]["packed"]["update_critic"] > 0


def test_check_resolves_the_options_for_cuda_without_building_anything(monkeypatch, capsys):
    import ppo_critic.throughput as bench

    def no_worker(cfg, path):
        raise AssertionError("check=true built a worker")

    monkeypatch.setattr(bench, "make_worker", no_worker)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    resolved = bench.main(["check=true", "device=cuda", "paths=padded,megatron", "repeats=3"])
    assert (resolved["layers"], resolved["hidden"], resolved["batch"], resolved["response"]) == (24, 896, 32, 1024)
    assert resolved["dtype"] == "bfloat16" and resolved["budget"] == 2 * 8 * (512 + 1024)
    assert json.loads(capsys.readouterr().out)["check"] == "ok"
    assert bench.main(["check=true", "device=cpu"])["layers"] == 4  # the CPU defaults where the device is the CPU
    with pytest.raises(ValueError, match=re.escape("batch=32 must be a multiple of micro=5")):
        bench.main(["check=true", "device=cuda", "micro=5"])
    with pytest.raises(ValueError, match="is not a torch device name"):
        bench.main(["check=true", "device=gpu"])
