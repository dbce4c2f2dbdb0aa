"""verl ≥ 0.9's offload through ppo-critic's engine: `critic.fsdp.param_offload` / `optimizer_offload` reach the
engine; under verl's own `TrainingWorker` the values, the update and a checkpoint are those without offload; the
modes load what rests in host memory and offload it after (not under `disable_auto_offload`); `to()` moves on request.

verl's device in this suite is the CPU, where offload has nothing to free; `host_apart` makes it stand in for a GPU, so
state moves for real, as copies. The engine trains under DDP here (`PPO_CRITIC_OPTIONS=strategy=ddp`), whose
parameters visibly hand their values to the host; FSDP2 moves by `module.to`, which only a GPU shows (the CUDA test)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import critic_config, infer_values, train, training_worker

from ppo_critic.config.env import OPTIONS_ENV
from ppo_critic.integrations.verl_engine import engine_critic_config
from ppo_critic.parallel import offload
from verl_shared import params, rel_change, rollout

OFFLOAD = {"fsdp.param_offload": True, "fsdp.optimizer_offload": True}
ADAMW = {"optim.lr": 1e-2}  # verl's default optimizer: moments to move
REST = {"model": True, "optimizer": True}  # what rests on the host between calls
LAYOUT = 1e-5  # DESIGN §6: the same update in another summation order
VALUES = {"rtol": 1e-5, "atol": 1e-6}  # the same values in another summation order (conftest.FP32_REORDERED's reason)


@pytest.fixture
def host_apart(monkeypatch):
    """The CPU standing in for a GPU: offload takes effect, and state moves into separate host tensors."""
    monkeypatch.setattr(offload, "frees_device_memory", lambda device: True)


@pytest.fixture
def ddp(monkeypatch):
    monkeypatch.setenv(OPTIONS_ENV, "strategy=ddp")


def resident_params(worker) -> dict[str, torch.Tensor]:
    """The engine's parameters (CPU copies), read on its device whatever rests where."""
    engine = worker.engine
    with engine.worker.offload.resident(model=True):
        return params(engine.worker.model)


def parked(engine) -> bool:
    return all(p.numel() == 0 for p in engine.worker.model.parameters())


def test_verls_offload_keys_reach_the_engine(model_dir, monkeypatch):
    verl = critic_config(model_dir, **OFFLOAD)
    ours = engine_critic_config(verl.model, verl.engine, verl.optim)
    assert ours.model.fsdp_config == {"param_offload": True, "optimizer_offload": True, "offload_policy": False}
    policy = critic_config(model_dir, **{"fsdp.offload_policy": True})
    assert engine_critic_config(policy.model, policy.engine, policy.optim).model.fsdp_config["offload_policy"]
    monkeypatch.setenv(OPTIONS_ENV, "strategy=fsdp")
    with pytest.raises(ValueError, match=r"param_offload=true is not supported with strategy=fsdp; use strategy"):
        engine_critic_config(verl.model, verl.engine, verl.optim)


def test_offload_through_verls_worker_keeps_values_update_and_checkpoint(
    single_process, model_dir, host_apart, ddp, tmp_path
):
    """What rests where, when; and the same values and update as without offload. Not bit for bit: the weights
    loaded from safetensors sit off the 64-byte boundary their host copies get, and the CPU's vectorised
    kernels split some sums differently by alignment (measured: 2e-7 relative, in the second step). A checkpoint
    loaded into another offloaded engine gives the values exactly."""
    data = rollout(8, seed=1)
    offloaded, resident = training_worker(model_dir, **ADAMW, **OFFLOAD), training_worker(model_dir, **ADAMW)
    before = resident_params(resident)
    engine = offloaded.engine
    assert engine.is_param_offload_enabled and engine.is_optimizer_offload_enabled
    assert engine.worker.offload.on_host == REST and parked(engine)  # from `reset` on
    seen: list[tuple[str, dict]] = []
    engine.worker.model.register_forward_pre_hook(
        lambda m, a: seen.append(("forward", dict(engine.worker.offload.on_host)))
    )
    engine.worker.optimizer.register_step_pre_hook(
        lambda o, a, k: seen.append(("step", dict(engine.worker.offload.on_host)))
    )
    torch.testing.assert_close(infer_values(offloaded, data), infer_values(resident, data), **VALUES)
    assert seen and all(s == ("forward", {"model": False, "optimizer": True}) for s in seen)  # eval: the model only
    assert engine.worker.offload.on_host == REST and parked(engine)
    seen.clear()
    train(offloaded, data, mini_batch_size=4)
    train(resident, data, mini_batch_size=4)
    assert {what for what, _ in seen} == {"forward", "step"}
    assert all(where == {"model": False, "optimizer": False} for _, where in seen)
    assert engine.worker.offload.on_host == REST and parked(engine)
    assert rel_change(resident_params(offloaded), resident_params(resident), before) <= LAYOUT
    values = infer_values(offloaded, data)
    torch.testing.assert_close(values, infer_values(resident, data), **VALUES)
    offloaded.save_checkpoint(str(tmp_path / "global_step_1" / "critic"), global_step=1)
    assert engine.worker.offload.on_host == REST
    fresh = training_worker(model_dir, **ADAMW, **OFFLOAD)
    fresh.load_checkpoint(str(tmp_path / "global_step_1" / "critic"))
    assert fresh.engine.worker.offload.on_host == REST
    assert torch.equal(infer_values(fresh, data), values)


def test_the_modes_and_to_move_what_verl_asks(single_process, model_dir, host_apart, ddp, monkeypatch):
    worker = training_worker(model_dir, **ADAMW, **OFFLOAD)
    engine = worker.engine
    on_host = engine.worker.offload.on_host
    with engine.train_mode(disable_auto_offload=True):  # verl's worker inside a mode it entered itself
        assert on_host == REST
    with engine.train_mode():
        assert on_host == {"model": False, "optimizer": False} and not parked(engine)
    assert on_host == REST and parked(engine)
    with engine.eval_mode():
        assert on_host == {"model": False, "optimizer": True}
    assert on_host == REST
    worker.to("device", model=True, optimizer=False, grad=True)  # verl's device: the CPU here, the engine's own
    assert on_host == {"model": False, "optimizer": True}
    monkeypatch.setattr(engine, "device", torch.device("cuda", 0))  # now as on a GPU ("cpu" is then the host)
    engine.to("cpu", model=True, optimizer=True)
    assert on_host == REST
    engine.to("cuda", model=False, optimizer=True, grad=False)
    assert on_host == {"model": True, "optimizer": False}
    with pytest.raises(ValueError, match="moves gradients with their parameters: grad=True needs model=True"):
        engine.to("cpu", model=False, optimizer=True, grad=True)
    with pytest.raises(ValueError, match=r"moves its state to cuda:0 or the CPU, not to meta"):
        engine.to("meta")


@pytest.mark.cuda
def test_on_cuda_verls_offload_frees_the_gpu_between_calls_and_trains_the_same(single_process, model_dir):
    """FSDP2 in float32 on both sides: only the order of atomic adds (the embedding's backward) differs, the same
    update in another summation order (LAYOUT)."""
    data = rollout(8, seed=1)
    settings = {**ADAMW, "fsdp.dtype": "float32"}
    offloaded, resident = training_worker(model_dir, **settings, **OFFLOAD), training_worker(model_dir, **settings)
    engine = offloaded.engine
    before = resident_params(resident)
    torch.testing.assert_close(infer_values(offloaded, data).cpu(), infer_values(resident, data).cpu(), **VALUES)
    train(offloaded, data, mini_batch_size=4)
    train(resident, data, mini_batch_size=4)
    assert rel_change(resident_params(offloaded), resident_params(resident), before) <= LAYOUT
    assert all(p.device.type == "cpu" for p in engine.worker.model.parameters())
    state = [t for s in engine.worker.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert state and all(t.device.type == "cpu" for t in state)
    held = torch.cuda.memory_allocated()
    engine.to("cuda")  # (verl's own `to("device")` names the suite's CPU platform: verl_cpu)
    moved = [*engine.worker.model.parameters(), *(t for t in state if t.dim())]
    # each tensor's block is rounded up to 512 bytes by the caching allocator: at least what moved came back
    assert torch.cuda.memory_allocated() - held >= sum(getattr(t, "_local_tensor", t).nbytes for t in moved)
    engine.to("cpu")
    assert torch.cuda.memory_allocated() == held
