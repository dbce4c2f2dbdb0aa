"""The main job: files it writes, bit-identical resume, incomplete checkpoints, export, rollout files."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import FP32_REORDERED, exported_values, without_timings
from ppo_critic import train as train_mod
from ppo_critic.cli import load_config
from ppo_critic.rollout_files.read import read_rollouts
from ppo_critic.run.checkpoint import latest_checkpoint
from ppo_critic.train import evaluate, make_worker, train

SHORT = [
    "trainer.steps=4",
    "trainer.rollout_batch_size=8",
    "trainer.eval_size=16",
    "trainer.eval_every=2",
    "trainer.save_every=2",
    "trainer.progress=false",
    "critic.ppo_mini_batch_size=4",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "critic.model.override_config.hidden_size=32",
    "critic.model.override_config.intermediate_size=64",
]


def short_config(run_dir, *extra):
    return load_config(None, [*SHORT, f"trainer.run_dir={run_dir}", *extra])


def test_a_run_writes_every_artifact(tmp_path, capsys):
    out = io.StringIO()
    metrics = train(short_config(tmp_path / "run"), out=out)
    assert "Writing model shards" not in capsys.readouterr().err  # no transformers bar in the log of a run
    run = tmp_path / "run"
    assert {"config.yaml", "metrics.jsonl", "curves.png", "checkpoints", "hf", "tensorboard"} <= {
        p.name for p in run.iterdir()
    }
    head = out.getvalue().splitlines()[:2]  # a line saying what runs, not the whole config (issue 43, first hour)
    assert head[0].startswith(f"run: {run} — task counting, qwen2 32×2, lr ") and head[0].endswith(", 4 steps")
    assert head[1] == f"every option: {run / 'config.yaml'} once the run starts (`ppo-critic train --print-config`)"
    assert "ppo_mini_batch_size: 4" in (run / "config.yaml").read_text()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "eval/ev_true" in rows[1] and "eval/ev_returns" in rows[3] and "eval/mae_true" in rows[3]
    assert metrics["eval/ev_true"] == rows[-1]["eval/ev_true"]
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").iterdir())
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        "step_00000002",
        "step_00000004",
    ]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"


def test_resume_is_bit_identical_and_ignores_incomplete_checkpoints(tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    train(short_config(straight), out=io.StringIO())

    resumed = tmp_path / "resumed"
    calls = {"n": 0}
    original = train_mod._iteration

    def crash_on_third(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # the process is stopped after step 2 was checkpointed
        return original(*args)

    monkeypatch.setattr(train_mod, "_iteration", crash_on_third)
    with pytest.raises(train_mod.Interrupted, match=r"interrupted at step 2; .* resume from step 2 \("):
        train(short_config(resumed), out=io.StringIO())
    monkeypatch.setattr(train_mod, "_iteration", original)
    ckpts = resumed / "checkpoints"
    assert latest_checkpoint(ckpts).name == "step_00000002"
    # A crash between writing and renaming leaves a temporary directory; a damaged step directory has no metadata.
    shutil.copytree(ckpts / "step_00000002", ckpts / ".tmp-step_00000003-deadbeef")
    (ckpts / "step_00000009").mkdir()
    assert latest_checkpoint(ckpts).name == "step_00000002"
    out = io.StringIO()
    train(short_config(resumed), out=out)
    assert "resumed from" in out.getvalue() and "step 2" in out.getvalue()

    a = load_file(straight / "hf" / "model.safetensors")
    b = load_file(resumed / "hf" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    rows_a = (straight / "metrics.jsonl").read_text().splitlines()
    rows_b = (resumed / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows_b] == [1, 2, 3, 4]
    assert [without_timings(json.loads(r)) for r in rows_a] == [without_timings(json.loads(r)) for r in rows_b]


def test_export_loads_with_from_pretrained_and_gives_the_same_values(tmp_path):
    cfg = short_config(tmp_path / "run")
    train(cfg, out=io.StringIO())
    worker = make_worker(load_config(None, [], base=_saved(tmp_path / "run")))
    worker.load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    batch = train_mod.TaskSource(cfg).eval_batch
    expected = worker.compute_values(batch)
    got = exported_values(tmp_path / "run" / "hf", batch)
    torch.testing.assert_close(got, expected, **FP32_REORDERED)  # the same sums, the HF model's order


def _saved(run_dir):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))


def test_generic_head_export_round_trips(tmp_path):
    from ppo_critic import build_value_model

    # value_norm off: the exported head is the one compute_values uses, the weights' moving average under ema_decay
    # (test_value_norm checks the export with statistics folded in)
    cfg = short_config(tmp_path / "run", "critic.model.head=generic", "trainer.steps=2", "critic.value_norm=off")
    train(cfg, out=io.StringIO())
    reloaded = build_value_model(tmp_path / "run" / "hf")
    worker = make_worker(load_config(None, [], base=_saved(tmp_path / "run")))
    worker.load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert type(reloaded).__name__ == "ValueModel" and worker.critic.ema is not None
    with worker.critic.averaged_weights():
        # exact: the averaged float32 weights are written and read bit for bit
        torch.testing.assert_close(reloaded.score.weight, worker.model.score.weight, rtol=0, atol=0)
    assert reloaded.score.weight.abs().sum() > 0


def write_rollout_file(path, count: int) -> list[dict]:
    """`count` rows whose first prompt token is the row number (so a row can be recognised in a batch)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(count):
        prompt = [i, *torch.randint(0, 20, (1 + i % 3,), generator=g).tolist()]
        response = torch.randint(0, 20, (1 + i % 5,), generator=g).tolist()
        rows.append({"prompt_ids": prompt, "response_ids": response, "reward": float(i % 2)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def first_tokens(batch) -> set[int]:
    """The row numbers of `write_rollout_file` rows in a collated (left-padded) batch."""
    prompt = batch["input_ids"][:, : -batch["responses"].shape[1]]
    mask = batch["attention_mask"][:, : prompt.shape[1]]
    return {int(row[m.bool()][0]) for row, m in zip(prompt, mask, strict=True)}


def test_held_out_split_is_seeded_disjoint_and_never_empties_the_training_set():
    rows = list(range(20))
    held, kept = train_mod.held_out_split(rows, 0.1, seed=3)
    assert len(held) == 2 and sorted(held + kept) == rows and held == sorted(held) and kept == sorted(kept)
    assert train_mod.held_out_split(rows, 0.1, seed=3) == (held, kept)  # the same seed holds out the same rows
    assert train_mod.held_out_split(rows, 0.1, seed=4)[0] != held
    assert len(train_mod.held_out_split(rows, 0.01, seed=0)[0]) == 1  # a positive fraction holds out >= 1 row
    assert train_mod.held_out_split(rows, 0.0, seed=0) == ([], rows)
    with pytest.raises(ValueError, match=r"trainer.eval_fraction=0.99 leaves no training rows of the 20"):
        train_mod.held_out_split(rows, 0.99, seed=0)


def test_a_rollout_file_run_never_trains_on_its_evaluation_rows(tmp_path):
    data = tmp_path / "rollouts.jsonl"
    write_rollout_file(data, 20)
    source = train_mod.FileSource(short_config(tmp_path / "run", f"data={data}", "trainer.eval_fraction=0.25"))
    held_out = first_tokens(source.eval_batch)
    assert len(held_out) == 5 and len(source.rows) == 15
    trained = set().union(*(first_tokens(source.next_batch()) for _ in range(4)))  # 32 rows: a full cycle
    assert trained == set(range(20)) - held_out
    assert source.eval_name == (f"5 rows of {data} held out (eval_fraction=0.25, seed 0; never trained on)")
    other = tmp_path / "eval.jsonl"
    evaluated = [{**row, "reward": 7.0} for row in write_rollout_file(other, 3)]  # not the training rows
    other.write_text("".join(json.dumps(r) + "\n" for r in evaluated))
    source = train_mod.FileSource(short_config(tmp_path / "run", f"data={data}", f"trainer.eval_data={other}"))
    assert len(source.rows) == 20 and first_tokens(source.eval_batch) == {0, 1, 2}
    assert source.eval_name == f"3 rows of eval_data={other}"


def test_training_on_a_rollout_file(tmp_path):
    data = tmp_path / "rollouts.jsonl"
    write_rollout_file(data, 12)
    out = io.StringIO()
    metrics = train(short_config(tmp_path / "run", f"data={data}"), out=out)
    assert "eval/ev_returns" in metrics and "eval/ev_true" not in metrics
    assert f"on 2 rows of {data} held out" in out.getvalue().splitlines()[-1]  # the summary names the set
    assert len(read_rollouts(data)) == 12
    out = io.StringIO()
    metrics = train(short_config(tmp_path / "none", f"data={data}", "trainer.eval_fraction=0"), out=out)
    assert not any(key.startswith("eval/") for key in metrics)  # no evaluation set: no evaluation
    assert out.getvalue().splitlines()[-1].startswith("done at step 4 | vf_loss ")
    out = io.StringIO()
    again = train(short_config(tmp_path / "run", f"data={data}"), out=out)  # already complete: nothing to do
    assert out.getvalue().splitlines()[-1].startswith("run complete at step 4 | vf_loss ")
    assert again.keys() >= {"critic/vf_loss", "eval/ev_returns"}


def test_evaluate_is_perfect_for_a_critic_that_outputs_the_truth(tmp_path):
    cfg = short_config(tmp_path / "run")
    source = train_mod.TaskSource(cfg)

    class Oracle:
        def compute_values(self, batch):
            return batch["true_values"]

    m = evaluate(Oracle(), source.eval_batch, gamma=1.0)
    # 1 - 0/Var up to the rounding of the variance (pytest's default rel=1e-6); the error is exactly 0
    assert m["eval/ev_true"] == pytest.approx(1.0) and m["eval/mae_true"] == 0
    assert 0 < m["eval/ev_returns"] < 1  # returns are noisy samples of the truth


class _Recorder:
    """A worker stand-in for `_iteration`: fixed values, and the batch `update_critic` is given."""

    def __init__(self, step: int, values: torch.Tensor):
        self.step, self.values, self.seen = step, values, None

    def compute_values(self, batch):
        return self.values

    def update_critic(self, batch, lr_scale=1.0):
        self.seen = batch
        return {}


@pytest.mark.parametrize(
    ("step", "settings", "lam"),
    [
        (0, {"lam": 0.5, "length_adaptive_alpha": None, "critic_warmup_steps": 2}, "mc"),  # warmup: MC returns
        (2, {"lam": 0.5, "length_adaptive_alpha": None, "critic_warmup_steps": 2}, "lam"),
        (0, {"length_adaptive_alpha": 0.25, "length_adaptive_scope": "response"}, "adaptive"),
        (0, {"length_adaptive_alpha": 0.25, "critic_warmup_steps": 1}, "mc"),
        (0, {"length_adaptive_alpha": 0.25, "length_adaptive_scope": "batch"}, "batch"),
    ],
)
def test_the_critics_targets_use_the_trainers_lambda(step, settings, lam):
    from ppo_critic.algos import compute_gae_advantage_return, length_adaptive_lambda
    from ppo_critic.config.train import TrainerConfig
    from ppo_critic.tasks import CountingTask

    batch = CountingTask().sample(6, torch.Generator().manual_seed(0))
    values = torch.rand(batch["responses"].shape, generator=torch.Generator().manual_seed(1))
    worker = _Recorder(step, values)
    trainer = TrainerConfig(gamma=0.9, **settings)
    train_mod._iteration(worker, type("Source", (), {"next_batch": lambda self: dict(batch)})(), trainer)
    mask = batch["response_mask"]
    expected_lam = {
        "mc": 1.0,
        "lam": 0.5,
        "adaptive": length_adaptive_lambda(mask, 0.25, gamma=0.9),
        "batch": length_adaptive_lambda(mask, 0.25, gamma=0.9, scope="batch"),
    }[lam]
    _, expected = compute_gae_advantage_return(batch["token_level_rewards"], values, mask, 0.9, expected_lam)
    assert torch.equal(worker.seen["returns"], expected)
    if lam == "adaptive":  # lengths 4..12 at alpha 0.25, gamma 0.9 (l_gamma 3.4..7.2): lambdas 0 .. 0.44
        assert len(set(expected_lam.tolist())) > 1
        assert not torch.equal(expected_lam, length_adaptive_lambda(mask, 0.25))  # the discounted length counts
        _, single = compute_gae_advantage_return(batch["token_level_rewards"], values, mask, 0.9, trainer.lam)
        assert not torch.equal(expected, single)
    if lam == "batch":  # one λ for all rows, that of the mean discounted length
        assert len(set(expected_lam.tolist())) == 1
        l_gamma = (1 - 0.9 ** mask.sum(-1).double()) / 0.1
        # float32 against float64: a few roundings of values near 1, each <= 2^-24 ≈ 6e-8, stay below 1e-6
        assert expected_lam[0].item() == pytest.approx(1 - 1 / (0.25 * l_gamma.mean().item()), abs=1e-6)


def test_the_loop_regresses_on_the_targets_it_is_given(tmp_path):
    """`train(targets=...)` replaces `critic_returns` (benchmarks regress on exact values without patching)."""
    calls = []

    def spy(batch, values, trainer, step):
        calls.append((step, values.shape == batch["responses"].shape, trainer.gamma))
        return train_mod.critic_returns(batch, values, trainer, step)

    def zeros(batch, values, trainer, step):
        return torch.zeros_like(values)

    runs = {}
    for name, targets in (("spy", spy), ("zeros", zeros)):
        cfg = short_config(tmp_path / name, "trainer.steps=2", "trainer.export_hf=false")
        runs[name] = train(cfg, out=io.StringIO(), targets=targets)
    assert calls == [(0, True, 1.0), (1, True, 1.0)]
    assert runs["spy"]["critic/vf_loss"] != runs["zeros"]["critic/vf_loss"]


def test_the_default_model_covers_the_longest_rollout():
    from ppo_critic.config.train import DEFAULT_MODEL, resolve_model

    cfg = load_config(None, [])
    shape = resolve_model(cfg, 40, 300).critic.model.override_config
    assert (shape["vocab_size"], shape["max_position_embeddings"]) == (40, 300)
    short = resolve_model(cfg, 40, 20).critic.model.override_config
    assert short["max_position_embeddings"] == DEFAULT_MODEL["max_position_embeddings"] == 64
    given = load_config(None, ["critic.model.override_config.max_position_embeddings=128"])
    assert resolve_model(given, 40, 300).critic.model.override_config["max_position_embeddings"] == 128  # yours wins
    source = train_mod.TaskSource(load_config(None, ["task.name=long", "trainer.eval_size=1"]))
    assert source.max_length == source.task.prompt_width + source.task.response_width > 256


@pytest.mark.parametrize("name", ["counting", "dense", "long", "recall", "lengths", "scale"])
def test_every_task_trains_and_is_judged_against_its_truth(tmp_path, name):
    """`ppo-critic train task.name=X` for every built-in task: the held-out truth is the task's at trainer.gamma, and a
    critic that predicted it would score EV 1 (tests/test_train.py's evaluate test); here two tiny steps run."""
    from ppo_critic.tasks import TASKS

    cfg = short_config(tmp_path / "run", f"task.name={name}", "trainer.steps=2", "trainer.gamma=0.9")
    cfg.trainer.export_hf = False
    metrics = train(cfg, out=io.StringIO())
    assert {"eval/ev_true", "eval/mae_true"} <= set(metrics) and metrics["critic/vf_loss"] > 0
    source = train_mod.TaskSource(cfg)
    task = TASKS[name][0](cfg.task_config())
    assert torch.equal(source.eval_batch["true_values"], task.true_values(source.eval_batch, 0.9))
    assert source.eval_name == f"16 held-out rollouts of the {name} task (another seed)"


@pytest.mark.parametrize(
    ("overrides", "shown"),
    [
        ([], "λ 1−1/(0.5·mean l), γ 1"),
        (["trainer.length_adaptive_scope=response", "trainer.gamma=0.9"], "λ 1−1/(0.5·l_γ), γ 0.9"),
        (["trainer.length_adaptive_alpha=null", "trainer.lam=0.7"], "λ 0.7, γ 1"),
    ],
)
def test_the_curves_title_names_the_lambda_rule(overrides, shown):
    cfg = load_config(None, overrides)
    title = train_mod.run_title(cfg, type("Source", (), {"name": "task counting"})())
    assert title.endswith(shown) and "task counting" in title


def test_rollout_n_draws_groups_of_responses_to_one_prompt_and_the_held_out_set_does_not(tmp_path):
    cfg = short_config(tmp_path / "run", "critic.rollout_n=4", "critic.ppo_mini_batch_size=2")
    source = train_mod.TaskSource(cfg)
    width = source.task.prompt_width
    prompts = source.next_batch()["input_ids"][:, :width]
    assert torch.equal(prompts, prompts[::4].repeat_interleave(4, dim=0))
    held_out = source.eval_batch["input_ids"][:, :width]
    assert not torch.equal(held_out[0::4], held_out[1::4])


def _tree(path):
    """Every file under `path` with its bytes (the lock's note of who holds it aside): what a refused command must
    leave as it was."""
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock"
    }


def test_resume_from_an_older_checkpoint_than_the_runs_newest_is_refused_and_a_new_run_may_start_from_it(tmp_path):
    """Issue 43 family 5: resuming step 2 while step 4 exists would replace step 4 and its metrics (it did, saying
    only "resumed from step 2"); now refused before anything moves, and another run_dir can start from step 2."""
    run = tmp_path / "run"
    train(short_config(run), out=io.StringIO())
    older = run / "checkpoints" / "step_00000002"
    before = _tree(run)
    with pytest.raises(
        ValueError, match=r"is step 2, but .* holds newer checkpoints \(step 4\); .*trainer.resume=auto"
    ):
        train(short_config(run, "trainer.steps=6", f"trainer.resume={older}"), out=io.StringIO())
    assert _tree(run) == before
    branch = tmp_path / "branch"
    train(short_config(branch, "trainer.steps=6", f"trainer.resume={older}"), out=io.StringIO())
    rows = [json.loads(line)["step"] for line in (branch / "metrics.jsonl").read_text().splitlines()]
    assert rows == [3, 4, 5, 6] and _tree(run) == before


def test_a_checkpoint_copied_over_another_is_not_resumed_as_the_step_its_name_says(tmp_path):
    """Issue 43 family 5: step_4's files copied into step_2 were resumed as step 4 from "step_2" silently."""
    run = tmp_path / "run"
    train(short_config(run), out=io.StringIO())
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / "step_00000002")
    shutil.copytree(ckpts / "step_00000004", ckpts / "step_00000002")
    shutil.rmtree(ckpts / "step_00000004")
    (ckpts / "latest").unlink(missing_ok=True)
    before = _tree(run)
    out = io.StringIO()
    with pytest.raises(ValueError, match=r"no checkpoint .* verifies \(.*holds step 4 but its name says step 2"):
        train(short_config(run, "trainer.steps=6"), out=out)
    assert "rename it step_00000004 or remove it; trying the checkpoint before it" in out.getvalue()
    assert _tree(run) == before


def test_eval_data_that_is_the_training_rows_is_refused_and_some_rows_in_common_are_said(tmp_path):
    """Issue 43 family 5: eval_data= the training file (or a copy) evaluated trained rows as if held out."""
    data = tmp_path / "rollouts.jsonl"
    rows = write_rollout_file(data, 12)
    copy = tmp_path / "copy.jsonl"
    shutil.copy(data, copy)
    for same in (data, copy):
        with pytest.raises(
            ValueError, match=r"every row of trainer.eval_data=.* is also a row of data=.*drop eval_data"
        ):
            train(short_config(tmp_path / "run", f"data={data}", f"trainer.eval_data={same}"), out=io.StringIO())
    assert not (tmp_path / "run").exists()
    some = tmp_path / "some.jsonl"
    some.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + json.dumps({**rows[0], "reward": 5.0}) + "\n")
    out = io.StringIO()
    train(short_config(tmp_path / "run", f"data={data}", f"trainer.eval_data={some}"), out=out)
    assert f"note: 2 of the 3 rows of eval_data={some} are also rows of data={data}" in out.getvalue()


def test_rows_changed_between_resumes_are_refused_where_the_held_out_split_depends_on_them(tmp_path):
    """Issue 43 family 5: a rollout file that grew between resumes moved the seeded held-out split silently (trained
    rows could land in the "never trained on" set). With eval_data instead, the change is said with its numbers."""
    data = tmp_path / "rollouts.jsonl"
    write_rollout_file(data, 12)
    run = tmp_path / "run"
    train(short_config(run, f"data={data}"), out=io.StringIO())
    before = _tree(run)
    write_rollout_file(data, 16)
    with pytest.raises(ValueError, match=rf"data={data} changed since the checkpoint \(12 rows then, 16 now\): "):
        train(short_config(run, f"data={data}", "trainer.steps=6"), out=io.StringIO())
    assert _tree(run) == before
    other = tmp_path / "eval.jsonl"
    other.write_text(json.dumps({"prompt_ids": [99, 1], "response_ids": [3, 4], "reward": 1.0}) + "\n")
    kept = tmp_path / "kept"
    train(short_config(kept, f"data={data}", f"trainer.eval_data={other}"), out=io.StringIO())
    write_rollout_file(data, 20)
    out = io.StringIO()
    train(short_config(kept, f"data={data}", f"trainer.eval_data={other}", "trainer.steps=6"), out=out)
    assert f"note: data={data} changed since the checkpoint (16 rows then, 20 now); training goes on" in out.getvalue()


def test_a_run_dir_that_is_a_dangling_symlink_is_named_so(tmp_path):
    """Issue 43 family 8: the error was "[Errno 17] cannot create the run directory ...: File exists"."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"trainer.run_dir=.*link is a symlink to .*missing, which does not exist"):
        train(short_config(link), out=io.StringIO())
    assert link.is_symlink() and not (tmp_path / "missing").exists()


GROUPS = ["critic.rollout_n=4", "critic.ppo_mini_batch_size=48"]  # 48 prompts × 4 responses per mini-batch


def test_shared_prefix_returns_average_a_groups_returns_over_its_shared_states():
    """Under `trainer.shared_prefix_returns` a group's rows regress on one target at their shared first position, and
    the targets' total is kept (each state's sum is shared out among the positions that reach it)."""
    cfg = load_config(None, [*GROUPS, "trainer.shared_prefix_returns=true"])
    source = train_mod.TaskSource(cfg)
    batch = source.next_batch()
    values = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(0))
    shared = train_mod.critic_returns(batch, values, cfg.trainer, 1)
    plain = train_mod.critic_returns(batch, values, load_config(None, GROUPS).trainer, 1)
    first = shared[:, 0].view(-1, 4)
    assert torch.equal(first, first[:, :1].expand_as(first))
    unshared = plain[:, 0].view(-1, 4)
    assert not torch.equal(unshared, unshared[:, :1].expand_as(unshared))
    assert torch.allclose(shared.sum(), plain.sum(), rtol=1e-6)  # float32 sums of ~2k terms in another order
    mask = batch["response_mask"].bool()
    assert torch.equal(shared[~mask], torch.zeros_like(shared[~mask]))


def test_under_ema_decay_the_evaluation_also_scores_the_live_weights(tmp_path):
    """`eval/ev_true_live` (`trainer.eval_live_weights`): the live weights' EV beside their average's (a different
    critic after a few updates); the average stays in place for every later call; without `ema_decay` there is no
    such metric."""
    from ppo_critic.config.train import resolve_model

    def built(run_dir, *extra):
        cfg = short_config(run_dir, *extra)
        source = train_mod.TaskSource(cfg)
        cfg = resolve_model(cfg, source.vocab_size, source.max_length)
        return cfg, make_worker(cfg), source

    cfg, worker, source = built(tmp_path / "run", "critic.ema_decay=0.5")
    for _ in range(3):
        train_mod._iteration(worker, source, cfg.trainer)
    average = worker.compute_values(source.eval_batch)
    assert "eval/ev_true_live" not in evaluate(worker, source.eval_batch, gamma=1.0)  # trainer.eval_live_weights
    metrics = evaluate(worker, source.eval_batch, gamma=1.0, live=True)
    assert metrics["eval/ev_true_live"] != metrics["eval/ev_true"]
    assert not torch.equal(worker.compute_live_values(source.eval_batch), average)
    assert torch.equal(worker.compute_values(source.eval_batch), average)
    _, plain, plain_source = built(tmp_path / "plain", "critic.ema_decay=0.0")
    assert "eval/ev_true_live" not in evaluate(plain, plain_source.eval_batch, 1.0, live=True)
