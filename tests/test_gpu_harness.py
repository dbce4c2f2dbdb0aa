"""bench/gpu/run.sh cannot waste a GPU minute: its dry run checks here that every step's command line parses and names
the wheels still missing, each step's estimated cost fits its time box and the boxes the run's 8 minutes;
bench/gpu/harness.py's wheel list, carry budget and table rows do what the scripts rely on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from conftest import bench_script

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "bench" / "gpu" / "run.sh"
STEPS = ("env", "tests", "train", "bench", "compile", "verl")


def _harness():
    return bench_script("gpu/harness.py")


harness = _harness()


def dry_run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, dict[str, list[str]]]:
    """`bash bench/gpu/run.sh --dry-run ARGS` with this interpreter; its result and its table's rows by step."""
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "WORK": str(tmp_path / "work"),
        "PYTHON": sys.executable,
        "VERL_PYTHON": str(tmp_path / "no-verl-python"),  # the verl suite's collection needs its own venv: not here
        "OMP_NUM_THREADS": "1",
        **env,
    }
    result = subprocess.run(
        ["bash", str(RUN), "--dry-run", *args], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path
    )
    lines = result.stdout.splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("step "))
    rows = {line.split()[0]: line.split(None, 3)[1:] for line in lines[header + 1 :]}
    return result, rows


@pytest.fixture(scope="module")
def full_dry_run(tmp_path_factory):
    """One dry run of every step (a minute here: it collects the CUDA tests), shared by the tests that read it."""
    tmp_path = tmp_path_factory.mktemp("dry")
    return tmp_path, *dry_run(tmp_path, "--allow-missing-wheels")


def test_the_dry_run_checks_every_step_and_prints_the_table_last(full_dry_run):
    tmp_path, result, rows = full_dry_run
    assert result.returncode == 0, result.stdout + result.stderr
    for step in STEPS:
        assert f"\n-- {step}: " in result.stdout  # each step says what it runs
    assert list(rows) == [*STEPS, "total"]  # the table is the output's last lines
    assert [rows[s][0] for s in STEPS] == ["ok", "ok", "ok", "ok", "ok", "skipped"]
    assert re.fullmatch(r"would run \d+ tests \(of \d+ tests collected\) \(pytest exit 0\)", rows["tests"][2])
    assert int(rows["tests"][2].split()[2]) >= 10  # the CUDA tests are selected by their marker, in every file
    assert rows["bench"][2] == rows["compile"][2] == "options parse (check=true exit 0)"
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert summary == result.stdout.splitlines()[-len(summary) :]


def test_each_step_fits_its_box_and_the_boxes_fit_the_run_with_what_the_script_adds():
    """The estimates on the H200 (harness.STEPS, reasoned from each step's work) with BOX_MARGIN to spare in each box;
    the boxes, a step killed past its box and the script's own work under 8 minutes."""
    declared = re.search(r"^all_steps=(\S+)$", RUN.read_text(), re.M).group(1).split(",")
    assert list(harness.STEPS) == declared == list(STEPS)  # a step of run.sh has a box and an estimate
    for name, step in harness.STEPS.items():
        assert step.estimate * harness.BOX_MARGIN <= step.box, name
    assert harness.deadline() == sum(step.box for step in harness.STEPS.values())
    assert harness.deadline() + harness.KILL_GRACE_S + harness.SCRIPT_S < harness.RUN_LIMIT_S == 480
    boxes = dict(item.split("=") for item in harness.boxes_shell().split())
    assert {k: int(v) for k, v in boxes.items() if k.startswith("T_")} == {
        f"T_{n.upper()}": s.box for n, s in harness.STEPS.items()
    }


def test_the_estimates_count_the_work_the_commands_ask_for(full_dry_run):
    """Each estimate counts what its step's command line holds: bench paths built and profiled, rounds, train steps,
    CUDA tests (at most as many as it has room for): a path, a round or a test added to run.sh must be costed."""
    _, result, rows = full_dry_run
    assert "\n== the plan: estimated seconds on the H200 beside each step's time box\n" in result.stdout
    for name, step in harness.STEPS.items():  # the plan shows every estimate beside its box
        assert re.search(rf"^{name} +{step.estimate:.0f} +{step.box} ", result.stdout, re.M), name
    for name in ("bench", "compile"):
        command = re.search(rf"^-- {name}: (.*)$", result.stdout, re.M).group(1)
        options = dict(o.split("=", 1) for o in command.split() if "=" in o)
        paths, step = options["paths"].split(","), harness.STEPS[name]
        assert step.counted("path") == len(paths), name
        assert step.counted("round") == int(options["repeats"]) + 1, name  # and the warm-up round
        assert step.counted("profile") == (len(paths) if options["profile"] == "true" else 0), name
    train = re.search(r"trainer\.steps=(\d+)", result.stdout).group(1)
    assert harness.STEPS["train"].counted("step") == int(train)
    assert int(rows["tests"][2].split()[2]) <= harness.STEPS["tests"].counted("test")


def test_what_the_run_brings_back_is_at_most_eight_files():
    """A device call brings back at most 8 files from $OUT: every file run.sh writes there, named once."""
    names = set(re.findall(r"\$out/([\w.]+)", RUN.read_text()))
    assert len(names) <= 8, sorted(names)


def test_a_command_that_does_not_parse_fails_the_dry_run_naming_its_step(tmp_path):
    extra = {"TRAIN_EXTRA": "trainer.stepz=50", "BENCH_EXTRA": "repeat=2"}
    result, rows = dry_run(tmp_path, "--steps", "train,bench", **extra)
    assert result.returncode == 1, result.stdout + result.stderr
    assert list(rows) == ["train", "bench", "total"]
    assert rows["train"][0] == "FAIL" and "'trainer.stepz'; did you mean 'trainer.steps'?" in rows["train"][2]
    assert rows["bench"][0] == "FAIL" and "did you mean 'repeats'" in rows["bench"][2]


def test_missing_wheels_are_listed_and_fail_the_dry_run_unless_allowed(tmp_path):
    wheels = tmp_path / "wheels"
    (wheels / "main").mkdir(parents=True)
    (wheels / "main" / "tensordict-0.15.3-py3-none-any.whl").write_bytes(b"")
    listed = harness.read_list()
    result, rows = dry_run(tmp_path, "--steps", "env", WHEELS=str(wheels))
    assert result.returncode == 1 and rows["env"][0] == "FAIL"
    missing = [line.strip() for line in result.stdout.splitlines() if line.startswith("  ")]
    fetched = harness.Wheel("main", "tensordict", "0.15.3")
    assert missing == [f"{w.group} {w.requirement} {w.how}" for w in listed if w != fetched]
    assert rows["env"][2].startswith(f"{len(listed) - 1} wheels missing")
    allowed, rows = dry_run(tmp_path, "--steps", "env", "--allow-missing-wheels", WHEELS=str(wheels))
    assert allowed.returncode == 0 and rows["env"][0] == "ok"


def test_the_wheel_list_pins_what_the_project_and_the_verl_suite_ask_for():
    wheels = harness.read_list()
    assert harness.groups(wheels) == ["main", "megatron", "verl"]
    for group in ("main", "verl"):  # one version of each package per install target
        names = [w.name for w in wheels if w.group == group]
        assert len(names) == len(set(names)), group
    pins = {(w.group, w.name): w.version for w in wheels}
    megatron_extra = re.search(r'megatron = \["megatron-core([^"]+)"\]', (ROOT / "pyproject.toml").read_text())
    assert pins[("megatron", "megatron-core")] in SpecifierSet(megatron_extra.group(1))
    suite = ROOT / "tests" / "with_verl" / "engine" / "requirements.txt"
    on_the_box = {"peft", "pillow", "pytest", "aiohttp"}  # the GPU image has them
    for line in suite.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            if name not in on_the_box:
                assert pins.get(("verl", name)) == version, f"{name}: wheels.txt and {suite.name} disagree"


def test_slim_drops_only_what_a_running_cluster_needs_and_its_record_lines(tmp_path):
    wheel = tmp_path / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"
    kept = ["ray/__init__.py", "ray/_raylet.so", "ray/dashboard/client/build/static/js/main.js"]
    dropped = ["ray/jars/ray_dist.jar", "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet", "x.js.map"]
    record = "".join(f"{name},sha256=x,1\n" for name in kept + dropped)
    with zipfile.ZipFile(wheel, "w") as z:
        for name in kept + dropped:
            z.writestr(name, "x" * 1000)
        z.writestr("ray-2.60.0.dist-info/RECORD", record)
    before, after = harness.slim(wheel)
    assert after < before
    with zipfile.ZipFile(wheel) as z:
        assert z.namelist() == [*kept, "ray-2.60.0.dist-info/RECORD"]
        lines = z.read("ray-2.60.0.dist-info/RECORD").decode().splitlines()
    assert [line.split(",")[0] for line in lines] == kept
    assert harness.slim(wheel)[1] == after  # idempotent: fetch_wheels.sh may run again


def test_a_group_over_the_carry_limit_is_left_out_whole_and_its_step_says_why(tmp_path):
    wheels = [
        harness.Wheel("main", "tensordict", "0.15.3"),
        harness.Wheel("verl", "verl", "0.9.1"),
        harness.Wheel("verl", "ray", "2.60.0", "import-only"),
    ]
    for wheel, size_mib in zip(wheels, (1, 2, 30), strict=True):
        folder = tmp_path / wheel.group
        folder.mkdir(exist_ok=True)
        (folder / f"{wheel.stem}py3-none-any.whl").write_bytes(b"\0" * (size_mib << 20))
    stale = [tmp_path / "main" / "tensordict-0.10.0-py3-none-any.whl", tmp_path / "pyvers-0.2.3-py3-none-any.whl"]
    for path in stale:  # another version beside the listed one (two stop the install), a wheel of the old flat layout
        path.write_bytes(b"")
    assert sorted(harness.prune(wheels, tmp_path)) == sorted(stale)
    lines = harness.budget(wheels, tmp_path, tree_bytes=20 << 20, limit_mib=40)  # room: 40 - 2 - 20 = 18 MiB
    assert any("main" in line and "carried" in line for line in lines)
    assert any("verl" in line and "LEFT OUT" in line for line in lines)
    assert sorted(p.name for p in tmp_path.glob("*/*.whl")) == ["tensordict-0.15.3-py3-none-any.whl"]
    reason = harness.skip_reason(wheels, tmp_path, "verl")
    assert reason.startswith("skipped: verl-0.9.1 (+1 more) not carried (size: the verl wheels are 32.0 MiB")
    assert harness.skip_reason(wheels, tmp_path, "main") == ""
    assert "run bash bench/gpu/fetch_wheels.sh" in harness.skip_reason(wheels, tmp_path / "empty", "main")


def test_the_rows_give_the_key_numbers(tmp_path):
    log = tmp_path / "tests.log"
    log.write_text("....F\n!!! KeyboardInterrupt !!!\n= 1 failed, 4 passed, 2 skipped, 1 deselected in 140.01s =\n")
    assert harness.tests_row(log) == "4 passed, 1 failed, 2 skipped"  # also after the time box's SIGINT
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 49, "perf/tokens_per_s": 1000.0}, {"step": 50, "perf/tokens_per_s": 3000.0, "elapsed_s": 25.0}]
    rows[1]["eval/ev_true"] = 0.9123
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert harness.train_row(metrics) == "step 50, ev_true 0.912, 2.0 steps/s, update 2.0k tok/s"
    bench = tmp_path / "bench.json"
    median = {"padded": {"update_critic": 60e3, "compute_values": 200e3}}
    median["packed+dyn"] = {"update_critic": 142e3, "compute_values": 510e3}
    errors = {"megatron": "error: ValueError: no (while building)"}
    bench.write_text(json.dumps({"median": median, "errors": errors, "rounds": 2, "config": {"repeats": 3}}))
    assert harness.bench_row(bench) == (
        "update best 142k (packed+dyn) vs padded 60k (target >= 150k); "
        "values best 510k (packed+dyn) vs padded 200k (target >= 500k); partial: 2 of 3 rounds; "
        "errors: megatron (bench.json, bench.log)"
    )
    compiled = tmp_path / "compile.json"  # the compile step's path beside the bench step's padded baseline
    median = {"packed+dyn+fused+compile": {"update_critic": 160e3, "compute_values": 520e3}}
    compiled.write_text(json.dumps({"median": median, "errors": {}, "rounds": 3, "config": {"repeats": 3}}))
    assert harness.bench_row(compiled, baseline=bench) == (
        "update best 160k (packed+dyn+fused+compile) vs padded 60k (target >= 150k); "
        "values best 520k (packed+dyn+fused+compile) vs padded 200k (target >= 500k)"
    )
    assert harness.bench_row(compiled).startswith("update best 160k (packed+dyn+fused+compile) vs padded - ")


def test_the_metadata_written_for_src_on_pythonpath_carries_the_verl_plugin(tmp_path):
    info = harness.write_dist_info(tmp_path)
    code = "from importlib.metadata import entry_points as e; print([p.value for p in e(group='verl.plugins')])"
    result = subprocess.run(
        [sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {code}"],
        capture_output=True,
        text=True,
    )
    assert result.stdout.strip() == "['ppo_critic.integrations.verl_plugin']", result.stderr
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert info.name == f"ppo_critic-{version}.dist-info"
