"""bench/ppo_loop.py (issue 42), a few iterations of each kind: the actor learns from its own tokens, the task scores
them, the critic is called as verl calls it, and the Monte-Carlo values are the exact ones where those are known."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import pytest
import torch

from conftest import bench_script
from ppo_critic.tasks import CountingTask, CountingTaskConfig


@pytest.fixture(scope="module")
def loop():
    return bench_script("ppo_loop.py")


def small(loop, **options):
    base = {"batch": 16, "mini_batches": 2, "eval_prompts": 16, "probe_rows": 4, "probe_samples": 4}
    return loop.LoopConfig(**{**base, **options})


def parameters(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def test_a_critic_run_moves_the_actor_on_its_own_scored_tokens_and_calls_the_critic_as_verl_does(loop, tmp_path):
    cfg = small(loop, method="critic:verl_lr1e-3", iterations=2)
    run = loop.Loop(cfg, str(tmp_path))
    calls = []
    worker = run.critic.worker
    compute, update = worker.compute_values, worker.update_critic
    worker.compute_values = lambda batch: calls.append("compute_values") or compute(batch)
    worker.update_critic = lambda batch: calls.append(("update_critic", sorted(batch))) or update(batch)
    before = parameters(run.actor)
    tokens = run.iteration(1)
    assert not torch.equal(parameters(run.actor), before)  # the policy update changed the actor
    assert calls[0] == "compute_values" and calls[1][0] == "update_critic"
    assert {"values", "returns", "responses", "response_mask", "input_ids"} <= set(calls[1][1])
    assert worker.step == 1 and 16 * 4 <= tokens <= 16 * 12  # 16 responses of 4..12 tokens


def test_rollouts_are_the_actors_tokens_from_the_alphabet_scored_by_the_task(loop):
    task = CountingTask()
    actor = loop.build_actor(task.vocab_size, 32, seed=0)
    prompts = task.prompts(64, torch.Generator().manual_seed(0))
    batch = loop.respond(actor, task, 10, prompts, seed=1)
    mask = batch["response_mask"].bool()
    assert (batch["responses"][mask] < 10).all()  # targets and fillers only
    assert torch.equal(mask.sum(-1), prompts[2][1])  # the lengths the prompts ask
    hits = ((batch["responses"] == prompts[2][0][:, None]) & mask).sum(-1)
    reward = batch["token_level_rewards"].sum(-1)
    assert torch.equal(reward, (hits >= 2).float())  # counting's reward, computed from the actor's tokens
    assert 0 < reward.mean() < 1


def test_monte_carlo_values_of_a_uniform_actor_are_the_counting_tasks_exact_values(loop):
    """The first actor is uniform over the 10 ordinary tokens: exactly the counting task at target_prob 0.1, whose
    values are known. K continuations give each value within 5 standard errors (sd <= 0.5 / sqrt(K))."""
    task = CountingTask()
    actor = loop.build_actor(task.vocab_size, 32, seed=0)
    batch = loop.respond(actor, task, 10, task.prompts(6, torch.Generator().manual_seed(1)), seed=2)
    samples = 400
    values = loop.mc_values(actor, task, 10, batch, samples, gamma=1.0, seed=3)
    exact = CountingTask(CountingTaskConfig(target_prob=0.1)).true_values(batch)
    assert (values - exact).abs().max() < 5 * 0.5 / samples**0.5
    assert (values[batch["response_mask"] == 0] == 0).all()


def test_grpo_and_reinforce_advantages_centre_the_outcome_within_a_group_or_the_batch(loop):
    rewards = torch.zeros(4, 3)
    rewards[[0, 3], 2] = 1.0
    batch = {"token_level_rewards": rewards, "response_mask": torch.ones(4, 3, dtype=torch.long)}
    grpo = loop.outcome_advantages(batch, group=2)
    assert grpo[0, 0] > 0 > grpo[1, 0] and grpo[3, 0] > 0 > grpo[2, 0]
    assert torch.allclose(grpo.view(2, 2, 3).sum(1), torch.zeros(2, 3), atol=1e-6)
    batch_mean = loop.outcome_advantages(batch, group=4)
    assert torch.allclose(batch_mean[:, 0], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (1 / 3) ** 0.5, atol=1e-4)


def test_the_policy_loss_clips_the_ratio_and_caps_a_negative_advantage_at_clip_c(loop):
    cfg = loop.LoopConfig()
    mask = torch.ones(1, 1)
    old = torch.zeros(1, 1)
    big = torch.log(torch.tensor([[5.0]]))  # ratio 5
    assert loop.policy_loss(big, old, torch.ones(1, 1), mask, cfg, None).item() == pytest.approx(-1.2)
    assert loop.policy_loss(big, old, -torch.ones(1, 1), mask, cfg, None).item() == pytest.approx(3.0)  # 5 capped
    small_ratio = torch.log(torch.tensor([[0.5]]))
    assert loop.policy_loss(small_ratio, old, -torch.ones(1, 1), mask, cfg, None).item() == pytest.approx(0.8)


def test_short_runs_of_the_critic_free_methods_record_their_curves_and_the_report_tabulates_and_draws_them(
    loop, tmp_path
):
    runs = []
    for name, method, group in (("grpo_n4", "grpo", 4), ("mc", "mc", 1)):
        result = loop.run(small(loop, method=method, group=group, iterations=2, eval_every=1, mc_samples=2))
        assert [step for step, _, _ in result["curve"]] == [0, 1, 2]
        assert result["curve"][2][1] > result["curve"][1][1] > 0  # rollout tokens accumulate
        assert result["probes"] == [] and result["critic_s_per_iteration"] == 0.0
        runs.append({"name": name, **result})
    (tmp_path / "counting.json").write_text(json.dumps({"meta": {}, "results": runs}))
    text = loop.report(tmp_path)
    assert "### counting: target score 0.8 (actor lr 0.001, 16 responses per iteration" in text
    assert "| grpo_n4 | 1 | " in text and "| mc | 1 | " in text and "| reinforce |" not in text
    assert (tmp_path / "counting.png").read_bytes()[:4] == b"\x89PNG"


def test_a_critic_run_probes_the_critic_against_monte_carlo_values_and_times_it(loop):
    result = loop.run(small(loop, method="critic:batch_alpha0.5_lr5e-4", iterations=2, eval_every=2, probe_every=2))
    assert [p["step"] for p in result["probes"]] == [1, 2]
    assert all(p["target_var"] > 0 and p["mse"] >= 0 and p["mc_noise"] >= 0 for p in result["probes"])
    assert 0 < result["critic_s_per_iteration"] < result["wall_s_per_iteration"]
    # the same on the actor's own rollouts, with the values its advantages used; probing leaves the run as it was
    assert [p["step"] for p in result["live_probes"]] == [1, 2]
    assert all(p["target_var"] > 0 and p["mc_noise"] >= 0 for p in result["live_probes"])
    unprobed = loop.run(small(loop, method="critic:batch_alpha0.5_lr5e-4", iterations=2, eval_every=2, probe_every=9))
    assert unprobed["live_probes"][0]["step"] == 1 and len(unprobed["live_probes"]) == 1
    assert unprobed["curve"] == result["curve"]


def test_a_replay_configuration_trains_rows_of_the_last_batches_first_valued_by_the_current_critic(loop, tmp_path):
    cfg = small(loop, method="critic:batch_alpha0.5_lr5e-4_popart_ema_replay96", iterations=3)
    run = loop.Loop(cfg, str(tmp_path))
    worker, seen = run.critic.worker, []
    update = worker.update_critic
    worker.update_critic = lambda batch: seen.append({k: v.clone() for k, v in batch.items()}) or update(batch)
    for step in (1, 2, 3):
        run.iteration(step)
    assert [len(batch["input_ids"]) for batch in seen] == [16, 32, 48]  # every held row, up to replay_rows (96)
    first, second = seen[0]["input_ids"], seen[1]["input_ids"]
    replayed = second[:16]
    assert sorted(map(tuple, replayed.tolist())) == sorted(map(tuple, first.tolist()))  # the first batch, first
    held = sorted(map(tuple, torch.cat([first, second[16:]]).tolist()))
    assert sorted(map(tuple, seen[2]["input_ids"][:32].tolist())) == held  # both earlier batches' fresh rows
    rows = torch.tensor([first.tolist().index(row) for row in replayed.tolist()])
    before = seen[0]["values"].index_select(0, rows)
    assert not torch.allclose(seen[1]["values"][:16], before)  # valued again, by the trained critic


def test_a_critic_mc_run_regresses_the_critic_on_monte_carlo_values_and_not_on_returns(loop, tmp_path):
    run = loop.Loop(small(loop, method="critic_mc:verl_lr1e-3", iterations=1), str(tmp_path))
    worker, seen, drawn = run.critic.worker, [], []
    update, mc = worker.update_critic, run.mc_values
    worker.update_critic = lambda batch: seen.append(batch) or update(batch)
    run.mc_values = lambda batch, step: drawn.append(mc(batch, step)) or drawn[-1]
    run.iteration(1)
    assert len(seen) == 1 and len(drawn) == 1
    assert torch.equal(seen[0]["returns"], drawn[0])  # the critic's targets: the current actor's MC values
    mask = seen[0]["response_mask"].bool()
    values = drawn[0][mask]  # counting: the reward's probability, estimated from 8 continuations each
    assert values.min() >= 0 and values.max() <= 1 and values.max() > 0


def test_monte_carlo_targets_refuse_replayed_rows(loop, tmp_path):
    """A replayed row was written by an older actor: the current one's Monte-Carlo values are not its targets."""
    with pytest.raises(ValueError, match="replayed rows"):  # when the run is built, not after its first iteration
        loop.Loop(small(loop, method="critic_mc:batch_alpha0.5_lr5e-4_popart_ema_replay96"), str(tmp_path))


@pytest.mark.parametrize("method", ["critic", "critic_mc:", "gae", "mc:verl_lr1e-3"])
def test_an_unknown_method_is_refused_by_name(loop, tmp_path, method):
    with pytest.raises(ValueError, match=f"method '{method}'"):
        loop.Loop(small(loop, method=method), str(tmp_path))


def test_a_lone_write_is_refused_instead_of_starting_the_runs(loop, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ppo_loop.py", "--write"])
    with pytest.raises(SystemExit) as stopped:
        loop.main()
    assert stopped.value.code == 2 and "give it with --report" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# issue 53: the discriminating settings and the critic's levers


@pytest.mark.parametrize("task", ["counting_fast", "counting_long", "counting_long_vapo", "dense_long"])
def test_each_discriminating_setting_runs_and_moves_the_actor_and_the_critic(loop, tmp_path, task):
    spec = loop.ACTOR_TASKS[task]
    options = {**loop.setting(spec, loop.argparse.Namespace(iterations=2, actor_lr=None, batch=16, lam=None))}
    options.update(batch=16, eval_prompts=16, probe_rows=4, probe_samples=4)
    run = loop.Loop(loop.LoopConfig(task=task, **{**options, **loop.METHODS["ours-verl"]}), str(tmp_path))
    actor, critic = parameters(run.actor), parameters(run.critic.worker.model)
    tokens = run.iteration(1)
    assert not torch.equal(parameters(run.actor), actor) and not torch.equal(
        parameters(run.critic.worker.model), critic
    )
    lengths = [int(o.split("=")[1]) for o in spec.overrides if "response_len" in o] or [4, 16]
    assert 16 * min(lengths) <= tokens <= 16 * max(lengths)


def test_vapo_lambda_is_one_minus_one_over_alpha_times_each_responses_length(loop):
    mask = loop.prefix_mask(torch.tensor([40, 100, 200]), 200)
    cfg = loop.LoopConfig(lam_alpha=0.05)
    assert torch.allclose(loop.actor_lambda({"response_mask": mask}, cfg, 1.0), torch.tensor([0.5, 0.8, 0.9]))
    assert loop.actor_lambda({"response_mask": mask}, loop.LoopConfig(lam=0.9), 1.0) == 0.9


def test_verl_targets_are_the_returns_of_the_actors_gae_from_the_critics_values(loop, tmp_path):
    """verl's trainer computes advantages and the critic's returns in one GAE call, under the actor's λ."""
    cfg = small(loop, method="critic:verl_lr1e-3", critic_targets="actor", lam=0.8, iterations=1)
    run = loop.Loop(cfg, str(tmp_path))
    seen, update = [], run.critic.worker.update_critic
    run.critic.worker.update_critic = lambda batch: seen.append(batch) or update(batch)
    run.iteration(1)
    batch = seen[0]
    expected = loop.compute_gae_advantage_return(
        batch["token_level_rewards"], batch["values"], batch["response_mask"], 1.0, 0.8
    )[1]
    assert torch.equal(batch["returns"], expected)
    own = loop.critic_returns(batch, batch["values"], run.critic.cfg.trainer, 0)  # verl's configuration: λ 1
    assert not torch.allclose(own, expected)


def test_a_critic_warmup_trains_the_critic_on_the_first_actors_rollouts_and_counts_them(loop, tmp_path):
    """Value pretraining (`+pretrain`): the actor stays for the warm-up iterations, the critic regresses on their
    Monte-Carlo returns (λ 1: the reward-to-go, γ 1 on counting), and their tokens are rollouts spent."""
    changes = {key: value for key, value in loop.LEVERS["ppo-critic+pretrain"].items() if key != "critic_options"}
    changes["critic_warmup"] = 2
    options = ("critic.ppo_mini_batch_size=16", "trainer.replay_rows=0", "trainer.critic_warmup_steps=2")
    run = loop.Loop(small(loop, **{**changes, "critic_options": options}, iterations=3), str(tmp_path))
    seen, update = [], run.critic.worker.update_critic
    run.critic.worker.update_critic = lambda batch: seen.append(batch) or update(batch)
    actor = parameters(run.actor)
    tokens = [run.iteration(step) for step in (1, 2)]
    assert torch.equal(parameters(run.actor), actor) and run.critic.worker.step == 2 and min(tokens) >= 16 * 4
    rewards = seen[0]["token_level_rewards"]
    to_go = rewards.flip(-1).cumsum(-1).flip(-1) * seen[0]["response_mask"]
    assert torch.allclose(seen[0]["returns"], to_go, atol=1e-5)  # returns = advantages + values, in float32
    run.iteration(3)
    assert not torch.equal(parameters(run.actor), actor)


def test_a_critic_started_from_the_actor_holds_the_actors_body_under_a_new_head(loop, tmp_path):
    run = loop.Loop(small(loop, method="critic:verl_lr1e-3", critic_init="actor", iterations=1), str(tmp_path))
    critic = dict(run.critic.worker.model.named_parameters())
    body = {name.removeprefix("model."): p for name, p in run.actor.named_parameters() if name.startswith("model.")}
    shared = [name for name in critic if name.removeprefix("model.") in body]
    assert len(shared) == len(body)  # every weight of the actor's body
    assert all(torch.equal(critic[name], body[name.removeprefix("model.")]) for name in shared)


@pytest.mark.parametrize(
    "options, field",
    [
        ({"method": "grpo", "group": 4, "critic_warmup": 3}, "critic_warmup"),
        ({"method": "mc", "critic_init": "actor"}, "critic_init"),
        ({"critic_targets": "verl"}, "critic_targets='verl'"),
        ({"critic_init": "reward"}, "critic_init='reward'"),
        ({"critic_mini_batches": 5}, "critic_mini_batches=5"),
        ({"critic_targets": "actor", "method": "critic:batch_alpha0.5_lr5e-4_popart_ema_replay96"}, "replayed rows"),
    ],
)
def test_a_lever_the_method_cannot_take_is_refused_naming_it(loop, tmp_path, options, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        loop.Loop(small(loop, **options), str(tmp_path))


def test_a_run_that_stops_at_its_target_ends_at_the_first_evaluation_there(loop, monkeypatch):
    monkeypatch.setitem(loop.ACTOR_TASKS, "counting", dataclasses.replace(loop.ACTOR_TASKS["counting"], target=0.0))
    result = loop.run(small(loop, method="grpo", group=4, iterations=6, eval_every=2, stop_at_target=True))
    assert result["iterations_to_target"] == 0  # already there before the first iteration
    assert result["iterations_run"] == 2 and [step for step, _, _ in result["curve"]] == [0, 2]


def test_a_stored_run_from_before_the_levers_is_the_same_configuration(loop):
    cfg = small(loop, method="grpo", group=4, critic_options=())
    stored = json.loads(json.dumps(dataclasses.asdict(cfg)))
    for key in ("lam_alpha", "critic_targets", "critic_options", "critic_warmup", "critic_init", "stop_at_target"):
        del stored[key]
    assert loop.same_config(stored, cfg)
    assert not loop.same_config({**stored, "critic_warmup": 2}, cfg)
    assert loop.same_config({**stored, "task_overrides": ["task.name=counting"]}, cfg)
    assert not loop.same_config({**stored, "task_overrides": ["task.name=counting", "task.min_count=3"]}, cfg)
    levered = small(loop, critic_options=("critic.ppo_epochs=2",))
    assert loop.same_config(json.loads(json.dumps(dataclasses.asdict(levered))), levered)  # a tuple stored as a list


def test_the_report_sets_ours_against_verls_best_critic_and_grpos_best_n(loop):
    def runs(name, tokens):
        return [{"name": name, "tokens_to_target": None if t is None else t * 1000} for t in tokens]

    results = [
        *runs("verl_lr1e-3_mb2_ep1", [100, 120, None]),
        *runs("verl_lr3e-4_mb1_ep1", [80, 90, 200]),
        *runs("grpo_n4", [400, 300, 500]),
        *runs("ours-verl", [60, 70, 80]),
        *runs("ppo-critic", [None, None, 10]),
    ]
    text = "\n".join(loop.ratios(results))
    assert "verl-best verl_lr3e-4_mb1_ep1 (90k)" in text  # 90 tokens: the best median of the sweep
    assert "- ours-verl: 0.78× verl-best, 0.17× GRPO-best" in text  # 70 / 90, 70 / 400
    assert "- ppo-critic: inf× verl-best" in text  # never at its median
