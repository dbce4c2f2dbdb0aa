"""rundir: outputs that would destroy something are refused, a new run never starts over an old one, a resumed run
says which options changed (or refuses them), and resume=auto skips damaged checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import make_batch, tiny_config
from ppo_critic.run import rundir
from ppo_critic.run.checkpoint import CheckpointDamaged
from ppo_critic.run.files import LOCK_FILE
from ppo_critic.worker import CriticWorker


def a_run(path: Path) -> Path:
    (path / "checkpoints").mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"trainer": {"steps": 4}, "critic": {"optim": {"lr": 0.001}}}))
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    return path


@pytest.mark.parametrize(
    ("where", "kind", "force", "message"),
    [
        ("run", "directory", True, "is the run directory"),
        ("run/checkpoints", "directory", True, "is inside the run directory"),
        ("run/values.jsonl", "file", True, "is inside the run directory"),
        (".", "directory", True, "holds the run directory"),
        ("data.jsonl", "file", False, "is the input"),
        ("existing.jsonl", "file", False, "exists; choose a new file, or pass --force"),
        ("folder", "file", True, "is a directory; name a file"),
        ("folder", "directory", False, "exists and is not empty; choose a new directory, or pass --force"),
        ("other_run", "directory", True, "is the run directory"),
    ],
)
def test_outputs_that_would_destroy_something_are_refused(tmp_path, where, kind, force, message):
    a_run(tmp_path / "run")
    a_run(tmp_path / "other_run")
    for name in ("data.jsonl", "existing.jsonl"):
        (tmp_path / name).write_text("rows\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "mine.txt").write_text("user data")
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match=message):
        rundir.check_output(tmp_path / where, kind, inputs=[tmp_path / "data.jsonl"], force=force)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before


def test_force_replaces_a_file_and_moves_a_directory_aside(tmp_path):
    (tmp_path / "values.jsonl").write_text("old\n")
    assert rundir.check_output(tmp_path / "values.jsonl", "file", [], force=True) is None  # write_values replaces
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "mine.txt").write_text("user data")
    aside = rundir.check_output(tmp_path / "export", "directory", [], force=True)
    assert aside.name.startswith("export.old-") and (aside / "mine.txt").read_text() == "user data"
    (tmp_path / "empty").mkdir()
    assert rundir.check_output(tmp_path / "empty", "directory", [], force=False) is None


def test_a_new_run_never_starts_over_an_old_one(tmp_path):
    run = a_run(tmp_path / "run")
    said = []
    with pytest.raises(ValueError, match=r"trainer.resume=never, but .* holds a run \(config.yaml, metrics.jsonl, che"):
        rundir.claim(run, "never", overwrite=False, say=said.append)
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    lock = rundir.claim(run, "never", overwrite=True, say=said.append)
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert said == [f"moved the previous run aside to {aside}"]
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n' and sorted(p.name for p in run.iterdir()) == [
        LOCK_FILE
    ]
    lock.release()
    rundir.claim(run, "auto", overwrite=False, say=said.append).release()  # a fresh directory: nothing to refuse


def test_options_that_may_change_on_resume_and_those_that_may_not(tmp_path):
    run = a_run(tmp_path / "run")
    now = {"trainer": {"steps": 8, "run_dir": "elsewhere", "resume": "auto"}, "critic": {"optim": {"lr": 0.002}}}
    changes = rundir.option_changes(run, now, rundir.CHANGEABLE_ON_RESUME)
    assert changes == {"critic.optim.lr": [0.001, 0.002], "trainer.steps": [4, 8]}
    rundir.record_changes(run, 4, changes)
    rundir.record_changes(run, 6, {"trainer.steps": [8, 10]})
    assert [yaml.safe_load(line)["step"] for line in (run / rundir.CHANGES_FILE).read_text().splitlines()] == [4, 6]
    now["critic"]["loss_agg_mode"] = "seq-mean-token-mean"
    with pytest.raises(ValueError, match=r"critic.loss_agg_mode: None -> 'seq-mean-token-mean'\. They cannot change"):
        rundir.option_changes(run, now, rundir.CHANGEABLE_ON_RESUME)


def test_megatron_cannot_change_the_rate_on_resume_and_says_why(tmp_path):
    """FIXED_ON_RESUME names the exception by option and backend (not by its place in CHANGEABLE_ON_RESUME)."""
    run = a_run(tmp_path / "run")
    now = {"trainer": {"steps": 8}, "critic": {"optim": {"lr": 0.002}}}
    megatron = rundir.changeable_on_resume("megatron")
    assert (
        set(rundir.CHANGEABLE_ON_RESUME) - set(megatron)
        == {"critic.optim.lr"}
        == set(rundir.FIXED_ON_RESUME["megatron"])
    )
    assert rundir.changeable_on_resume("fsdp2") == rundir.CHANGEABLE_ON_RESUME
    with pytest.raises(
        ValueError, match=r"critic.optim.lr: 0.001 -> 0.002 \(strategy=megatron cannot change it on res"
    ):
        rundir.option_changes(run, now, megatron, rundir.why_fixed("megatron"))
    now["critic"]["optim"]["lr"] = 0.001
    assert rundir.option_changes(run, now, megatron, rundir.why_fixed("megatron")) == {"trainer.steps": [4, 8]}


def test_a_run_saved_before_an_option_existed_resumes_with_the_value_it_meant(tmp_path):
    run = a_run(tmp_path / "run")  # its config.yaml has no trainer.length_adaptive_scope
    now = {"trainer": {"steps": 4, "length_adaptive_scope": "response"}, "critic": {"optim": {"lr": 0.001}}}
    assert rundir.option_changes(run, now, rundir.CHANGEABLE_ON_RESUME) == {}
    now["trainer"]["length_adaptive_scope"] = "batch"
    with pytest.raises(ValueError, match=r"trainer.length_adaptive_scope: 'response' -> 'batch'\. They cannot"):
        rundir.option_changes(run, now, rundir.CHANGEABLE_ON_RESUME)


def test_resume_auto_skips_damaged_checkpoints_out_loud(tmp_path):
    config = {"ppo_mini_batch_size": 4, "model": {"override_config": tiny_config()}}
    worker = CriticWorker(config)
    for _ in range(3):
        worker.update_critic(make_batch(4))
        worker.save_checkpoint(tmp_path / "checkpoints")
    shard = next((tmp_path / "checkpoints" / "step_00000003").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit
    shard.write_bytes(bytes(data))
    said = []
    fresh = CriticWorker(config)
    loaded = rundir.resume(tmp_path / "checkpoints", "auto", lambda c: fresh.load_checkpoint(c) and c, said.append)
    assert loaded.name == "step_00000002" and fresh.step == 2
    assert said == [
        f"checkpoint {tmp_path / 'checkpoints' / 'step_00000003'} is damaged: {shard.name} does not match its "
        "content hash in manifest.json (bit rot, or a partial copy); trying the checkpoint before it"
    ]
    for name in ("step_00000001", "step_00000002"):
        (tmp_path / "checkpoints" / name / "trainer_state.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no checkpoint under .* verifies \(checkpoint .*step_00000003 is damaged"):
        rundir.resume(tmp_path / "checkpoints", "auto", CriticWorker(config).load_checkpoint, said.append)
    with pytest.raises(CheckpointDamaged, match=r"trainer_state\.json does not match"):
        CriticWorker(config).load_checkpoint(tmp_path / "checkpoints" / "step_00000001")


def test_a_run_that_never_trained_a_step_takes_new_options(tmp_path):
    """Issue 52: a start that failed before its first step (a refused batch) left a config.yaml that every later
    command had to repeat; nothing was trained with it (no checkpoint, no metric row), so new options apply. Once a
    step is recorded, or a checkpoint exists, the saved options hold again."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"trainer": {"steps": 4}, "critic": {"vf_loss_type": "bce"}}))
    (run / "metrics.jsonl").write_text("")
    now = {"trainer": {"steps": 4}, "critic": {"vf_loss_type": "mse"}}
    assert rundir.option_changes(run, now, rundir.CHANGEABLE_ON_RESUME) == {}
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match=r"critic.vf_loss_type: 'bce' -> 'mse'\. They cannot change"):
        rundir.option_changes(run, now, rundir.CHANGEABLE_ON_RESUME)
