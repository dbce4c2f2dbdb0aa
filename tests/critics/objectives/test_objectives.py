"""The value-objective seam (critics/objectives/): chosen by name, built in one place, used by the critics; mse and
huber are `compute_value_loss`; an objective of several outputs per token trains in the data-parallel critic."""

from __future__ import annotations

import pytest
import torch

from conftest import bench_script, make_batch
from ppo_critic import DataParallelPPOCritic
from ppo_critic.algos import LOSS_AGG_MODES, compute_value_loss
from ppo_critic.config.critic import CriticConfig
from ppo_critic.config.modes import VALUE_NORM_MODES as VALUE_NORM_ALL
from ppo_critic.config.modes import VF_LOSS_TYPES
from ppo_critic.critics import objectives
from ppo_critic.critics.objectives import objective_of, register
from ppo_critic.critics.value_norm import ValueNormalizer


@pytest.fixture(autouse=True)
def forget_registrations():
    """What a test registers is gone after it: other tests see the built-in objectives only."""
    names, registered = dict(VF_LOSS_TYPES), dict(objectives._REGISTERED)
    yield
    VF_LOSS_TYPES.clear()
    VF_LOSS_TYPES.update(names)
    objectives._REGISTERED.clear()
    objectives._REGISTERED.update(registered)


def _screens():
    return bench_script("screen_levers.py")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_type", ["mse", "huber"])
def test_mse_and_huber_are_compute_value_loss_bit_for_bit(loss_type, mode):
    g = torch.Generator().manual_seed(0)
    v, r, old = (torch.randn(4, 6, generator=g) * 2 for _ in range(3))
    mask = (torch.rand(4, 6, generator=g) > 0.3).long()
    objective = objective_of(CriticConfig(vf_loss_type=loss_type, huber_delta=0.7))
    assert objective.outputs == 1 and objective.identity and objective.values(v) is v
    norm = {"batch_num_tokens": torch.tensor(30.0), "global_batch_size": torch.tensor(5.0), "dp_size": 2}
    got = objective.loss(v, r, old, mask, 0.3, mode, **norm)
    want = compute_value_loss(v, r, old, mask, 0.3, mode, loss_type=loss_type, huber_delta=0.7, **norm)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_an_unknown_name_is_refused_and_a_registered_one_is_a_config_choice():
    with pytest.raises(ValueError, match="vf_loss_type='l1' is unknown"):
        CriticConfig.from_any({"vf_loss_type": "l1"})
    with pytest.raises(ValueError, match="vf_loss_type='l1' is unknown"):
        objective_of(CriticConfig(vf_loss_type="l1"))
    screen = _screens().HLGauss(5, -1.0, 1.0, 0.75)
    register("test_hl_gauss", lambda config: screen)
    assert objective_of(CriticConfig.from_any({"vf_loss_type": "test_hl_gauss"})) is screen


def hl_gauss_critic(tiny_qwen2, **cfg):
    register("test_hl_gauss", lambda config: _screens().HLGauss(7, -2.0, 2.0, 0.75))
    model = tiny_qwen2(head_outputs=7)
    config = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4, "vf_loss_type": "test_hl_gauss", **cfg}
    return DataParallelPPOCritic(config, model, torch.optim.Adam(model.parameters(), lr=3e-3))


@pytest.mark.parametrize("packed", [False, True])
def test_a_head_of_several_outputs_trains_through_the_seam(tiny_qwen2, packed):
    critic = hl_gauss_critic(tiny_qwen2, grad_clip=None, model={"use_remove_padding": packed})
    batch = make_batch(8, 6, 5, seed=0)
    mask = batch["attention_mask"][:, -5:].bool()
    batch["returns"] = torch.linspace(-1.5, 1.5, 8)[:, None].expand(8, 5) * mask
    losses = []
    for _ in range(10):
        batch["values"] = critic.compute_values(batch)
        losses.append(critic.update_critic(batch)["critic/vf_loss"])
    values = critic.compute_values(batch)
    assert values.shape == (8, 5) and (values[mask].abs() < 2).all() and (values[~mask] == 0).all()
    assert losses[-1] < losses[0]


def test_a_head_that_does_not_fit_the_objective_and_popart_for_a_non_affine_value_are_refused(tiny_qwen2):
    with pytest.raises(ValueError, match="needs a value head of 7 outputs per token; the model's has 1"):
        register("test_hl_gauss", lambda config: _screens().HLGauss(7, -2.0, 2.0, 0.75))
        DataParallelPPOCritic({"ppo_mini_batch_size": 2, "vf_loss_type": "test_hl_gauss"}, tiny_qwen2(), None)
    with pytest.raises(ValueError, match="works with value_norm off or running, not popart"):
        hl_gauss_critic(tiny_qwen2, value_norm="popart")
    norm = ValueNormalizer("running")
    with pytest.raises(ValueError, match="rescale a head of one output, this one has 7"):
        norm.fold_into(torch.nn.Linear(4, 7))


def test_megatron_refuses_an_objective_of_several_outputs():
    from ppo_critic.backends.megatron.critic import MegatronPPOCritic
    from ppo_critic.config.critic import RankSizes

    register("test_hl_gauss", lambda config: _screens().HLGauss(7, -2.0, 2.0, 0.75))
    config = CriticConfig.from_any({"ppo_mini_batch_size": 2, "vf_loss_type": "test_hl_gauss"})
    with pytest.raises(ValueError, match="strategy=megatron builds a value head of one output per token"):
        MegatronPPOCritic.of(config, RankSizes.as_given(config, 1), [torch.nn.Linear(2, 1)], object())


def test_the_export_holds_a_head_of_several_outputs_as_it_is_and_names_its_objective(tmp_path):
    """value_norm off: the head exported as it is, its objective in config.json; a critic of that objective built
    from the export gives the same values. Under value_norm the fold refuses it (test above)."""
    from transformers import AutoConfig

    from conftest import TINY
    from ppo_critic.worker import CriticWorker

    register("test_hl_gauss", lambda config: _screens().HLGauss(7, -2.0, 2.0, 0.75))
    config = {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2, "vf_loss_type": "test_hl_gauss"}
    worker = CriticWorker(config | {"model": {"override_config": {"model_type": "qwen2", **TINY}}}, total_steps=1)
    batch = make_batch(4, 6, 5, seed=1)
    worker.update_critic(batch)
    worker.export_hf(tmp_path / "export")
    exported = AutoConfig.from_pretrained(tmp_path / "export")
    assert exported.num_labels == 7 and exported.ppo_critic_vf_loss_type == "test_hl_gauss"
    again = CriticWorker(config | {"model": {"path": str(tmp_path / "export")}})
    torch.testing.assert_close(again.compute_values(batch), worker.compute_values(batch), rtol=1e-5, atol=1e-5)


def test_register_refuses_what_would_change_other_runs_or_fail_later(tiny_qwen2):
    """Issue 52: `register` took over a built-in name for the whole process without a word; a build returning None
    failed with an AttributeError deep in the update, an objective of 0 outputs trained a NaN loss. Each is now a
    one-line refusal naming the objective, before anything changes."""
    from ppo_critic.critics.objectives.mse import SquaredError

    for name in ("mse", "huber", "bce"):
        with pytest.raises(ValueError, match=f"vf_loss_type='{name}' is built in; register your objective under"):
            register(name, lambda config: SquaredError())
    with pytest.raises(TypeError, match="build must be a function of the critic config"):
        register("test_not_callable", SquaredError())
    with pytest.raises(ValueError, match="must be an identifier"):
        register("two words", lambda config: SquaredError())
    assert objective_of(CriticConfig(vf_loss_type="mse")).loss_type == "mse"  # still the built-in

    class NoOutputs(SquaredError):
        outputs = 0

    register("test_none", lambda config: None)
    register("test_no_outputs", lambda config: NoOutputs())
    cases = {"test_none": (TypeError, "its build returned NoneType, not a ValueObjective")}
    cases["test_no_outputs"] = (ValueError, "its objective has outputs=0; a value head gives a positive integer")
    model = tiny_qwen2()
    for name, (error, message) in cases.items():
        with pytest.raises(error, match=f"vf_loss_type='{name}': {message}"):
            DataParallelPPOCritic({"ppo_mini_batch_size": 2, "vf_loss_type": name}, model, None)


def test_an_export_that_would_fold_statistics_into_a_non_value_head_is_refused_before_training(tmp_path):
    """value_norm=running with an objective whose head output is not the value trains, but its export's fold would
    give wrong values: refused when the trainer starts (it failed at the last step, after the whole run), and by
    `export_hf` before anything is written. PopArt with such an objective is refused at construction."""
    from ppo_critic.cli import load_config
    from ppo_critic.train import train
    from test_train import SHORT

    register("test_hl_gauss", lambda config: _screens().HLGauss(7, -2.0, 2.0, 0.75))
    options = [*SHORT, f"trainer.run_dir={tmp_path / 'run'}", "critic.vf_loss_type=test_hl_gauss"]
    message = "an HF export folds value_norm=running's statistics into the value head, which needs a head whose one"
    with pytest.raises(ValueError, match=message):
        train(load_config(None, [*options, "critic.value_norm=running", "critic.ema_decay=0"]))
    assert not (tmp_path / "run").exists()
    train(load_config(None, [*options, "critic.value_norm=running", "trainer.export_hf=false", "critic.ema_decay=0"]))
    assert not (tmp_path / "run" / "hf").exists()

    class Logit(_screens().HLGauss):
        value_norms = VALUE_NORM_ALL

    register("test_any_norm", lambda config: Logit(7, -2.0, 2.0, 0.75))
    with pytest.raises(ValueError, match="works with value_norm off or running, not popart"):
        train(load_config(None, [*options[:-1], "critic.vf_loss_type=test_any_norm", "trainer.run_dir=x"]))
