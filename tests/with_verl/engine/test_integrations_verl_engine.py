"""verl ≥ 0.9 with `critic.strategy=ppo_critic`: the plugin registers with `import verl` alone (and fails loudly),
verl's config is read as verl reads it, and verl's own `TrainingWorker` running ppo-critic's engine gives the values,
the update and a checkpoint round trip of ppo-critic's `DataParallelPPOCritic` on the same weights and data."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys

import pytest
import torch
from engine_helpers import (
    MEASURED,
    SGD,
    assert_metrics_equal,
    critic_config,
    critic_metrics,
    engine_params,
    infer_values,
    reference,
    train,
    training_worker,
)
from verl.utils.metric import reduce_metrics
from verl.workers.engine.base import BaseEngine
from verl.workers.utils.losses import value_loss
from verl.workers.utils.padding import left_right_2_no_padding

from cuda_contract import Calls, flash_attn_varlen_func
from multimodal import add_images, tiny_qwen2_vl
from ppo_critic import DataParallelPPOCritic, build_value_model
from ppo_critic.algos import compute_gae_advantage_return
from ppo_critic.config.critic import CriticConfig
from ppo_critic.config.env import OPTIONS_ENV
from ppo_critic.integrations.verl_engine import PPOCriticEngine, check_packing, dense_inputs, engine_critic_config
from ppo_critic.models import attention
from ppo_critic.run.checkpoint import export_hf
from verl_shared import MODES, hydra_value, params, rel_change, rollout, save_tiny_critic

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
    monkeypatch.setenv(OPTIONS_ENV, "value_norm=popart")
    assert engine_critic_config(verl.model, engine, verl.optim).value_norm == "popart"
    monkeypatch.setenv(OPTIONS_ENV, "vf_loss_type=huber cliprange_value=0.2")  # verl's loss would never see them
    with pytest.raises(ValueError, match=r"sets cliprange_value, vf_loss_type, which verl decides.*: remove it:"):
        engine_critic_config(verl.model, engine, verl.optim)
    monkeypatch.delenv(OPTIONS_ENV)
    offload = critic_config(model_dir, **{"fsdp.param_offload": True, "fsdp.optimizer_offload": True})
    fsdp_config = engine_critic_config(offload.model, offload.engine, offload.optim).model.fsdp_config
    assert fsdp_config["param_offload"] is True and fsdp_config["optimizer_offload"] is True


@pytest.mark.parametrize(
    "option",
    [
        *("ppo_mini_batch_size=8", "ppo_epochs=2", "shuffle=true data_loader_seed=3", "data_loader_seed=3"),
        *("cliprange_value=0.2", "loss_agg_mode=seq-mean-token-mean", "loss_scale_factor=16"),
    ],
)
def test_an_option_verl_decides_names_verls_key(model_dir, monkeypatch, option):
    """Each is a key of verl 0.9's critic config (its trainer cuts the mini-batches, its value_loss reads the rest)."""
    verl = critic_config(model_dir)
    monkeypatch.setenv(OPTIONS_ENV, option)
    key = option.split("=")[0]
    with pytest.raises(ValueError, match=rf"; instead, {key}: set critic\.{key} in verl's critic config"):
        engine_critic_config(verl.model, verl.engine, verl.optim)


@pytest.mark.parametrize(
    ("mixed", "dtype"),
    [("{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}", "float32"), ("{param_dtype:bf16}", None)],
)
def test_verls_mixed_precision_sets_the_compute_dtype(model_dir, mixed, dtype):
    """`+critic.fsdp.mixed_precision` as verl's hydra config and dataclass carry it (verl's yaml lacks the key)."""
    verl = critic_config(model_dir, **{"+fsdp.mixed_precision": mixed})
    assert engine_critic_config(verl.model, verl.engine, verl.optim).dtype == dtype
    bf16_reduce = critic_config(model_dir, **{"+fsdp.mixed_precision": "{reduce_dtype:bf16}"})
    with pytest.raises(ValueError, match=r"^critic.fsdp.mixed_precision.reduce_dtype='bf16' is not supported .*fp32$"):
        engine_critic_config(bf16_reduce.model, bf16_reduce.engine, bf16_reduce.optim)


def test_ulysses_without_packing_fails_building_the_engine_in_one_line(single_process, model_dir):
    unpacked = {"fsdp.ulysses_sequence_parallel_size": 2, "model.use_remove_padding": False}
    said = r"critic.fsdp.ulysses_sequence_parallel_size=2 needs critic.model.use_remove_padding=true \(Ulysses shards"
    with pytest.raises(ValueError, match=rf"^{said} packed sequences\); set [^\n]*$"):
        training_worker(model_dir, **unpacked)


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


FP32 = {"+fsdp.mixed_precision": "{param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}"}
FIXED = {"+fsdp.use_dynamic_bsz": False, "+fsdp.micro_batch_size_per_gpu": 2}


def test_float32_with_verls_default_packing_runs_where_a_kernel_is_registered(single_process, model_dir, monkeypatch):
    """An all-fp32 critic.fsdp.mixed_precision beside verl's default critic.model.use_remove_padding=true where a
    half-dtype varlen kernel is registered (CUDA's case; here tests/cuda_contract.py's stand-in is the CPU's): the
    engine packs through the bucketed sdpa, never calls the kernel, and gives ppo-critic's own values and update."""
    calls = Calls()
    attention.register()
    monkeypatch.setitem(attention.KERNELS, "cpu", attention.flash_kernel(flash_attn_varlen_func(calls)))
    data = rollout(8, seed=1)
    worker = training_worker(model_dir, **SGD, **FP32, **FIXED, **{"model.use_remove_padding": True})
    assert worker.engine.worker.critic.use_remove_padding
    expected = reference(model_dir, data, mini_batch_size=4)
    torch.testing.assert_close(infer_values(worker, data), expected["values"], **VALUES)
    train(worker, data, mini_batch_size=4)
    assert rel_change(engine_params(worker), expected["after"], expected["before"]) <= LAYOUT
    assert not calls.dtypes


SLIDING = {"sliding_window": 4, "layer_types": ["sliding_attention"] * 2}  # ppo-critic's packed rows run none
VERL_SAID = r"critic.model.use_remove_padding=true: this model cannot run packed rows: [^\n]*sliding-window"


def test_a_model_that_cannot_pack_is_refused_in_verls_keys(single_process, model_dir):
    """verl's use_remove_padding is a boolean (true by default): a model whose attention cannot run packed rows is
    refused when the engine is built, in one line naming verl's key and a value it takes; false runs padded."""
    sliding = {f"+model.override_config.{key}": hydra_value(value) for key, value in SLIDING.items()}
    with pytest.raises(ValueError, match=rf"^{VERL_SAID}[^\n]*; set critic.model.use_remove_padding=false$"):
        training_worker(model_dir, **sliding, **{"model.use_remove_padding": True})
    worker = training_worker(model_dir, **sliding, **{"model.use_remove_padding": False})
    assert not worker.engine.worker.critic.use_remove_padding


def test_a_refusal_of_an_option_ppo_critic_options_set_names_the_variable(single_process, model_dir, monkeypatch):
    """Issue 52: a refusal from building the engine's critic, of an option that came from PPO_CRITIC_OPTIONS (here an
    attention that cannot run verl's packed rows), named neither the variable nor where the option came from."""
    monkeypatch.setenv(OPTIONS_ENV, "model.attn_implementation=eager")
    with pytest.raises(ValueError, match=r"^PPO_CRITIC_OPTIONS='model.attn_implementation=eager': critic.model.use_"):
        training_worker(model_dir, **{"model.use_remove_padding": True})


def test_ulysses_with_a_model_that_cannot_pack_is_refused_in_verls_keys(model_dir):
    config = CriticConfig.from_dict(
        {"ulysses_sequence_parallel_size": 2, "model": {"path": str(model_dir), "override_config": SLIDING}}
    )
    said = "critic.fsdp.ulysses_sequence_parallel_size=2 needs packed rows, which this model cannot run: "
    with pytest.raises(ValueError, match=rf"^{said}[^\n]*; set critic.fsdp.ulysses_sequence_parallel_size=1$"):
        check_packing(config, torch.device("cpu"))


def test_metrics_are_the_mini_batchs_whatever_the_micro_batches(single_process, model_dir):
    """verl's value_loss reports per-micro-batch means; the engine reports each metric over the whole mini-batch
    (token-weighted), so one row per micro-batch, the whole mini-batch at once and a token budget all read the same."""
    data = rollout(8, seed=8)
    layouts = {
        "micro-1": {"+fsdp.use_dynamic_bsz": False, "+fsdp.micro_batch_size_per_gpu": 1},
        # one micro-batch: verl's means are the mini-batch's
        "micro-4": {"+fsdp.use_dynamic_bsz": False, "+fsdp.micro_batch_size_per_gpu": 4},
        "token-budget": {"+fsdp.use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 24},
    }
    got = {
        name: critic_metrics(train(training_worker(model_dir, **SGD, **batching), data, mini_batch_size=4, epochs=2))
        for name, batching in layouts.items()
    }
    assert 0 < got["micro-4"]["critic/vf_clipfrac"] < 1  # the clipping is exercised
    for name in ("micro-1", "token-budget"):
        assert_metrics_equal(got[name], got["micro-4"], name)


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


@pytest.mark.parametrize("options", ["", "value_norm=running"], ids=["plain", "value-norm"])
def test_train_batch_is_verls_base_flow_bit_for_bit(single_process, model_dir, monkeypatch, options):
    """The engine's `train_batch` reads the decision to step, the norm and the metrics at once; verl's base
    `train_batch` (`forward_backward_batch`, then `optimizer_step`) reads them apart. On the same weights and rows
    both give the same parameters and every metric verl's worker reports, bit for bit: two epochs of two
    mini-batches of four micro-batches, then (without `value_norm`) a step skipped for its infinite loss."""
    monkeypatch.setenv(OPTIONS_ENV, options)
    calls = [(rollout(8, seed=6), 4, 2)]
    if not options:
        overflow = rollout(4, seed=4)
        overflow.batch["returns"] = torch.full_like(overflow.batch["returns"], 3e38)
        calls.append((overflow, 4, 1))

    def trained() -> tuple[list[dict], dict]:
        worker = training_worker(model_dir, **SGD, **{"+fsdp.micro_batch_size_per_gpu": 1})
        reported = [train(worker, data, mini_batch_size=size, epochs=epochs) for data, size, epochs in calls]
        exact = [{k: repr(v) for k, v in m.items() if not k.startswith(MEASURED)} for m in reported]  # NaN == NaN
        return exact, engine_params(worker)

    ours = trained()
    monkeypatch.setattr(PPOCriticEngine, "train_batch", BaseEngine.train_batch)
    base = trained()
    assert ours[0] == base[0]
    assert {"grad_norm", "loss", "critic/vf_loss"} <= set(ours[0][0])
    assert all(torch.equal(v, base[1][k]) for k, v in ours[1].items())
    if not options:
        assert ours[0][1]["grad_norm"] == "[nan]"  # the skip is there, and the same


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


def value_norm_reference(model_dir, calls: list, mode: str, probe) -> dict:
    """ppo-critic's own critic under `value_norm=mode`, one `update_critic` per entry of `calls` (each one mini-batch
    of rows: the engine merges each mini-batch's returns before its step, which is such a call); the values of
    `probe` before and after, the parameters and the return statistics."""
    model = build_value_model(str(model_dir))
    config = {"ppo_mini_batch_size": 64, "grad_clip": 1.0, "value_norm": mode}
    critic = DataParallelPPOCritic(config, model, torch.optim.SGD(model.parameters(), lr=SGD["optim.lr"]))
    out = {"before": params(model), "values": critic.compute_values(probe)}
    for data in calls:
        critic.update_critic(data)
    norm = critic.value_norm
    return out | {"after": params(model), "values_after": critic.compute_values(probe), "stats": (norm.mean, norm.std)}


@pytest.mark.parametrize("mode", ["running", "popart"])
def test_value_norm_through_the_engine_is_ppo_critics_own(single_process, model_dir, tmp_path, monkeypatch, mode):
    """Two training calls of two mini-batches each: parameters, return statistics and the raw values equal ppo-critic's
    critic fed the same mini-batches as calls; a checkpoint carries the statistics."""
    monkeypatch.setenv(OPTIONS_ENV, f"value_norm={mode}")
    first, second = rollout(8, seed=11), rollout(8, seed=12)
    for data in (first, second):
        data.batch["returns"] = data.batch["returns"] * 3 + 2  # statistics far from μ = 0, σ = 1
    worker = training_worker(model_dir, **SGD)
    for data in (first, second):
        served = infer_values(worker, data)
        metrics = train(worker, data, mini_batch_size=4)
    halves = [d.select_idxs(rows) for d in (first, second) for rows in (list(range(4)), list(range(4, 8)))]
    expected = value_norm_reference(model_dir, halves, mode, probe=second)
    assert rel_change(engine_params(worker), expected["after"], expected["before"]) <= LAYOUT
    norm = worker.engine.worker.critic.value_norm
    # the same float64 sums merged in the same order: equal to float64 rounding
    torch.testing.assert_close((norm.mean.cpu(), norm.std.cpu()), expected["stats"], rtol=1e-12, atol=0)
    assert metrics["critic/value_norm_std"][-1] == pytest.approx(float(expected["stats"][1]), rel=1e-12)
    if mode == "popart":  # the raw predictions stay when the statistics move: the first step's are those served
        mask = second.batch["response_mask"][:4].bool()
        assert metrics["critic/vpred_mean"][0] == pytest.approx(float(served[:4][mask].mean()), rel=1e-5)
    values = infer_values(worker, second)
    torch.testing.assert_close(values, expected["values_after"], **VALUES)
    assert values[second.batch["response_mask"].bool()].mean() > 1  # raw values: de-normalised (μ ≈ 2)
    worker.save_checkpoint(str(tmp_path / "global_step_2" / "critic"), global_step=2)
    fresh = training_worker(model_dir, **SGD)
    fresh.load_checkpoint(str(tmp_path / "global_step_2" / "critic"))
    assert torch.equal(infer_values(fresh, second), values)


def test_own_targets_through_the_engine_are_the_returns_of_that_lambda(single_process, model_dir, monkeypatch):
    """critic.targets_lam (issue 53) through PPO_CRITIC_OPTIONS: the engine recomputes each mini-batch's returns from
    the token_level_rewards and old values verl hands over; the update is the engine's fed those returns, bit for
    bit. A batch without rewards is refused naming the option."""
    data = rollout(8, seed=21)
    rewards = torch.randn(data.batch["returns"].shape, generator=torch.Generator().manual_seed(21))
    data.batch["token_level_rewards"] = rewards
    fed = copy.deepcopy(data)
    mask = data.batch["response_mask"]
    fed.batch["returns"] = compute_gae_advantage_return(rewards, data.batch["values"], mask, 0.9, 0.5)[1]
    runs = []
    for options, batch in (("targets_lam=0.5 targets_gamma=0.9", data), ("", fed)):
        monkeypatch.setenv(OPTIONS_ENV, options)
        worker = training_worker(model_dir, **SGD)
        metrics = train(worker, batch, mini_batch_size=4, epochs=2)
        runs.append(({k: repr(v) for k, v in metrics.items() if not k.startswith(MEASURED)}, engine_params(worker)))
    (own, own_params), (plain, plain_params) = runs
    assert own == plain and all(torch.equal(v, plain_params[k]) for k, v in own_params.items())
    monkeypatch.setenv(OPTIONS_ENV, "")
    handed = training_worker(model_dir, **SGD)
    train(handed, data, mini_batch_size=4, epochs=2)  # the returns verl handed over: another update
    assert not all(torch.equal(v, engine_params(handed)[k]) for k, v in own_params.items())
    monkeypatch.setenv(OPTIONS_ENV, "targets_lam=1.0")
    worker = training_worker(model_dir, **SGD)
    with pytest.raises(ValueError, match=r"critic.targets_lam=1.0 recomputes .* no token_level_rewards"):
        train(worker, rollout(8, seed=22), mini_batch_size=4)


def test_dense_inputs_are_built_on_the_datas_device():
    """verl may hand the engine CUDA data while tensors made without a device land on the CPU: every tensor built
    from the data is built on its device. Here the data is on the CPU and the default device is `meta`."""
    data = left_right_2_no_padding(rollout(4, seed=9).to_tensordict())
    with torch.device("meta"):
        batch = dense_inputs(data)
    mask = batch["attention_mask"].bool()
    assert mask.device.type == "cpu" and torch.equal(batch["input_ids"][mask], data["input_ids"].values())
    assert torch.equal(batch["position_ids"][mask], data["position_ids"].values())


def vl_model_dir(path) -> tuple:
    """A tiny Qwen2-VL critic exported as ppo-critic exports one (backbone + `value_head.safetensors`), with the
    suite's word-level tokenizer."""
    from transformers import AutoTokenizer

    export_hf(tiny_qwen2_vl(), path)
    AutoTokenizer.from_pretrained(save_tiny_critic(path.parent / "tokenizer")).save_pretrained(path)
    return path


def vl_rollout(model_dir, seed: int) -> tuple:
    """Rollouts with one image per prompt: ppo-critic's layout (mrope position ids [B, 3, T]) and verl 0.9's (the text
    positions first, as a fourth row)."""
    ours = rollout(8, prompt_len=14, seed=seed)
    tensors = dict(ours.batch.items())
    add_images(tensors, build_value_model(str(model_dir)), prompt_len=14, seed=seed)
    ours.non_tensor_batch["multi_modal_inputs"] = tensors.pop("multi_modal_inputs")
    for key, value in tensors.items():
        ours.batch[key] = value
    ours.meta_info["global_token_num"] = ours.batch["attention_mask"].sum(-1).tolist()
    verls = copy.deepcopy(ours)
    text = (ours.batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    verls.batch["position_ids"] = torch.cat([text[:, None], ours.batch["position_ids"]], dim=1)
    return ours, verls


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_multimodal_rollouts_through_the_engine_are_ppo_critics_own(single_process, tmp_path, packed):
    """Images and mrope position ids as verl 0.9 hands them to the engine: the values and one update equal ppo-critic's
    own critic on the same rows."""
    model_dir = vl_model_dir(tmp_path / "vl")
    ours, verls = vl_rollout(model_dir, seed=13)
    worker = training_worker(
        model_dir, **SGD, **{"model.use_remove_padding": packed, "+fsdp.micro_batch_size_per_gpu": 2}
    )
    expected = reference(model_dir, ours, mini_batch_size=4)
    torch.testing.assert_close(infer_values(worker, verls), expected["values"], **VALUES)
    train(worker, verls, mini_batch_size=4)
    assert rel_change(engine_params(worker), expected["after"], expected["before"]) <= LAYOUT
    torch.testing.assert_close(infer_values(worker, verls), expected["values_after"], **VALUES)


def test_a_sequence_over_the_token_budget_names_the_keys_that_set_it(single_process, model_dir):
    """verl's default trainer sets both engine budgets from `ppo_infer_max_token_len_per_gpu` (a key its yaml lacks),
    the legacy one the training budget from `ppo_max_token_len_per_gpu`: the error names the keys, not ppo-critic's."""
    data = rollout(4, seed=6)
    worker = training_worker(model_dir, **SGD, ppo_max_token_len_per_gpu=5, **{"+ppo_infer_max_token_len_per_gpu": 5})
    before = engine_params(worker)
    with pytest.raises(ValueError, match=r"budget is 5 tokens \(\+critic.ppo_infer_max_token_len_per_gpu=N \(verl's"):
        infer_values(worker, data)
    with pytest.raises(ValueError, match=r"under verl's default trainer.*critic.ppo_max_token_len_per_gpu=N under"):
        train(worker, data, mini_batch_size=4)
    assert all(torch.equal(v, before[k]) for k, v in engine_params(worker).items())
