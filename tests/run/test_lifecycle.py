"""Run: one run directory from claim to finish (the loop around it is tests/test_train.py's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from ppo_critic.config.train import TrainerConfig
from ppo_critic.run.files import LOCK_FILE
from ppo_critic.run.lifecycle import Run

NOW = {"trainer": {"steps": 8}, "critic": {"optim": {"lr": 0.002}}}


def saved_run(path: Path, trained: bool = True) -> Path:
    """A run directory whose config.yaml says steps 4, lr 0.001, and (`trained`) whose metrics record a step."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"trainer": {"steps": 4}, "critic": {"optim": {"lr": 0.001}}}))
    (path / "metrics.jsonl").write_text('{"step": 1}\n' if trained else "")
    return path


def test_a_run_is_locked_while_open_and_its_changes_recorded_only_after_a_resume(tmp_path):
    said = []
    path = saved_run(tmp_path / "run", trained=False)  # a start that failed before its first step
    with Run(TrainerConfig(run_dir=str(path)), lead=True, say=said.append).claim(overwrite=False) as run:
        assert (path / LOCK_FILE).is_file() and run.lock is not None
        assert run.check_options(NOW, "fsdp2") == {}  # nothing was trained with the saved options
        assert run.resume(lambda checkpoint: checkpoint) is None  # no checkpoint, no recorded step: a fresh start
        run.start(NOW, 0)
    assert not (path / "config_changes.jsonl").exists()  # nothing was resumed, so nothing changed on resume
    assert yaml.safe_load((path / "config.yaml").read_text()) == NOW and said == []
    with Run(TrainerConfig(run_dir=str(path)), lead=True, say=said.append).claim(overwrite=False):
        pass  # the first call released its lock


def test_megatron_refuses_a_new_rate_on_resume_naming_why(tmp_path):
    run = Run(TrainerConfig(run_dir=str(saved_run(tmp_path / "run"))), lead=True, say=print)
    with pytest.raises(ValueError, match=r"critic.optim.lr: 0.001 -> 0.002 \(strategy=megatron cannot change it on"):
        run.check_options(NOW, "megatron")


def _check_options_on_rank(rank: int, store: str, run_dir: str) -> None:
    """One rank of two: the changes `check_options` found, written to `run_dir/../rank<N>.json`."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        changes = Run(TrainerConfig(run_dir=run_dir), lead=rank == 0, say=print).check_options(NOW, "fsdp2")
        Path(run_dir).parent.joinpath(f"rank{rank}.json").write_text(json.dumps(changes))
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_the_options_changed_on_resume(tmp_path):
    """The first rank alone reads the run directory; a new rate must reach every rank's optimizer all the same."""
    run_dir = str(saved_run(tmp_path / "run"))
    torch.multiprocessing.spawn(_check_options_on_rank, args=(str(tmp_path / "store"), run_dir), nprocs=2)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text())["critic.optim.lr"] == [0.001, 0.002]
