"""verl ≥ 0.9 with `critic.strategy=ppo_critic`: the plugin registers with `import verl` alone (and fails loudly),
verl's config is read as verl reads it, and verl's own `TrainingWorker` running ppo-critic's engine gives the values,
the update and a checkpoint round trip of ppo-critic's `DataParallelPPOCritic` on the same weights and data."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from engine_helpers import SGD, critic_config, engine_params, infer_values, reference, train, training_worker
from verl.utils.metric import reduce_metrics
from verl.workers.utils.losses import value_loss

from ppo_critic.config.env import OPTIONS_ENV
from ppo_critic.integrations.verl_engine import engine_critic_config
from verl_shared import MODES, rel_change, rollout

LAYOUT = 1e-5  # DESIGN §6: one update at any layout equals the single-process update to this relative error
# the same rows with padding elsewhere (verl's nested rows are padded on the right, the reference's prompts on the
# left): the same sums in another order, fp32 rounding apart
VALUES = {"rtol": 1e-5, "atol": 1e-6}


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh Python process, as a Ray worker of verl's starts (verl's own platform detection)."""
    inherited = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        env={**inherited, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_plugin_registers_with_import_verl_alone():
    probe = (
        "import verl\nfrom verl.workers.engine import EngineRegistry\n"
        "engines = EngineRegistry._engines['value_model']['ppo_critic']\n"
        "print(sorted(engines), {c.__module__ for c in engines.values()})"
    )
    result = run(probe)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("['cpu', 'cuda'] {'ppo_critic.integrations.verl_engine'}")
    off = run(probe, VERL_USE_EXTERNAL_PLUGINS="none")  # verl's own switch
    assert off.returncode != 0 and "KeyError: 'ppo_critic'" in off.stderr


def test_a_broken_install_is_loud_and_leaves_verls_engines_alone():
    broken = "import sys\nsys.modules['ppo_critic.integrations.verl_engine'] = None\n"  # its import now fails
    result = run(broken + "import verl.workers.engine\nprint('verl works')")
    assert result.returncode == 0 and result.stdout.strip() == "verl works", result.stderr[-3000:]
    said = "ppo-critic's verl engine (critic.strategy=ppo_critic) could not be registered: ModuleNotFoundError"
    assert "ERROR:" in result.stderr and f"RuntimeWarning: {said}" in result.stderr
    assert "pip install 'ppo-critic[verl]'" in result.stderr


def test_verls_config_is_read_as_verl_reads_it(model_dir, monkeypatch):
    settings = {
        "+fsdp.use_dynamic_bsz": False,
        "+fsdp.micro_batch_size_per_gpu": 3,
        "fsdp.ulysses_sequence_parallel_size": 2,
        "model.use_remove_padding": True,
        "model.enable_gradient_checkpointing": False,
        "optim.lr": 3e-4,
        "optim.betas": "[0.8,0.95]",
        "optim.lr_scheduler_type": "cosine",
        "optim.total_training_steps": 100,
        "optim.clip_grad": 0.7,
        "ppo_max_token_len_per_gpu": 4096,
    }
    verl = critic_config(model_dir, **settings)
    engine = verl.engine
    engine.max_token_len_per_gpu = verl.ppo_max_token_len_per_gpu
    ours = engine_critic_config(verl.model, engine, verl.optim)
    assert (ours.use_dynamic_bsz, ours.ppo_micro_batch_size_per_gpu) == (False, 3)
    assert (ours.ppo_max_token_len_per_gpu, ours.ulysses_sequence_parallel_size, ours.grad_clip) == (4096, 2, 0.7)
    assert ours.model.use_remove_padding and not ours.model.enable_gradient_checkpointing
    assert ours.model.path == str(model_dir) and ours.strategy == "fsdp2"
    assert (ours.optim.lr, tuple(ours.optim.betas), ours.optim.warmup_style) == (3e-4, (0.8, 0.95), "cosine")
    assert ours.optim.total_training_steps == 100 and ours.dtype is None  # bf16 on CUDA, fp32 on CPU
    monkeypatch.setenv(OPTIONS_ENV, "ema_decay=0.9 strategy=ddp")
    assert engine_critic_config(verl.model, engine, verl.optim).ema_decay == 0.9
    monkeypatch.setenv(OPTIONS_ENV, "value_norm=running")
    with pytest.raises(ValueError, match="value_norm='running' is not supported by the ppo_critic engine yet"):
        engine_critic_config(verl.model, engine, verl.optim)
    monkeypatch.delenv(OPTIONS_ENV)
    offload = critic_config(model_dir, **{"fsdp.param_offload": True})
    with pytest.raises(ValueError, match=r"does not support critic.fsdp.param_offload=true yet"):
        engine_critic_config(offload.model, offload.engine, offload.optim)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("micro", [None, 2], ids=["token-budget", "micro-2"])
def test_values_update_and_checkpoint_equal_ppo_critics_own(single_process, model_dir, tmp_path, packed, micro):
    data = rollout(8, seed=1)
    batching = {"+fsdp.use_dynamic_bsz": micro is None, "ppo_max_token_len_per_gpu": 24}
    if micro:
        batching["+fsdp.micro_batch_size_per_gpu"] = micro
    worker = training_worker(model_dir, **SGD, **batching, **{"model.use_remove_padding": packed})
    assert type(worker.engine).__name__ == "PPOCriticEngine"
    expected = reference(model_dir, data, mini_batch_size=4)
    torch.testing.assert_close(infer_values(worker, data), expected["values"], **VALUES)
    metrics = train(worker, data, mini_batch_size=4)
    assert rel_change(engine_params(worker), expected["after"], expected["before"]) <= LAYOUT
    assert len(metrics["grad_norm"]) == 2 and all(torch.isfinite(torch.tensor(metrics["grad_norm"])))
    reduced = reduce_metrics(metrics)  # what verl's trainer does with them
    assert all(math.isfinite(reduced[k]) for k in ("critic/vf_loss", "critic/vf_clipfrac", "loss", "lr"))
    after = infer_values(worker, data)
    torch.testing.assert_close(after, expected["values_after"], **VALUES)
    worker.save_checkpoint(str(tmp_path / "global_step_1" / "critic"), global_step=1)
    fresh = training_worker(model_dir, **SGD, **batching, **{"model.use_remove_padding": packed})
    fresh.load_checkpoint(str(tmp_path / "global_step_1" / "critic"))
    assert torch.equal(infer_values(fresh, data), after)


@pytest.mark.parametrize("mode", MODES)
def test_every_loss_mode_through_verls_loss(single_process, model_dir, mode):
    """verl's value_loss with the engine's global denominators gives ppo-critic's own update in each mode."""
    data = rollout(8, seed=2)
    worker = training_worker(model_dir, **SGD, loss_agg_mode=mode, **{"+fsdp.micro_batch_size_per_gpu": 1})
    expected = reference(model_dir, data, mini_batch_size=8, loss_agg_mode=mode, ppo_micro_batch_size_per_gpu=4)
    train(worker, data, mini_batch_size=8)
    assert rel_change(engine_params(worker), expected["after"], expected["before"]) <= LAYOUT


def test_moving_average_values_in_eval_mode(single_process, model_dir, monkeypatch):
    monkeypatch.setenv(OPTIONS_ENV, "ema_decay=0.5")
    data = rollout(8, seed=3)
    worker = training_worker(model_dir, **SGD)
    expected = reference(model_dir, data, mini_batch_size=4, ema_decay=0.5)
    train(worker, data, mini_batch_size=4)
    torch.testing.assert_close(infer_values(worker, data), expected["values_after"], **VALUES)
    assert not torch.allclose(infer_values(worker, data), expected["values"])


def test_a_non_finite_step_is_skipped(single_process, model_dir):
    """Returns that overflow make the loss and gradient infinite: the step is skipped (NaN grad_norm), the weights
    stay, and the next batch trains."""
    data = rollout(4, seed=4)
    worker = training_worker(model_dir, **SGD)
    before = engine_params(worker)
    data.batch["returns"] = torch.full_like(data.batch["returns"], 3e38)
    metrics = train(worker, data, mini_batch_size=4)
    assert not math.isfinite(metrics["grad_norm"][0])
    assert all(torch.equal(v, before[k]) for k, v in engine_params(worker).items())
    assert math.isfinite(train(worker, rollout(4, seed=5), mini_batch_size=4)["grad_norm"][0])


def test_keeps_the_newest_checkpoints_it_wrote(single_process, model_dir, tmp_path):
    worker = training_worker(model_dir, **SGD)
    for step in (1, 2, 3):
        worker.save_checkpoint(str(tmp_path / f"global_step_{step}" / "critic"), global_step=step, max_ckpt_to_keep=2)
    kept = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("global_step_*/critic/step_*"))
    assert kept == ["global_step_2/critic/step_00000002", "global_step_3/critic/step_00000003"]
    pointers = {p.parent.parent.name: p.read_text().strip() for p in tmp_path.glob("global_step_*/critic/latest")}
    assert pointers == {"global_step_2": "step_00000002", "global_step_3": "step_00000003"}  # none left dangling


@pytest.mark.cuda
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_on_cuda_verls_loss_gets_the_micro_batch_on_the_values_device(single_process, model_dir, packed):
    """verl's value_loss reads the micro-batch's returns and masks beside the engine's values: on a GPU both must be
    CUDA tensors (verl's own engine moves each micro-batch to the device first), and the update matches ppo-critic's
    own float32 critic to bf16 precision."""
    data = rollout(8, seed=1)
    settings = {**SGD, "model.use_remove_padding": packed}
    worker = training_worker(model_dir, **settings)
    assert worker.engine.device.type == "cuda"
    devices = set()

    def checked_loss(model_output, data, dp_group=None):
        devices.update(t.device for t in (model_output["values"], *data.values()) if isinstance(t, torch.Tensor))
        config = critic_config(model_dir, **settings)
        return value_loss(config=config, model_output=model_output, data=data, dp_group=dp_group)

    worker.set_loss_fn(checked_loss)
    expected = reference(model_dir, data, mini_batch_size=8)
    # bf16 autocast on the GPU against float32 on the CPU: a few bf16 ulps (2**-9) of values of magnitude < 0.5
    torch.testing.assert_close(infer_values(worker, data).cpu(), expected["values"], rtol=0, atol=2e-2)
    metrics = train(worker, data, mini_batch_size=8)
    assert devices == {worker.engine.device} and all(torch.isfinite(torch.tensor(metrics["grad_norm"])))
    # bf16 gradients against float32 ones: each a few bf16 roundings (2**-8 relative) off; 5 % of the whole update
    # leaves room for cancellation, while a wrong mask or denominator is off by 100 % (a bound to measure on the GPU)
    assert rel_change(engine_params(worker), expected["after"], expected["before"]) <= 0.05
