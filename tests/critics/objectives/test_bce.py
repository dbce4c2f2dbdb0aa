"""vf_loss_type=bce: a Bernoulli value for 0/1 rewards (critics/objectives/bce.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import make_batch
from ppo_critic import DataParallelPPOCritic
from ppo_critic.config.critic import CriticConfig
from ppo_critic.critics.objectives import objective_of

BCE = objective_of(CriticConfig(vf_loss_type="bce"))


def test_the_value_is_the_sigmoid_of_the_one_output():
    z = torch.tensor([[-30.0, 0.0, 2.0]])
    assert BCE.outputs == 1 and not BCE.identity
    torch.testing.assert_close(BCE.values(z), torch.sigmoid(z), rtol=0, atol=0)


def test_unclipped_the_loss_is_the_mean_cross_entropy_against_the_return():
    z, mask = torch.randn(3, 4), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    returns = torch.tensor([[0.0, 1.0, 0.7, float("nan")], [0.2, 1.0, 5.0, 0.0], [1.0, 0.0, 0.3, 1.0]])
    loss, clipfrac = BCE.loss(z, returns, torch.full_like(z, 0.5), mask, None)
    target = torch.where(mask.bool(), returns, 0.0)
    expected = F.binary_cross_entropy_with_logits(z, target, reduction="none")[mask.bool()].mean()
    torch.testing.assert_close(loss, expected)
    assert clipfrac == 0


def test_returns_outside_0_1_are_refused_before_any_step_not_clipped(tiny_qwen2):
    """Issue 52: bce clipped returns of another scale (rewards -3..5) in silence; now the update refuses them, naming
    the first and the fix, with the model and optimizer unchanged. Masked positions may hold anything."""
    from conftest import state_hash

    mask = torch.tensor([[1, 1, 0]])
    BCE.check_returns(torch.tensor([[0.0, 1.0, 7.0]]), mask)  # 7 is masked
    with pytest.raises(ValueError, match=r"holds -0.5 at sample 0, response token 1, outside \[0, 1\]"):
        BCE.check_returns(torch.tensor([[1.0, -0.5, 0.0]]), mask)
    model = tiny_qwen2()
    critic = DataParallelPPOCritic(
        {"ppo_mini_batch_size": 8, "vf_loss_type": "bce"}, model, torch.optim.Adam(model.parameters())
    )
    batch = make_batch(8, 6, 5, seed=0)
    batch["returns"] = batch["attention_mask"][:, -5:] * 5.0
    before = state_hash(model, critic.critic_optimizer)
    with pytest.raises(ValueError, match=r"outside \[0, 1\] \(\d+ valid position\(s\) are\): vf_loss_type=bce models"):
        critic.update_critic(batch)
    assert state_hash(model, critic.critic_optimizer) == before


def test_clipping_bounds_the_logit_around_the_old_values_and_stops_the_gradient_beyond():
    old = torch.tensor([[0.5, 0.5]])
    z = torch.tensor([[3.0, 0.1]], requires_grad=True)  # first: 3 logits from the old one; second: within 0.5
    loss, clipfrac = BCE.loss(z, torch.tensor([[0.0, 1.0]]), old, torch.ones(1, 2), 0.5)
    loss.backward()
    assert clipfrac == 0  # the clipped logit 0.5 errs less than 3 against 0: the unclipped loss counts (max)
    assert z.grad[0, 0] > 0 and z.grad[0, 1] < 0
    z2 = torch.tensor([[-3.0]], requires_grad=True)  # moved away from 0 towards the target: clipped at -0.5
    loss2, clipfrac2 = BCE.loss(z2, torch.tensor([[0.0]]), torch.tensor([[0.5]]), torch.ones(1, 1), 0.5)
    loss2.backward()
    torch.testing.assert_close(loss2, F.binary_cross_entropy_with_logits(torch.tensor(-0.5), torch.tensor(0.0)))
    assert clipfrac2 == 1 and z2.grad.abs().sum() == 0
    saturated, _ = BCE.loss(torch.tensor([[40.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), 0.5)
    assert torch.isfinite(saturated)  # an old value of exactly 1: its logit is clamped, the loss stays finite


def test_a_critic_learns_bernoulli_values_of_0_1_rewards(tiny_qwen2):
    model = tiny_qwen2()
    config = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4, "vf_loss_type": "bce", "grad_clip": None}
    critic = DataParallelPPOCritic(config, model, torch.optim.Adam(model.parameters(), lr=3e-3))
    batch = make_batch(8, 6, 5, seed=0)
    mask = batch["attention_mask"][:, -5:]
    batch["returns"] = (torch.arange(8) % 2).float()[:, None].expand(8, 5) * mask
    losses = []
    for _ in range(12):
        batch["values"] = critic.compute_values(batch)
        losses.append(critic.update_critic(batch)["critic/vf_loss"])
    values = critic.compute_values(batch)
    assert ((values > 0) & (values < 1))[mask.bool()].all() and (values[~mask.bool()] == 0).all()
    assert losses[-1] < 0.5 * losses[0]


def test_value_norm_is_refused():
    with pytest.raises(ValueError, match="vf_loss_type=bce works with value_norm off, not running"):
        model = torch.nn.Linear(1, 1)
        DataParallelPPOCritic({"ppo_mini_batch_size": 2, "vf_loss_type": "bce", "value_norm": "running"}, model, None)


def test_megatron_gives_the_data_parallel_critics_bernoulli_values_and_update(tmp_path):
    """The megatron critic (TP = PP = 1, one process) takes its loss and values from the objective too."""
    pytest.importorskip("megatron.core")
    from distributed.test_layouts import torchrun
    from distributed.test_megatron import BASE, HERE, reference

    reference(tmp_path / "reference.pt", {"bce": BASE | {"vf_loss_type": "bce"}}, unit_returns=True)
    out = tmp_path / "out.json"
    argv = (str(HERE / "megatron_worker.py"), str(tmp_path / "reference.pt"), str(out), str(tmp_path / "export"))
    result = torchrun(*argv, nproc=1, env={"MEGATRON_LAYOUTS": "tp1pp1"})
    assert result.returncode == 0, result.stderr[-6000:]
    (row,) = json.loads(out.read_text())
    assert row["round_trip_exact"] and row["values_max_abs"] <= 1e-4 and row["values_after_max_abs"] <= 1e-4, row
    assert row["update_rel"] <= 1e-4 and row["metric_rel"] <= 1e-4 and row["skipped"] == 0, row


def test_values_of_a_bce_export_are_probabilities_as_from_its_run(tmp_path, capsys):
    """An export's config.json names an objective whose outputs are not the values; `ppo-critic values` on it gives
    σ(logit), the run directory's values; the command line cannot say otherwise (issue 52: it gave logits)."""
    from test_cli import run_cli
    from test_train import SHORT, write_rollout_file

    data, run, exported = tmp_path / "rollouts.jsonl", tmp_path / "run", tmp_path / "exported"
    write_rollout_file(data, 12)
    bce = ["critic.vf_loss_type=bce", "critic.value_norm=off"]
    argv = ["train", f"data={data}", f"trainer.run_dir={run}", *SHORT, *bce]
    assert run_cli(argv, capsys)[0] == 0
    assert run_cli(["export", str(run), str(exported)], capsys)[0] == 0
    assert json.loads((exported / "config.json").read_text())["ppo_critic_vf_loss_type"] == "bce"

    def values(source, *extra):
        out = tmp_path / f"values_{len(list(tmp_path.glob('values_*')))}.jsonl"
        code, text = run_cli(["values", str(source), f"data={data}", f"out={out}", *extra], capsys)
        assert code == 0, text
        return torch.tensor([v for line in out.read_text().splitlines() for v in json.loads(line)["values"]])

    from_run, from_export = values(run), values(exported)
    assert ((from_export > 0) & (from_export < 1)).all()
    torch.testing.assert_close(from_export, from_run, rtol=1e-5, atol=1e-5)  # conftest.FP32_REORDERED's bound
    for source in (exported, run):
        out = tmp_path / "logits.jsonl"
        code, text = run_cli(["values", str(source), f"data={data}", f"out={out}", "critic.vf_loss_type=mse"], capsys)
        assert code == 2 and "critic.vf_loss_type: 'bce' -> 'mse'" in text and not out.exists(), text


def test_a_saved_critic_is_read_as_the_objective_it_names(tmp_path):
    """Issue 52, the export's promise beyond `values`: a model directory whose config.json names bce, built as the
    critic of another objective (a worker, or verl's worker handing its module to the critic), would read logits as
    values; refused naming the objective to set. mse and huber read each other's models (one output, the value)."""
    from conftest import TINY
    from ppo_critic.worker import CriticWorker

    base = {"ppo_mini_batch_size": 4, "value_norm": "off"}
    worker = CriticWorker(base | {"vf_loss_type": "bce", "model": {"override_config": {"model_type": "qwen2", **TINY}}})
    worker.export_hf(tmp_path / "bce")
    CriticWorker(base | {"vf_loss_type": "bce", "model": {"path": str(tmp_path / "bce")}})
    message = r"holds a critic of vf_loss_type='bce' \(ppo_critic_vf_loss_type in its config.json\), whose outputs "
    with pytest.raises(ValueError, match=rf"critic.model.path={tmp_path / 'bce'} {message}"):
        CriticWorker(base | {"model": {"path": str(tmp_path / "bce")}})
    from ppo_critic import build_value_model

    model = build_value_model(str(tmp_path / "bce"))
    with pytest.raises(ValueError, match=rf"^the model {message}vf_loss_type='huber' would misread; set vf_loss_type"):
        DataParallelPPOCritic(base | {"vf_loss_type": "huber"}, model, None)
    worker = CriticWorker(base | {"model": {"override_config": {"model_type": "qwen2", **TINY}}})
    worker.export_hf(tmp_path / "mse")
    CriticWorker(base | {"vf_loss_type": "huber", "model": {"path": str(tmp_path / "mse")}})
