"""`trainer.replay_rows`: recent batches replayed ahead of each fresh one, and a resume that replays the same rows."""

from __future__ import annotations

import io
import json

import pytest
import torch

from conftest import without_timings
from ppo_critic import train as train_mod
from ppo_critic.cli import load_config
from ppo_critic.moving.replay import ReplaySource
from ppo_critic.train import TaskSource, make_source, train

SHORT = [
    "trainer.steps=6",
    "trainer.rollout_batch_size=8",
    "trainer.eval_size=16",
    "trainer.eval_every=2",
    "trainer.save_every=2",
    "trainer.progress=false",
    "trainer.logger=[jsonl]",
    "trainer.export_hf=false",
    "critic.ppo_mini_batch_size=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "critic.model.override_config.hidden_size=32",
    "critic.model.override_config.intermediate_size=64",
]


def config(*extra):
    return load_config(None, [*SHORT, *extra])


def rows_of(batch):
    """Each row as a hashable tuple of its token ids."""
    return [tuple(r.tolist()) for r in batch["input_ids"]]


def test_replayed_rows_come_first_from_held_batches_and_leave_the_fresh_stream_alone():
    cfg = config(
        "trainer.replay_rows=4",
        "trainer.replay_window=2",
        "critic.rollout_n=2",
        "critic.ppo_mini_batch_size=2",
        "critic.ppo_micro_batch_size_per_gpu=2",
    )
    plain, replay = TaskSource(cfg), make_source(cfg)
    assert isinstance(replay, ReplaySource)
    fresh = [plain.next_batch() for _ in range(4)]
    batches = [replay.next_batch() for _ in range(4)]
    assert len(batches[0]["input_ids"]) == 8 and all(len(b["input_ids"]) == 12 for b in batches[1:])
    for i, batch in enumerate(batches):
        assert all(torch.equal(batch[k][-8:], fresh[i][k]) for k in fresh[i])  # the fresh rows: as without replay
        if i:
            window = {row for b in fresh[max(0, i - 2) : i] for row in rows_of(b)}  # the last two batches only
            replayed = rows_of(batch)[:4]
            assert set(replayed) <= window and len(set(replayed)) == 4  # drawn without replacement
            prompts = batch["input_ids"][:4, : plain.task.prompt_width]
            assert torch.equal(prompts[0], prompts[1]) and torch.equal(prompts[2], prompts[3])  # whole groups


def test_recent_batches_are_replayed_more_often():
    counts = {}  # rows replayed from the batch 3, 2 and 1 iterations old
    for decay in (1e-6, 1.0):
        source = make_source(
            config("trainer.replay_rows=4", "trainer.replay_window=3", f"trainer.replay_decay={decay}")
        )
        for _ in range(3):
            source.next_batch()
        counts[decay] = [0, 0, 0]
        for _ in range(30):
            window = [set(rows_of(batch)) for _, _, batch in source.held]  # oldest first
            replayed = rows_of(source.next_batch())[:4]
            counts[decay] = [
                c + sum(r in rows for r in replayed) for c, rows in zip(counts[decay], window, strict=True)
            ]
    assert counts[1e-6] == [0, 0, 120]  # the newest batch alone
    assert min(counts[1.0]) > 20  # the window alike: every age drawn (40 each in expectation)


def test_resume_replays_the_same_rows_and_trains_the_same(tmp_path, monkeypatch):
    drift = ["task.drift=step", "task.drift_start=3", "task.target_prob=0.05", "task.drift_to=0.95"]
    sizes = ["trainer.rollout_batch_size=32", "critic.ppo_mini_batch_size=16", "critic.ppo_micro_batch_size_per_gpu=16"]
    extra = [*sizes, "trainer.replay_rows=16", "trainer.surprise_z=5", "trainer.surprise_steps=2", *drift]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(config(*extra, f"trainer.run_dir={straight}"), out=io.StringIO())
    calls, original = {"n": 0}, train_mod._iteration

    def stop_after_step_two(*args):  # its checkpoint holds the schedule's running mean and two scored batches
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(train_mod, "_iteration", stop_after_step_two)
    with pytest.raises(train_mod.Interrupted):
        train(config(*extra, f"trainer.run_dir={resumed}"), out=io.StringIO())
    monkeypatch.setattr(train_mod, "_iteration", original)
    train(config(*extra, f"trainer.run_dir={resumed}"), out=io.StringIO())
    rows = {p: [json.loads(r) for r in (p / "metrics.jsonl").read_text().splitlines()] for p in (straight, resumed)}
    assert [r["replay/rows"] for r in rows[straight]] == [0, 16, 16, 16, 16, 16]
    # the policy's step at the fourth batch surprises only a schedule that resumed its state (its running mean)
    assert [r["surprise/reacted"] for r in rows[straight]] == [0, 0, 0, 1, 0, 0]
    assert [without_timings(r) for r in rows[straight]] == [without_timings(r) for r in rows[resumed]]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (["trainer.replay_rows=6"], r"trainer.replay_rows=6 must be auto, 0 \(off\) or a multiple of critic.ppo_mini"),
        (["trainer.replay_rows=half"], r"trainer.replay_rows='half' must be an integer or 'auto'$"),
        (["trainer.replay_rows=4", "trainer.replay_decay=0"], r"trainer.replay_decay=0.0 in \(0, 1\]"),
        (["trainer.replay_window=0"], r"trainer.replay_window=0 must be >= 1"),
        (["trainer.surprise_z=0"], r"trainer.surprise_z=0.0 must be a number of standard errors > 0, or null"),
        (["trainer.surprise_mc_targets=1"], r"trainer.surprise_mc_targets=1 must be true or false"),
        (["trainer.surprise_lr_scale=0"], r"trainer.surprise_lr_scale=0.0 a number > 0"),
    ],
)
def test_bad_settings_name_the_key(changes, message):
    with pytest.raises(ValueError, match=message):
        config(*changes)


def test_a_rollout_file_is_not_replayed(tmp_path):
    data = tmp_path / "rollouts.jsonl"
    data.write_text('{"prompt_ids": [1, 2], "response_ids": [3, 4], "reward": 1}\n' * 20)
    with pytest.raises(ValueError, match=r"trainer.replay_rows replays a built-in task's batches; with data="):
        config(f"data={data}", "trainer.replay_rows=4")
    cfg = config(f"data={data}")  # the default (auto): no replay, no error
    assert cfg.trainer.replay_rows == "auto" and cfg.replayed_rows() == 0
    assert not isinstance(make_source(cfg), ReplaySource)


@pytest.mark.parametrize(
    ("changes", "rows"),
    [
        ([], 4),  # half of 8 rows, one mini-batch of 4
        (["trainer.rollout_batch_size=16"], 8),
        (["trainer.rollout_batch_size=20"], 8),  # half is 10: whole mini-batches, rounded down
        (["trainer.rollout_batch_size=4"], 4),  # at least one mini-batch
        (["trainer.replay_rows=0"], 0),
        (["trainer.replay_rows=12"], 12),
    ],
)
def test_auto_replays_half_the_batch_in_whole_mini_batches_on_a_built_in_task(changes, rows):
    cfg = config(*changes)
    assert cfg.replayed_rows() == rows
    assert isinstance(make_source(cfg), ReplaySource) == bool(rows)
