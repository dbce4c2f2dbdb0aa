"""parallel.offload: verl's `param_offload` / `optimizer_offload` — what rests in host memory between calls, what is on
the device in them, and that a round trip changes no bit: of the parameters, gradients, optimizer state and moving
average, of DDP's gradient averaging, of the update, the values, a checkpoint and an export.

On the CPU the host is the compute device, so phase offload moves nothing there (accepted, a no-op); the tests here
make the CPU stand in for a GPU (`host_apart`), so every move happens for real, as copies into separate tensors. The
CUDA tests run the real thing (`bench/gpu/run.sh`)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from conftest import FP32_REORDERED, exported_values, make_batch, state_hash, tiny_config
from ppo_critic.backends.data_parallel.fsdp import shard
from ppo_critic.parallel import offload
from ppo_critic.parallel.mesh import BACKEND_CUDA
from ppo_critic.parallel.offload import Offloader, PhaseOffload
from ppo_critic.worker import CriticWorker, worker_config

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
BOTH = {"param_offload": True, "optimizer_offload": True}


@pytest.fixture
def host_apart(monkeypatch):
    """The CPU standing in for a GPU: phase offload takes effect, and state moves into separate host tensors."""
    monkeypatch.setattr(offload, "frees_device_memory", lambda device: True)


@pytest.fixture
def group(request):
    """A one-process group of the backend `request.param` (None: no group), destroyed after the test."""
    backend = getattr(request, "param", None)
    if backend is not None:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    yield
    if backend is not None:
        dist.destroy_process_group()


def config(strategy: str = "none", ema_decay: float = 0.0, dtype: str | None = None, **fsdp: bool) -> dict:
    """A worker config: the tiny model, AdamW (state to move), two steps per update."""
    model = {"override_config": tiny_config("qwen2"), "value_head_init": "normal:0.3", "fsdp_config": fsdp}
    return {
        "strategy": strategy,
        "ppo_mini_batch_size": 4,
        "cliprange_value": None,
        "ema_decay": ema_decay,
        "dtype": dtype,
        "model": model,
        "optim": {"lr": 1e-2},
    }


def trained(worker: CriticWorker, seed: int) -> torch.Tensor:
    """One round of the PPO loop: values of a fresh batch, then an update on it; the values."""
    batch = make_batch(8, 6, 5, seed=seed)
    batch["values"] = worker.compute_values(batch)
    worker.update_critic(batch)
    return batch["values"]


def full_parameters(worker: CriticWorker) -> dict[str, torch.Tensor]:
    """The whole model's parameters as CPU copies (brought to the device for the read when they rest on the host)."""
    with worker.offload.resident(model=True):
        full = get_model_state_dict(worker.model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().cpu().clone() for k, v in full.items()}


def parked(model: torch.nn.Module) -> bool:
    """Whether every parameter has handed its values to the host (plain / DDP: empty, on its device and dtype)."""
    return all(p.numel() == 0 and p.grad is None for p in model.parameters())


def loss_of(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    batch = make_batch(4, seed=seed)
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.square().mean()


# --- what the config asks for ---


def test_verls_keys_take_effect_where_they_free_device_memory():
    gpu = torch.device("cuda", 0)
    assert PhaseOffload.of(BOTH, gpu) == PhaseOffload(params=True, optimizer=True)
    assert PhaseOffload.of({"optimizer_offload": True}, gpu) == PhaseOffload(optimizer=True)
    assert PhaseOffload.of(BOTH, CPU) == PhaseOffload()  # the host is the device: nothing to free
    assert PhaseOffload.of({**BOTH, "offload_policy": True}, gpu) == PhaseOffload()  # on the CPU already (as verl)


def test_on_a_cpu_run_verls_offload_keys_are_accepted_and_move_nothing():
    worker = CriticWorker(config(**BOTH), device="cpu")
    assert worker.phases == PhaseOffload() and worker.offload.on_host == {"model": False, "optimizer": False}
    trained(worker, seed=0)
    assert not any(p.numel() == 0 for p in worker.model.parameters())


@pytest.mark.parametrize(
    ("strategy", "fsdp", "message"),
    [
        ("fsdp", {"param_offload": True}, "model.fsdp_config.param_offload=true is not supported with strategy=fsdp;"),
        ("megatron", {"optimizer_offload": True}, "optimizer_offload=true is not supported with strategy=megatron;"),
        ("ddp", {"offload_policy": True}, "offload_policy=true needs strategy=fsdp2 (FSDP2's CPUOffloadPolicy)"),
        ("none", {"param_offload": "yes"}, "model.fsdp_config.param_offload='yes' must be true or false"),
    ],
)
def test_offload_keys_are_refused_where_they_cannot_apply(strategy, fsdp, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        worker_config({"strategy": strategy, "model": {"fsdp_config": fsdp}})


@pytest.mark.parametrize("strategy", ["none", "ddp", "fsdp2"])
def test_offload_keys_are_accepted_where_they_apply(strategy):
    assert worker_config({"strategy": strategy, "model": {"fsdp_config": BOTH}}).model.fsdp_config == BOTH


# --- the mover ---


def test_a_round_trip_restores_parameters_gradients_optimizer_state_and_companions_bit_for_bit(tiny_qwen2):
    model = tiny_qwen2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model).backward()
    optimizer.step()
    loss_of(model, seed=1).backward()  # gradients in flight too
    average = [p.detach() + 1 for p in model.parameters()]
    params, grads, averaged = list(model.parameters()), [p.grad.clone() for p in model.parameters()], list(average)
    before, states = state_hash(model, optimizer), [dict(s) for s in optimizer.state.values()]
    mover = Offloader(model, optimizer, CPU, [average])
    mover.to_host()
    assert mover.on_host == {"model": True, "optimizer": True} and parked(model)
    assert all((p.device, p.dtype) == (CPU, torch.float32) for p in model.parameters())  # the same accumulator
    moved = [(s[k], old[k]) for s, old in zip(optimizer.state.values(), states, strict=True) for k in old]
    assert all(new is not old for new, old in moved)  # copies: the device's tensors can be freed
    assert all(new is not old and torch.equal(new, old) for new, old in zip(average, averaged, strict=True))
    mover.to_host()  # already there: nothing moves (the placeholders are not parked over the values)
    mover.to_device()
    assert mover.on_host == {"model": False, "optimizer": False}
    assert all(p is q for p, q in zip(model.parameters(), params, strict=True))  # the optimizer's references hold
    assert all(p is q for p, q in zip(optimizer.param_groups[0]["params"], params, strict=True))
    assert state_hash(model, optimizer) == before
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(average, averaged, strict=True))


def test_resident_brings_back_for_the_call_only_what_rests_on_the_host(tiny_qwen2):
    model = tiny_qwen2()
    mover = Offloader(model, torch.optim.AdamW(model.parameters()), CPU)
    mover.to_host(model=True, optimizer=False)
    with mover.resident(model=True, optimizer=True):
        assert mover.on_host == {"model": False, "optimizer": False} and not parked(model)
    assert mover.on_host == {"model": True, "optimizer": False} and parked(model)
    with pytest.raises(RuntimeError, match="the call failed"), mover.resident():
        raise RuntimeError("the call failed")
    assert parked(model)  # back on the host after a failure too


def test_on_cuda_an_offload_waits_for_its_copies_then_releases_the_cache(tiny_qwen2, monkeypatch):
    """The CUDA branch, run against a recording double of `torch.cuda`: copies into host memory issued with
    `non_blocking=True` may be read only once the compute stream has finished them, and memory the caching allocator
    freed reaches another process on the GPU (verl's rollout) only through `empty_cache`."""
    events: list = []
    copy = offload._copy
    monkeypatch.setattr(offload, "_copy", lambda tensor, device: events.append("copy") or copy(tensor, device))

    class Stream:
        def synchronize(self) -> None:
            events.append("synchronize")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: events.append(device) or Stream())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    gpu = torch.device("cuda", 0)
    model = tiny_qwen2()
    mover = Offloader(model, None, gpu)
    mover.to_host()
    assert events == ["copy"] * len(list(model.parameters())) + [gpu, "synchronize", "empty_cache"]
    events.clear()
    mover.to_host()
    assert events == []  # nothing moved: nothing to wait for


@pytest.mark.parametrize("group", ["gloo"], indirect=True)
def test_ddp_still_averages_gradients_after_a_round_trip(group, tiny_qwen2):
    """DDP averages gradients from hooks on each parameter's gradient accumulator. The mover keeps every parameter's
    device and dtype, so the accumulator, and the hooks, survive; a parameter given data of another device or type
    gets a new accumulator, and its gradients would silently stop being averaged (shown last)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(tiny_qwen2())
    reduced: list[int] = []

    def recording_allreduce(calls, bucket):
        calls.append(bucket.index())
        done = torch.futures.Future()
        done.set_result(bucket.buffer())  # one rank: the sum is the buffer
        return done

    ddp.register_comm_hook(reduced, recording_allreduce)
    mover = Offloader(ddp, None, CPU)
    mover.to_host()
    mover.to_device()
    loss_of(ddp).backward()
    assert reduced  # DDP reduced the gradients
    reduced.clear()
    for p in ddp.parameters():  # what a device change does to a parameter's accumulator
        p.data = p.data.double()
        p.data = p.data.float()
    loss_of(ddp).backward()
    assert not reduced


@pytest.mark.parametrize("group", ["gloo"], indirect=True)
def test_fsdp1_parameters_are_refused_by_name_and_its_optimizer_state_moves(group, tiny_qwen2):
    model = shard(tiny_qwen2(), "fsdp", CPU)
    optimizer = torch.optim.AdamW(model.parameters())
    loss_of(model).backward()
    optimizer.step()
    mover = Offloader(model, optimizer, CPU)  # every FSDP1 worker has one, moving nothing unless asked
    with pytest.raises(ValueError, match=r"parameters of an FSDP1 model \(strategy=fsdp\) is not supported; use"):
        mover.to_host(model=True, optimizer=False)
    before = state_hash(model, optimizer)
    mover.to_host(model=False, optimizer=True)
    mover.to_device(model=False, optimizer=True)
    assert mover.on_host == {"model": False, "optimizer": False} and state_hash(model, optimizer) == before


# --- through the worker ---


def placement(worker: CriticWorker) -> dict[str, str]:
    """Where parameters and optimizer state are: the parameters read off the tensors, the state off the mover."""
    params = "host" if parked(worker.model) else "device"
    return {"params": params, "optimizer": "host" if worker.offload.on_host["optimizer"] else "device"}


def test_the_worker_keeps_offloaded_state_on_the_host_between_calls_and_on_the_device_in_them(host_apart, tmp_path):
    worker = CriticWorker(config(**BOTH), device="cpu")
    seen: list[tuple[str, dict]] = []
    worker.model.register_forward_pre_hook(lambda module, args: seen.append(("forward", placement(worker))))
    worker.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(("step", placement(worker))))
    rest = {"params": "host", "optimizer": "host"}
    assert placement(worker) == rest  # from the start
    batch = make_batch(8, 6, 5, seed=0)
    batch["values"] = worker.compute_values(batch)
    assert seen and all(s == ("forward", {"params": "device", "optimizer": "host"}) for s in seen)
    assert placement(worker) == rest
    seen.clear()
    worker.update_critic(batch)
    assert {what for what, _ in seen} == {"forward", "step"}
    assert all(where == {"params": "device", "optimizer": "device"} for _, where in seen)
    assert placement(worker) == rest and worker.optimizer.state  # AdamW's moments, in host memory
    worker.save_checkpoint(tmp_path / "ckpt")
    assert placement(worker) == rest
    worker.export_hf(tmp_path / "hf")
    assert placement(worker) == rest


@pytest.mark.parametrize(
    ("strategy", "group"), [("none", None), ("ddp", "gloo"), ("fsdp2", "gloo")], indirect=["group"]
)
def test_offload_changes_no_bit_of_the_values_the_update_a_checkpoint_or_an_export(
    host_apart, group, strategy, tmp_path
):
    """The same float operations on the same bits, whatever rested where between the calls: equal exactly. The moving
    average (`ema_decay`) travels with the parameters."""
    offloaded = CriticWorker(config(strategy, ema_decay=0.5, **BOTH), device="cpu")
    resident = CriticWorker(config(strategy, ema_decay=0.5), device="cpu")
    assert offloaded.offload.on_host == {"model": True, "optimizer": True}
    for seed in (0, 1):
        assert torch.equal(trained(offloaded, seed), trained(resident, seed))
    ours, theirs = full_parameters(offloaded), full_parameters(resident)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    probe = make_batch(8, 6, 5, seed=2)
    values = offloaded.compute_values(probe)
    assert torch.equal(values, resident.compute_values(probe))
    saved = offloaded.save_checkpoint(tmp_path / "ckpt")
    fresh = CriticWorker(config(strategy, ema_decay=0.5, **BOTH), device="cpu")
    fresh.load_checkpoint(saved)
    assert torch.equal(fresh.compute_values(probe), values)
    offloaded.export_hf(tmp_path / "hf")
    torch.testing.assert_close(exported_values(tmp_path / "hf", probe), values, **FP32_REORDERED)  # padded HF forward


# --- on a GPU ---


def moved_bytes(worker: CriticWorker) -> int:
    """What phase offload takes off the GPU: parameters and the optimizer state that lives on the GPU."""
    state = [t for s in worker.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    tensors = [*worker.model.parameters(), *(t for t in state if t.device.type == "cuda")]
    return sum(getattr(t, "_local_tensor", t).nbytes for t in tensors)


def state_devices(worker: CriticWorker) -> list[tuple[str, str]]:
    return [(k, t.device.type) for s in worker.optimizer.state.values() for k, t in s.items()]


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("strategy", "group"), [("none", None), ("ddp", BACKEND_CUDA), ("fsdp2", BACKEND_CUDA)], indirect=["group"]
)
def test_on_cuda_offload_frees_the_gpu_between_calls_and_trains_as_without(group, strategy):
    """float32 on both sides: the only difference is the order of atomic adds (the embedding's backward), the same
    math in another summation order (conftest.FP32_REORDERED)."""
    offloaded = CriticWorker(config(strategy, dtype="float32", ema_decay=0.5, **BOTH), device="cuda")
    resident = CriticWorker(config(strategy, dtype="float32", ema_decay=0.5), device="cuda")
    for seed in (0, 1):
        torch.testing.assert_close(trained(offloaded, seed), trained(resident, seed), **FP32_REORDERED)
    ours, theirs = full_parameters(offloaded), full_parameters(resident)
    torch.testing.assert_close(ours, theirs, **FP32_REORDERED)
    assert all(p.numel() == 0 or p.device.type == "cpu" for p in offloaded.model.parameters())  # FSDP2: on the CPU
    state = [(k, t) for s in offloaded.optimizer.state.values() for k, t in s.items()]
    assert state and all(t.device.type == "cpu" for _, t in state)
    held = torch.cuda.memory_allocated()
    offloaded.offload.to_device()
    # each tensor's block is rounded up to 512 bytes by the caching allocator, so it holds at least what moved
    assert torch.cuda.memory_allocated() - held >= moved_bytes(offloaded)
    # every state entry back where the optimizer keeps it (AdamW's step counts: on the CPU unless fused)
    assert state_devices(offloaded) == state_devices(resident)
    offloaded.offload.to_host()
    assert torch.cuda.memory_allocated() == held
