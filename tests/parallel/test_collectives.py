"""parallel.collectives: which devices a backend takes, that every tensor a collective touches (inputs and outputs)
lies on one of them, and that no other module of the library calls a tensor collective itself (DESIGN §8)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cuda_contract import ContractError, check_collective_devices
from ppo_critic.parallel import collectives
from ppo_critic.parallel.collectives import (
    all_gather_rows,
    all_reduce,
    all_reduce_,
    all_to_all,
    broadcast_,
    served_device_types,
)

SRC = Path(__file__).resolve().parents[2] / "src" / "ppo_critic"
TENSOR_COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "send",
    "recv",
    "isend",
    "irecv",
}


@pytest.mark.parametrize(
    ("backend", "served"),
    [
        ("nccl", {"cuda"}),
        ("gloo", {"cpu"}),
        ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}),
        ("cuda:gloo", {"cuda"}),
    ],
)
def test_served_device_types_follow_the_backend_name(monkeypatch, backend, served):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert served_device_types() == served


def test_a_cpu_tensor_meets_nccl_on_the_current_cuda_device(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collectives.comm_device(torch.device("cpu")) == torch.device("cuda", 3)
    assert collectives.comm_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert collectives.comm_device(torch.device("cuda", 1)) == torch.device("cpu")


class Handed(Exception):
    """Raised by the recording stand-in of a collective, once it has seen what it was handed."""


@pytest.fixture
def handed(monkeypatch) -> list[torch.device]:
    """The devices of every tensor handed to torch.distributed, while the backend "takes" only the meta device: a
    device other than the callers' CPU, so a buffer allocated on the caller's device would show."""
    seen: list[torch.device] = []

    def record(*args, **kwargs):
        for arg in (*args, *kwargs.values()):
            for t in arg if isinstance(arg, list) else [arg]:
                if isinstance(t, torch.Tensor):
                    seen.append(t.device)
        raise Handed

    monkeypatch.setattr(collectives, "comm_device", lambda device, group=None: torch.device("meta"))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    for name in ("all_reduce", "all_gather", "all_to_all_single", "broadcast"):
        monkeypatch.setattr(dist, name, record)
    return seen


@pytest.mark.parametrize(
    "call",
    [
        lambda: all_reduce(torch.ones(3)),
        lambda: all_reduce_(torch.ones(3)),
        lambda: all_gather_rows(torch.ones(2, 5), [2, 1]),  # compute_values under DP: CPU values of a CUDA critic
        lambda: all_to_all([torch.ones(2, 3), torch.ones(2, 3)]),
        lambda: broadcast_(torch.ones(3), 0),
    ],
    ids=["all_reduce", "all_reduce_", "all_gather_rows", "all_to_all", "broadcast_"],
)
def test_inputs_and_outputs_of_every_collective_are_on_the_backends_device(handed, call):
    with pytest.raises(Handed):
        call()
    assert handed and set(handed) == {torch.device("meta")}


def test_all_gather_rows_concatenates_uneven_shares_in_rank_order(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def all_gather(parts, x, group=None):  # rank 1 holds one row of 7s, padded like ours
        parts[0].copy_(x)
        parts[1].copy_(torch.tensor([[7.0, 7.0], [0.0, 0.0]]))

    monkeypatch.setattr(dist, "all_gather", all_gather)
    local = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert all_gather_rows(local, [2, 1]).tolist() == [[1.0, 2.0], [3.0, 4.0], [7.0, 7.0]]


def tensor_collective_calls(path: Path) -> list[str]:
    """`dist.<collective>(...)` / `torch.distributed.<collective>(...)` calls of tensor collectives in `path`."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TENSOR_COLLECTIVES:
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed"):
                calls.append(f"{path.relative_to(SRC)}:{node.lineno}: {owner}.{node.func.attr}")
    return calls


def test_only_the_collectives_module_hands_tensors_to_torch_distributed():
    """One place decides the device of every tensor a collective touches; object collectives (pickles, which torch
    places on the current device) and barriers may be called anywhere."""
    calls = [c for p in sorted(SRC.rglob("*.py")) if p.name != "collectives.py" for c in tensor_collective_calls(p)]
    assert calls == []
    assert tensor_collective_calls(SRC / "parallel" / "collectives.py")  # the check sees calls where they are


@pytest.mark.cuda
def test_cpu_tensors_meet_an_nccl_group_on_cuda_and_come_back_on_the_cpu():
    """compute_values under DP gathers the CPU values of every rank: on NCCL every buffer must be a CUDA tensor."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        rows = torch.arange(6.0).view(2, 3)
        gathered = all_gather_rows(rows, [2])
        assert gathered.device.type == "cpu" and torch.equal(gathered, rows)
        assert all_reduce(torch.ones(2), "max").tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_the_collective_device_check_refuses_a_tensor_its_backend_does_not_take(monkeypatch):
    """tests/cuda_contract.check_collective_devices, which the distributed tests install in every rank."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        checked = check_collective_devices(monkeypatch)
        all_reduce(torch.ones(2))
        assert checked == {"all_reduce": 1}
        with pytest.raises(ContractError, match=r"all_gather was handed tensors on \['cpu', 'meta'\]"):
            dist.all_gather([torch.empty(2, device="meta")], torch.ones(2))
        with pytest.raises(ContractError, match="its backend takes frozenset"):
            dist.broadcast(torch.empty(2, device="meta"), 0)
    finally:
        dist.destroy_process_group()
