"""`ppo-critic train` under torchrun (DP=2, FSDP2, gloo): same result as one process; checkpoints written at DP=2
resume at DP=2 (bit-identical) and at DP=1 (within 1e-6)."""

from __future__ import annotations

import io
import json
import shutil

import torch
from safetensors.torch import load_file

from ppo_critic.cli import load_config
from ppo_critic.train import train
from test_layouts import torchrun
from test_train import SHORT

FSDP2 = ["critic.strategy=fsdp2", "trainer.logger=[console,jsonl]"]


def weights(run_dir):
    return load_file(run_dir / "hf" / "model.safetensors")


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_dp2_training_matches_one_process_and_resumes_across_sizes(tmp_path):
    single, dp2 = tmp_path / "single", tmp_path / "dp2"
    train(load_config(None, [*SHORT, *FSDP2, f"trainer.run_dir={single}"]), out=io.StringIO())
    result = torchrun("-m", "ppo_critic", "train", *SHORT, *FSDP2, f"trainer.run_dir={dp2}")
    assert result.returncode == 0, result.stderr[-4000:]
    assert (dp2 / "metrics.jsonl").read_text().count("\n") == 4 and (dp2 / "curves.png").is_file()
    # the first rank alone prints: one plain progress line per log_every steps (output is a pipe) and one summary
    assert result.stdout.count("step 4/4 | loss") == 1 and result.stdout.count("done at step 4") == 1
    assert "returned a view tensor" not in result.stderr  # FSDP2's warning about the root's outputs
    # Not a rounding bound: four AdamW steps, whose lr·g/(√v + eps) can turn a rounding-level difference in a
    # gradient that cancels to ~0 into a step of up to lr. It holds because both runs add the same per-micro-batch
    # gradients (each rank's share is one of the single process's micro-batches; halving is exact): measured
    # bit-identical (max diff 0.0). A machine where thread counts change the matmul blocking could break it.
    assert max_diff(weights(single), weights(dp2)) <= 1e-6

    for name in ("resume_dp2", "resume_dp1"):  # restart from the DP=2 run's step-2 checkpoint
        shutil.copytree(dp2 / "checkpoints" / "step_00000002", tmp_path / name / "checkpoints" / "step_00000002")
    result = torchrun("-m", "ppo_critic", "train", *SHORT, *FSDP2, f"trainer.run_dir={tmp_path / 'resume_dp2'}")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from" in result.stdout
    a, b = weights(dp2), weights(tmp_path / "resume_dp2")
    assert all(torch.equal(a[k], b[k]) for k in a)
    train(load_config(None, [*SHORT, *FSDP2, f"trainer.run_dir={tmp_path / 'resume_dp1'}"]), out=io.StringIO())
    assert max_diff(weights(dp2), weights(tmp_path / "resume_dp1")) <= 1e-6  # as above: the same sums, 2 AdamW steps

    # values and export under torchrun: the first rank alone writes and reports (was: every rank printed, and with
    # values' refusal to replace a file another writer made, the second rank's write would have failed)
    data = tmp_path / "rollouts.jsonl"
    data.write_text('{"prompt_ids": [1, 2], "response_ids": [3, 4], "reward": 1.0}\n' * 4)  # 2 rows per rank
    result = torchrun("-m", "ppo_critic", "values", str(dp2), f"data={data}", f"out={tmp_path / 'values.jsonl'}")
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("wrote values of 4 rollouts") == 1
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported" / "notes.txt").write_text("user data")
    result = torchrun("-m", "ppo_critic", "export", str(dp2), str(tmp_path / "exported"), "--force")
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("exported step 4") == 1 and result.stdout.count("moved the previous") == 1
    (aside,) = tmp_path.glob("exported.old-*")
    assert (aside / "notes.txt").read_text() == "user data" and (tmp_path / "exported" / "config.json").is_file()


def test_dp2_replays_and_reacts_as_one_process(tmp_path):
    """trainer.replay_rows and trainer.surprise_z under DP=2: every rank draws the same replayed rows and takes the
    same decision from the gathered values, so the run is the single process's (bound as above)."""
    drift = ["task.drift=step", "task.drift_start=3", "task.target_prob=0.05", "task.drift_to=0.95"]
    levers = ["trainer.replay_rows=4", "trainer.surprise_z=5", "trainer.surprise_steps=1", "trainer.steps=5", *drift]
    single, dp2 = tmp_path / "single", tmp_path / "dp2"
    train(load_config(None, [*SHORT, *FSDP2, *levers, f"trainer.run_dir={single}"]), out=io.StringIO())
    result = torchrun("-m", "ppo_critic", "train", *SHORT, *FSDP2, *levers, f"trainer.run_dir={dp2}")
    assert result.returncode == 0, result.stderr[-4000:]
    rows = {p: [json.loads(r) for r in (p / "metrics.jsonl").read_text().splitlines()] for p in (single, dp2)}
    for key in ("replay/rows", "surprise/reacted", "critic/lr"):
        assert [r[key] for r in rows[single]] == [r[key] for r in rows[dp2]], key
    assert [r["replay/rows"] for r in rows[dp2]] == [0, 4, 4, 4, 4] and rows[dp2][3]["surprise/reacted"] == 1
    assert max_diff(weights(single), weights(dp2)) <= 1e-6
