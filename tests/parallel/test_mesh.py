"""parallel.mesh and the offload check: which device becomes current, which backends a job's process group gets, and
why CPU offload needs a CPU backend beside NCCL (reproduced on the CPU with a group that has none)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ppo_critic.backends.data_parallel.fsdp import check_cpu_backend
from ppo_critic.parallel import mesh
from ppo_critic.parallel.mesh import BACKEND_CUDA, init_distributed, select_device


@pytest.fixture
def fake_cuda(monkeypatch) -> list:
    """A machine with CUDA as far as `mesh` asks (current device 0); records `set_device`."""
    made_current: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    return made_current


def test_a_named_cuda_device_becomes_the_current_one(fake_cuda):
    """Else CUDA events, synchronize, memory statistics and the peak-FLOPs probe would all time device 0."""
    assert select_device("cuda:3") == torch.device("cuda", 3)
    assert select_device("auto") == torch.device("cuda", 0) == select_device("cuda")
    assert fake_cuda == [torch.device("cuda", 3), torch.device("cuda", 0), torch.device("cuda", 0)]
    assert select_device("cpu") == torch.device("cpu") and len(fake_cuda) == 3


def test_a_cuda_job_under_torchrun_gets_gloo_for_cpu_tensors_beside_nccl(fake_cuda, monkeypatch):
    joined = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: joined.update(backend=backend))
    assert init_distributed(60.0)
    assert joined == {"backend": "cpu:gloo,cuda:nccl"} == {"backend": BACKEND_CUDA}
    assert fake_cuda == [1]  # LOCAL_RANK's device is current before the group exists


@pytest.fixture
def group(request):
    """A one-process group with the backend `request.param`, destroyed after the test."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group(request.param, store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("group", ["cuda:gloo"], indirect=True)
def test_a_group_without_a_cpu_backend_cannot_reduce_cpu_gradients_and_offload_says_so(group):
    """What FSDP2's CPU offload meets under a plain `nccl` group (gloo standing in for NCCL, for CUDA only): its
    gradients live on the CPU, and their norm's all-reduce has no backend."""
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(2))
    with pytest.raises(ValueError, match=r"offload_policy=true needs a CPU backend .*backend='cpu:gloo,cuda:nccl'"):
        check_cpu_backend()


@pytest.mark.parametrize("group", [BACKEND_CUDA.replace("nccl", "gloo")], indirect=True)
def test_a_group_with_a_cpu_backend_beside_the_cuda_one_reduces_cpu_gradients(group):
    check_cpu_backend()
    grad = torch.ones(2)
    dist.all_reduce(grad)
    assert grad.tolist() == [1.0, 1.0]


@pytest.mark.parametrize(("device", "dtype"), [("cuda", torch.bfloat16), ("cpu", torch.float32)])
def test_the_default_compute_dtype_is_bf16_on_cuda_only(device, dtype):
    assert mesh.default_dtype(torch.device(device)) == dtype


@pytest.mark.cuda
def test_the_selected_cuda_device_is_current():
    last = torch.cuda.device_count() - 1
    assert select_device(f"cuda:{last}") == torch.device("cuda", last) and torch.cuda.current_device() == last
    assert select_device("auto") == torch.device("cuda", last)
