"""Nothing a user types destroys data, and every failure a user can cause is `ppo-critic <cmd>: error: ...` with
exit code 2: exports and values never clobber, a new run never starts over an old one, options changed on resume
are applied or refused (never half-applied), a finished run says so, one writer per run directory, SIGTERM and a
real full disk end cleanly, and a run directory's saved config runs no code."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from conftest import make_batch, state_hash, tiny_config
from ppo_critic.cli import main
from ppo_critic.run.checkpoint import latest_checkpoint, verify_checkpoint
from ppo_critic.run.files import LOCK_FILE
from ppo_critic.worker import CriticWorker
from test_files import tiny_disk
from test_train import SHORT

ROW = {"prompt_ids": [1, 2], "response_ids": [3, 4], "reward": 1.0}
RUN_ARGS = [*SHORT, "trainer.logger=[console,jsonl]"]


def cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def tree(path: Path) -> dict[str, str]:
    """Every file under `path` (the lock file aside) → its sha256."""
    files = (p for p in sorted(path.rglob("*")) if p.is_file() and p.name != LOCK_FILE)
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *RUN_ARGS, f"trainer.run_dir={run}"]) == 0
    return run


@pytest.fixture
def run(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


@pytest.fixture
def rollouts(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps(ROW) + "\n")
    return path


def test_export_never_clobbers(run, tmp_path, capsys):
    before = tree(tmp_path)
    for out in (run, run / "checkpoints", tmp_path):
        code, text = cli(["export", run, out, "--force"], capsys)
        assert code == 2 and any(f"{how} the run directory" in text for how in ("is", "is inside", "holds")), text
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("user data")
    (tmp_path / "plain").write_text("a file")
    for out in ("mine", "plain"):
        code, text = cli(["export", run, tmp_path / out], capsys)
        assert code == 2 and "pass --force to move it aside" in text, text
    assert (tmp_path / "mine" / "notes.txt").read_text() == "user data" and (tmp_path / "plain").read_text() == "a file"
    assert {k: v for k, v in tree(tmp_path).items() if k.startswith("run/")} == {
        k: v for k, v in before.items() if k.startswith("run/")
    }
    code, text = cli(["export", run, tmp_path / "mine", "--force"], capsys)
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("mine.old-")]
    assert code == 0 and f"moved the previous {tmp_path / 'mine'} aside to {aside}" in text
    assert (aside / "notes.txt").read_text() == "user data" and (tmp_path / "mine" / "model.safetensors").is_file()
    (tmp_path / "empty").mkdir()
    assert cli(["export", run, tmp_path / "empty"], capsys)[0] == 0


def test_values_never_overwrite_an_input_or_an_existing_file(run, rollouts, tmp_path, capsys):
    code, text = cli(["values", run, f"data={rollouts}", f"out={rollouts}"], capsys)
    assert code == 2 and "is the input" in text and json.loads(rollouts.read_text()) == ROW
    (tmp_path / "out.jsonl").write_text("earlier results\n")
    code, text = cli(["values", run, f"data={rollouts}", f"out={tmp_path / 'out.jsonl'}"], capsys)
    assert code == 2 and "exists; choose a new file, or pass --force" in text
    assert (tmp_path / "out.jsonl").read_text() == "earlier results\n"
    assert cli(["values", run, f"data={rollouts}", f"out={tmp_path / 'out.jsonl'}", "--force"], capsys)[0] == 0
    assert json.loads((tmp_path / "out.jsonl").read_text())["row"] == 0
    code, text = cli(["values", run, f"data={rollouts}", f"out={run / 'values.jsonl'}"], capsys)
    assert code == 2 and "inside the run directory" in text
    shutil.rmtree(run / "checkpoints")
    code, text = cli(["values", run, f"data={rollouts}", f"out={tmp_path / 'new.jsonl'}"], capsys)
    assert code == 2 and "has no complete checkpoint" in text and not (tmp_path / "new.jsonl").exists()


def test_values_force_never_replaces_a_device_or_a_pipe(run, rollouts, tmp_path, capsys):
    """Issue 43 family 10: --force replaced a device node (made here: as root, a null device) with a regular file."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    targets = [fifo]
    if os.geteuid() == 0:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        targets.append(tmp_path / "null")
    for target in targets:
        code, text = cli(["values", run, f"data={rollouts}", f"out={target}", "--force"], capsys)
        assert code == 2 and "is not a regular file (a device or a pipe?)" in text
        assert not target.is_file() and (target.is_fifo() or target.is_char_device())


def test_export_loads_the_newest_checkpoint_again_when_a_run_beside_it_removes_the_one_it_was_loading(
    run, tmp_path, capsys, monkeypatch
):
    """Issue 43 family 10: export beside `train keep_last_n=1` failed 1 time in 4 with "not a complete checkpoint"
    (the run deleted it mid-load). Made deterministic: the first load finds its checkpoint deleted under it."""
    from ppo_critic.run.checkpoint import delete_checkpoint
    from ppo_critic.worker import CriticWorker

    original, loads = CriticWorker.load_checkpoint, []

    def raced(self, path, *args, **kwargs):
        loads.append(Path(path).name)
        if len(loads) == 1:
            delete_checkpoint(Path(path))  # what keep_last_n does beside us
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(CriticWorker, "load_checkpoint", raced)
    code, text = cli(["export", run, tmp_path / "out"], capsys)
    assert code == 0 and loads == ["step_00000004", "step_00000002"]
    assert f"exported step 2 of {run}" in text


def test_an_interrupt_before_training_starts_says_where_the_same_command_resumes(run, capsys, monkeypatch):
    """Issue 43 family 3 (found by the soak's kills in checkpoint writes): SIGTERM while the model was being built
    ended "interrupted; nothing partial was written", without the promised "resume from"."""
    import ppo_critic.train

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # what SIGTERM becomes, landing while the model is built

    monkeypatch.setattr(ppo_critic.train, "make_worker", interrupted)
    before = tree(run)
    code, text = cli(["train", *RUN_ARGS, f"trainer.run_dir={run}", "trainer.steps=6"], capsys)
    newest = run / "checkpoints" / "step_00000004"
    assert code == 2 and "interrupted before training started; nothing was written" in text
    assert f"Run the same command to resume from the newest checkpoint ({newest})" in text
    assert tree(run) == before


def test_a_new_run_never_starts_over_an_old_one(run, capsys):
    before = tree(run)
    argv = ["train", *RUN_ARGS, f"trainer.run_dir={run}", "trainer.resume=never"]
    code, text = cli(argv, capsys)
    assert code == 2 and "trainer.resume=never, but" in text and "--overwrite to move it aside" in text
    assert tree(run) == before
    code, text = cli([*argv, "--overwrite"], capsys)
    (aside,) = [p for p in run.parent.iterdir() if p.name.startswith("run.old-")]
    assert code == 0 and f"moved the previous run aside to {aside}" in text
    assert tree(aside) == before  # the old run, whole
    assert latest_checkpoint(run / "checkpoints").name == "step_00000004"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"


def test_options_changed_on_resume_are_applied_or_refused(run, capsys):
    before = tree(run)
    refused = [
        "train",
        *RUN_ARGS,
        f"trainer.run_dir={run}",
        "trainer.steps=6",
        "critic.loss_agg_mode=seq-mean-token-mean",
    ]
    code, text = cli(refused, capsys)
    assert code == 2 and "critic.loss_agg_mode: 'token-mean' -> 'seq-mean-token-mean'. They cannot change" in text
    assert tree(run) == before
    code, text = cli(["train", *RUN_ARGS, f"trainer.run_dir={run}", "trainer.steps=6", "critic.optim.lr=0.005"], capsys)
    assert code == 0 and "options changed on resume: critic.optim.lr 0.0005 -> 0.005, trainer.steps 4 -> 6" in text
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["critic/lr"] for r in rows] == [0.0005] * 4 + [0.005] * 2  # the new rate from the resumed step on
    assert yaml.safe_load((run / "config.yaml").read_text())["critic"]["optim"]["lr"] == 0.005
    history = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert history == [{"step": 4, "changed": {"critic.optim.lr": [0.0005, 0.005], "trainer.steps": [4, 6]}}]


def test_a_finished_run_says_so_and_writes_nothing(run, capsys):
    before = tree(run)
    code, text = cli(["train", *RUN_ARGS, f"trainer.run_dir={run}"], capsys)
    assert code == 0 and "run complete at step 4 | vf_loss " in text and "| eval ev_true " in text
    assert tree(run) == before


def launch(run: Path, *extra: str) -> subprocess.Popen:
    """`python -m ppo_critic train` in its own process (a long run: it is stopped by the test)."""
    argv = [sys.executable, "-m", "ppo_critic", "train", *RUN_ARGS, f"trainer.run_dir={run}", *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_one_writer_per_run_directory(tmp_path, capsys):
    run = tmp_path / "run"
    first = launch(run, "trainer.steps=100000", "trainer.save_every=0")
    try:
        wait_for(lambda: (run / "config.yaml").is_file(), first)
        code, text = cli(["train", *RUN_ARGS, f"trainer.run_dir={run}"], capsys)
        assert code == 2 and f"{run} is in use by pid {first.pid} on " in text, text
    finally:
        first.kill()
        first.wait()


def test_sigterm_saves_nothing_partial_and_says_where_to_resume(tmp_path, capsys):
    run = tmp_path / "run"
    process = launch(run, "trainer.steps=100000", "trainer.save_every=2")
    wait_for(lambda: (run / "checkpoints" / "step_00000002").is_dir(), process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 2, err
    assert "ppo-critic train: error: interrupted at step " in err and "nothing partial was saved" in err
    assert "Run the same command to resume from step " in err
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    newest = latest_checkpoint(run / "checkpoints")
    code, text = cli(
        ["train", *RUN_ARGS, f"trainer.run_dir={run}", f"trainer.steps={int(newest.name[5:]) + 1}"], capsys
    )
    assert code == 0 and f"resumed from {newest}" in text, text


def test_a_real_full_disk_during_a_checkpoint(tmp_path, capsys):
    with tiny_disk(tmp_path / "disk", size="1000k") as disk:  # room for the step-2 checkpoint, not for step 4's
        run = disk / "run"
        code, text = cli(["train", *RUN_ARGS, f"trainer.run_dir={run}"], capsys)
        assert code == 2, text
        assert "[Errno 28] writing checkpoint" in text and "step_00000004 failed" in text
        assert text.rstrip().endswith("the previous checkpoints are intact")
        assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")] == []
        checkpoint = latest_checkpoint(run / "checkpoints")
        assert checkpoint.name == "step_00000002"
        verify_checkpoint(checkpoint)  # whole: every file matches its manifest


EVIL = """
from pathlib import Path
Path({marker!r}).write_text("code from a run directory ran")
"""


def test_a_run_directorys_saved_config_runs_no_code(run, rollouts, tmp_path, capsys, monkeypatch):
    marker = tmp_path / "pwned"
    (tmp_path / "evil_lib.py").write_text(EVIL.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["critic"]["model"] |= {"trust_remote_code": True, "external_lib": "evil_lib"}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    assert cli(["values", run, f"data={rollouts}", f"out={tmp_path / 'v.jsonl'}"], capsys)[0] == 0
    assert cli(["export", run, tmp_path / "exported"], capsys)[0] == 0
    assert not marker.exists()
    # the same option on this command line is the user's own choice (and shows the test could fail)
    argv = ["values", run, f"data={rollouts}", f"out={tmp_path / 'w.jsonl'}", "critic.model.external_lib=evil_lib"]
    assert cli(argv, capsys)[0] == 0 and marker.exists()


def test_resuming_on_other_rollouts_is_refused_before_anything_changes(run, rollouts, capsys):
    before = tree(run)
    code, text = cli(["train", *RUN_ARGS, f"trainer.run_dir={run}", "trainer.steps=6", f"data={rollouts}"], capsys)
    assert code == 2 and "data" in text and tree(run) == before


def test_a_checkpoint_whose_state_lacks_a_key_changes_nothing(run):
    checkpoint = latest_checkpoint(run / "checkpoints")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["scheduler"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    from ppo_critic.run.checkpoint import _hashes

    (checkpoint / "manifest.json").write_text(json.dumps(_hashes(checkpoint)))  # a consistent, but bad, state
    worker = CriticWorker({"ppo_mini_batch_size": 4, "model": {"override_config": {**tiny_config(), "vocab_size": 20}}})
    worker.update_critic(make_batch(4, vocab=20))
    before = state_hash(worker.model, worker.optimizer)
    with pytest.raises(ValueError, match="lacks a valid worker_step or scheduler"):
        worker.load_checkpoint(checkpoint)
    assert state_hash(worker.model, worker.optimizer) == before and worker.step == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["critic.optim.lr=.inf"], "optim.lr=inf must be a finite number >= 0"),
        (["critic.optim.weight_decay=-0.5"], "optim.weight_decay=-0.5 must be a finite number >= 0"),
        (["critic.model.value_head_init=normal:1e999"], "the standard deviation must be positive and finite"),
        (["critic.model.override_config.hidden_size=0"], "critic.model.override_config.hidden_size=0 must be a"),
        (["critic.rollout_n=0"], "critic.rollout_n=0 must be a positive integer"),
        (["trainer.dist_timeout_s=0"], "trainer.dist_timeout_s=0.0 must be a positive number of seconds"),
        (["trainer.seed=-1"], "trainer.seed=-1 must be in [0, "),
        (["backend=megatron"], "this needs the megatron package, which is not installed: pip install 'ppo-critic[me"),
        (
            ["critic.model.override_config.hidden_size=1048576", "critic.model.override_config.intermediate_size=64"],
            "cannot build the value model of critic.model.override_config",
        ),
    ],
    ids=["lr-inf", "weight-decay", "init-scale", "hidden-size", "rollout-n", "timeout", "seed", "extra", "huge"],
)
def test_settings_that_cannot_train_are_errors(tmp_path, capsys, monkeypatch, argv, message):
    for name in [m for m in sys.modules if m.startswith("megatron.")]:  # imported by earlier tests
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "megatron", None)  # as if ppo-critic[megatron] were not installed
    code, text = cli(["train", *RUN_ARGS, f"trainer.run_dir={tmp_path / 'run'}", *argv], capsys)
    assert code == 2 and message in text, text
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_yaml_and_bench_mistakes_are_errors(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("trainer:\n  steps: [1, 2\n")
    code, text = cli(["train", "--config", config], capsys)
    assert code == 2 and f"{config}:3:1: not valid YAML" in text
    code, text = cli(["bench", "layers=-1"], capsys)
    assert code == 2 and "layers=-1: sizes must be positive" in text
    code, text = cli(["bench", "hidden=30", "heads=4"], capsys)
    assert code == 2 and "heads must divide hidden" in text


def test_a_damaged_model_file_is_named(run, rollouts, tmp_path, capsys):
    export = tmp_path / "hf"
    assert cli(["export", run, export], capsys)[0] == 0
    (export / "model.safetensors").write_bytes(b"\x00" * 64)
    code, text = cli(["values", export, f"data={rollouts}", f"out={tmp_path / 'v.jsonl'}"], capsys)
    assert code == 2 and f"cannot build the value model of critic.model.path={export}" in text, text


def test_sigterm_handler_is_restored(capsys):
    before = signal.getsignal(signal.SIGTERM)
    cli(["bench", "layers=-1"], capsys)
    assert signal.getsignal(signal.SIGTERM) == before and os.getpid() > 0


# --- no command touches a run directory but its own (A and B: two finished runs side by side) ---


@pytest.fixture
def other(finished_run, tmp_path):
    copy = tmp_path / "other"
    shutil.copytree(finished_run, copy)
    return copy


def newest_step(run: Path) -> Path:
    return latest_checkpoint(run / "checkpoints")


@pytest.mark.parametrize(
    "target",
    [
        lambda b: b / "checkpoints",
        lambda b: newest_step(b) / "hf",
        lambda b: b / "hf",
        lambda b: b / "checkpoints" / ".." / "tensorboard",  # `..` resolved
        lambda b: b.parent,  # holds both runs
    ],
    ids=["checkpoints", "inside-a-checkpoint", "its-hf", "dotdot", "holds-it"],
)
def test_export_never_writes_into_or_over_another_run(run, other, target, capsys):
    before = tree(other)
    for force in ([], ["--force"]):
        code, text = cli(["export", run, target(other), *force], capsys)
        assert code == 2 and "the run directory" in text and "write elsewhere" in text, text
    assert tree(other) == before and verify_checkpoint(newest_step(other)) is None


def test_values_never_write_into_another_run(run, other, rollouts, tmp_path, capsys):
    before = tree(other)
    (tmp_path / "link").symlink_to(other)  # through a symlink, too
    for out in (newest_step(other) / "v.jsonl", other / "metrics.jsonl", tmp_path / "link" / "metrics.jsonl"):
        code, text = cli(["values", run, f"data={rollouts}", f"out={out}", "--force"], capsys)
        assert code == 2 and "is inside the run directory" in text and str(other) in text, text
    assert tree(other) == before


@pytest.mark.parametrize("where", [lambda a: newest_step(a) / "sub", lambda a: a / "hf" / "runB", lambda a: a.parent])
def test_a_run_directory_never_lies_in_or_holds_another_run(run, where, capsys):
    before = tree(run)
    target = where(run)
    existed = target.exists()
    code, text = cli(["train", *RUN_ARGS, f"trainer.run_dir={target}"], capsys)
    assert code == 2 and "trainer.run_dir=" in text and "the run directory" in text, text
    assert tree(run) == before and target.exists() == existed  # nothing created


@pytest.mark.parametrize("out", ["", "."])
def test_an_empty_or_dot_target_never_moves_the_working_directory(run, tmp_path, monkeypatch, out, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("user data")
    monkeypatch.chdir(work)
    code, text = cli(["export", run, out, "--force"], capsys)
    assert code == 2 and "is the working directory or holds it (an empty or unset variable?)" in text, text
    assert (work / "notes.txt").read_text() == "user data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "work"]  # nothing moved aside


def test_a_run_without_checkpoints_is_not_started_over(tmp_path, capsys):
    """`trainer.save_every=0` saves at the last step only: a run killed before it has metrics and no checkpoint."""
    run = tmp_path / "run"
    argv = ["train", *RUN_ARGS, f"trainer.run_dir={run}", "trainer.save_every=0"]
    assert cli(argv, capsys)[0] == 0
    shutil.rmtree(run / "checkpoints")  # as killed at its last step, before the one checkpoint
    before = tree(run)
    code, text = cli(argv, capsys)
    assert code == 2 and "records 4 step(s) in metrics.jsonl but holds no checkpoint" in text, text
    assert "trainer.resume=never --overwrite" in text and tree(run) == before


def test_a_rerun_after_a_kill_past_the_last_checkpoint_writes_the_curves_and_the_export(run, capsys):
    """Killed after the last checkpoint appeared, before the curves and the HF export: the rerun writes them."""
    shutil.rmtree(run / "hf")
    (run / "curves.png").unlink()
    marker = json.loads((run / ".ppo-critic-run").read_text())
    assert marker["finished_step"] == 4  # what a finished run records
    (run / ".ppo-critic-run").write_text(json.dumps({**marker, "finished_step": None}))
    argv = ["train", *RUN_ARGS, f"trainer.run_dir={run}"]
    code, text = cli(argv, capsys)
    assert code == 0 and "(curves and export written)" in text, text
    assert (run / "hf" / "model.safetensors").is_file() and (run / "curves.png").is_file()
    before = tree(run)
    code, text = cli(argv, capsys)
    assert code == 0 and "(nothing to do)" in text and tree(run) == before


def test_a_run_of_the_previous_layout_is_complete_when_its_final_outputs_are_there(run, capsys):
    """Runs written before the marker: finished when curves and export exist, finished now when they do not."""
    (run / ".ppo-critic-run").unlink()
    argv = ["train", *RUN_ARGS, f"trainer.run_dir={run}"]
    before = tree(run)
    assert "(nothing to do)" in cli(argv, capsys)[1] and tree(run) == before
    (run / "curves.png").unlink()
    assert "(curves and export written)" in cli(argv, capsys)[1] and (run / "curves.png").is_file()


def test_a_runs_saved_config_given_as_config_file_decides_no_code(run, tmp_path, capsys):
    """`--config RUN/config.yaml` is a run's saved config: options that import or run code come from this command
    line only (a copy of it elsewhere is the user's own file, and is read as written)."""
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["critic"]["model"] |= {"external_lib": "no_such_module_ppo_critic_test", "trust_remote_code": True}
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    code, text = cli(["train", "--config", run / "config.yaml", "--print-config"], capsys)
    shown = yaml.safe_load(text)["critic"]["model"]
    assert code == 0 and shown["external_lib"] is None and shown["trust_remote_code"] is False
    shutil.copy(run / "config.yaml", tmp_path / "mine.yaml")
    shown = yaml.safe_load(cli(["train", "--config", tmp_path / "mine.yaml", "--print-config"], capsys)[1])
    assert shown["critic"]["model"]["external_lib"] == "no_such_module_ppo_critic_test"


def test_two_values_commands_to_one_new_file_never_lose_a_result_in_silence(run, rollouts, tmp_path):
    """Started together with the same new out=, both pass the check at the start; the one that finishes second is
    refused (exit 2, naming the file) instead of replacing the first one's result, which stays whole."""
    out = tmp_path / "values.jsonl"
    argv = [sys.executable, "-m", "ppo_critic", "values", str(run), f"data={rollouts}", f"out={out}"]
    processes = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in "ab"]
    results = sorted((p.wait(timeout=300), p.stdout.read()) for p in processes)
    (first, said), (second, refusal) = results
    assert (first, second) == (0, 2), results
    assert f"wrote values of 1 rollouts to {out}" in said
    # refused at the end (the race this test sets up), or at the start where a loaded machine let the first finish
    assert "appeared while this command ran" in refusal or "exists; choose a new file" in refusal, refusal
    assert len(out.read_text().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporaries left


def test_two_exports_to_one_new_directory_never_lose_a_result_in_silence(run, tmp_path):
    out = tmp_path / "exported"
    argv = [sys.executable, "-m", "ppo_critic", "export", str(run), str(out)]
    processes = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in "ab"]
    results = sorted((p.wait(timeout=300), p.stdout.read()) for p in processes)
    assert [code for code, _ in results] == [0, 2], results
    assert str(out) in results[1][1]
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left


def test_sigterm_inside_a_checkpoint_write_is_the_promised_clean_exit(tmp_path, capsys, monkeypatch):
    """A signal landing inside torch's C++ writer surfaced as `RuntimeError … inline_container.cc` (exit 1) about
    one time in ten. The writer below turns an interrupt raised inside it into that RuntimeError, as C++ does; the
    signal must wait for the checkpoint instead: it is written whole, and the exit is 2 with "resume from"."""
    import signal

    from ppo_critic.run import checkpoint as ckpt

    real_save, calls = ckpt.dcp.save, []

    def save_as_cpp_would(*args, **kwargs):
        calls.append(1)
        try:
            if len(calls) == 2:
                signal.raise_signal(signal.SIGTERM)  # the scheduler's kill, during the second checkpoint
            return real_save(*args, **kwargs)
        except KeyboardInterrupt as interrupt:
            raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos") from interrupt

    monkeypatch.setattr(ckpt.dcp, "save", save_as_cpp_would)
    run = tmp_path / "run"
    code, text = cli(["train", *RUN_ARGS, f"trainer.run_dir={run}", "trainer.save_every=1"], capsys)
    assert code == 2, text
    assert "interrupted at step" in text and f"resume from step 2 ({run / 'checkpoints' / 'step_00000002'})" in text
    assert latest_checkpoint(run / "checkpoints").name == "step_00000002"
    verify_checkpoint(run / "checkpoints" / "step_00000002")


def test_export_force_moves_nothing_aside_when_the_run_cannot_be_exported(run, tmp_path, capsys):
    """`export RUN OUT --force` with RUN's checkpoint damaged: exit 2 and OUT where it was (was: moved aside first)."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("user data")
    checkpoint = latest_checkpoint(run / "checkpoints")
    weights = sorted(checkpoint.glob("*.distcp"))[0]
    weights.write_bytes(weights.read_bytes()[:-8] + b"damaged!")
    code, text = cli(["export", run, out, "--force"], capsys)
    assert code == 2 and str(checkpoint) in text, text
    assert (out / "notes.txt").read_text() == "user data"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("mine.old-")]


def test_a_refused_resume_into_a_new_directory_leaves_nothing_behind(run, tmp_path, capsys):
    """`trainer.resume=<another model's checkpoint>` fails to load: no lock file (was: `.lock` left in a new
    directory), the directory gone if the command created it, an empty one left empty."""
    other_model = ["critic.model.override_config.hidden_size=16", "critic.model.override_config.intermediate_size=32"]
    resume = f"trainer.resume={latest_checkpoint(run / 'checkpoints')}"
    empty = tmp_path / "empty"
    empty.mkdir()
    for target in (tmp_path / "new", empty):
        code, text = cli(["train", *RUN_ARGS, f"trainer.run_dir={target}", resume, *other_model], capsys)
        assert code == 2 and "cannot load checkpoint" in text, text
    assert not (tmp_path / "new").exists() and list(empty.iterdir()) == []


# Issue 52 family 4: `export` at the edges of the file contract.


def listing(path: Path) -> dict[str, str | None]:
    """Every entry under `path`, hidden ones too: a file's bytes' sha256, None for a directory."""
    return {
        p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        for p in sorted(path.rglob("*"))
    }


def make_out(out: Path, kind: str) -> list[str]:
    """OUT as the case has it: absent ("new"), a directory of the user's or a file of the user's; the flags."""
    if kind == "directory":
        out.mkdir()
        (out / "notes.txt").write_text("user data")
    elif kind == "file":
        out.write_text("a file of the user's")
    return ["--force"] if kind != "new" else []


def one_line_naming(text: str, out: Path, errno_: int) -> None:
    (line,) = text.strip().splitlines()
    assert line.startswith(f"ppo-critic export: error: [Errno {errno_}] writing {out} failed"), line
    assert ".tmp-" not in line, line  # the temporary directory is gone: the user is told the name they gave


@pytest.mark.parametrize("kind", ["new", "directory"])
def test_a_real_full_disk_during_export_is_one_line_naming_the_output_and_changes_nothing(run, tmp_path, kind):
    """Was: safetensors' SafetensorError escaped as a traceback (exit 1), and with --force OUT had been moved aside
    before the export was written (OUT gone). Now: exit 2, one line naming OUT, the disk as it was."""
    with tiny_disk(tmp_path / "disk", size="40k") as disk:  # the export takes 90k
        out = disk / "export"
        flags = make_out(out, kind)
        before = listing(disk)
        argv = [sys.executable, "-m", "ppo_critic", "export", str(run), str(out), *flags]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr
        one_line_naming(done.stderr, out, 28)
        assert done.stdout == "" and listing(disk) == before


def fail_rename(monkeypatch, failing: Callable[[Path, Path], bool]) -> None:
    """os.rename raises ENOSPC (a directory that needs a new block on a full disk) where `failing(src, dst)`."""
    real = os.rename

    def rename(src, dst):
        if failing(Path(src), Path(dst)):
            raise OSError(28, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)


def interrupt_the_weights(monkeypatch) -> None:
    """Ctrl-C while transformers writes the weights (after config.json)."""
    import transformers.modeling_utils

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", interrupted)


def no_inode_left(disk: Path) -> None:
    with contextlib.suppress(OSError):
        for i in range(1000):
            (disk / f"f{i}").touch()


def fill(disk: Path, leave: int) -> None:
    """Leave `leave` bytes free on `disk`: a filler takes the rest."""
    (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - leave))


FAILURES = {  # where the export fails: (errno, what the disk or the process does)
    "no inode for the directory": (28, lambda disk, mp: no_inode_left(disk)),
    "no space for config.json": (28, lambda disk, mp: fill(disk, 0)),
    "no space for the weights": (28, lambda disk, mp: fill(disk, 8192)),
    "ENOSPC moving OUT aside": (28, lambda disk, mp: fail_rename(mp, lambda s, d: ".old-" in d.name)),
    "ENOSPC renaming the export in": (28, lambda disk, mp: fail_rename(mp, lambda s, d: s.name.startswith(".tmp-"))),
    "Ctrl-C during the weights": (None, lambda disk, mp: interrupt_the_weights(mp)),
}


@pytest.mark.parametrize(
    ("failure", "kind"),
    [(f, k) for f in FAILURES for k in ("new", "directory", "file") if (f, k) != ("ENOSPC moving OUT aside", "new")],
)
def test_an_export_failing_at_any_point_leaves_out_as_it_was_and_nothing_partial(
    run, tmp_path, capsys, monkeypatch, failure, kind
):
    """A full disk (or Ctrl-C) before, during config.json, during the weights, moving OUT aside or renaming the export
    in, with or without --force, OUT a directory or a file: exit 2, one line naming OUT, the disk as it was."""
    code, setup = FAILURES[failure]
    with tiny_disk(tmp_path / "disk", size="400k", inodes=64) as disk:
        out = disk / "export"
        flags = make_out(out, kind)
        setup(disk, monkeypatch)
        before = listing(disk)
        status, text = cli(["export", run, out, *flags], capsys)
        assert status == 2, text
        if code is None:
            assert text.strip() == "ppo-critic export: error: interrupted; nothing partial was written", text
        else:
            one_line_naming(text, out, code)
        assert listing(disk) == before


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_a_signal_while_the_export_is_swapped_in_waits_for_the_swap(run, tmp_path, capsys, monkeypatch, kind):
    """SIGTERM between moving OUT aside and renaming the export in would leave neither at OUT: it waits."""
    from ppo_critic.run import files

    out = tmp_path / "export"
    flags = make_out(out, kind)
    real_move_aside = files.move_aside

    def signalled(path):
        signal.raise_signal(signal.SIGTERM)
        return real_move_aside(path)

    monkeypatch.setattr(files, "move_aside", signalled)
    code, text = cli(["export", run, out, *flags], capsys)
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("export.old-")]
    assert code == 2 and f"moved the previous {out} aside to {aside}" in text and "interrupted" in text, text
    assert (out / "model.safetensors").is_file() and (aside / "notes.txt" if kind == "directory" else aside).is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


LONG = {"245": "o" * 245, "255": "o" * 255, "255 utf-8": "é" * 127 + "o"}


@pytest.mark.parametrize("name", LONG.values(), ids=LONG.keys())
def test_export_force_onto_a_long_named_directory_replaces_it_and_keeps_it(run, tmp_path, capsys, name):
    """A 245-byte OUT (legal: NAME_MAX is 255) was moved aside, then its temporary name overflowed: exit 2, OUT gone."""
    out = tmp_path / name
    flags = make_out(out, "directory")
    code, text = cli(["export", run, out, *flags], capsys)
    (aside,) = [p for p in tmp_path.iterdir() if ".old-" in p.name]
    assert code == 0 and f"moved the previous {out} aside to {aside}" in text, text
    assert (aside / "notes.txt").read_text() == "user data" and (out / "model.safetensors").is_file()
    assert all(len(os.fsencode(p.name)) <= 255 for p in tmp_path.iterdir())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("name", ["v" * 244 + ".jsonl", "é" * 124 + "v.jsonl"])
def test_values_into_a_file_with_a_long_name(run, rollouts, tmp_path, capsys, name):
    """`values out=<a 250-byte name>` said the directory could not be written: its temporary name overflowed."""
    out = tmp_path / name
    code, text = cli(["values", run, f"data={rollouts}", f"out={out}"], capsys)
    assert code == 0 and json.loads(out.read_text())["row"] == 0, text
    code, text = cli(["values", run, f"data={rollouts}", f"out={out}", "--force"], capsys)
    assert code == 0 and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
