"""backends.data_parallel.fsdp: FSDP2's mixed precision follows the compute dtype (`critic.dtype`, bf16 by
default on CUDA), and a value head of a dtype of its own keeps it, through the worker that builds a run's critic
(one-process gloo group)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import make_batch, tiny_config
from ppo_critic.worker import CriticWorker

pytestmark = pytest.mark.usefixtures("one_thread")


def fsdp2_worker(dtype: str | None, head_dtype: str | None) -> CriticWorker:
    model = {"override_config": tiny_config("qwen2"), "value_head_dtype": head_dtype, "use_remove_padding": False}
    config = {"strategy": "fsdp2", "ppo_mini_batch_size": 4, "dtype": dtype, "model": model}
    return CriticWorker(config, device="cpu")


def dtypes_in_forward(worker: CriticWorker) -> dict[str, torch.dtype]:
    """The dtypes of a decoder layer's weights and of the value head's weight while they compute."""
    from ppo_critic.models.hf import find_value_head

    parent, name = find_value_head(worker.model)
    watched = {"layer": worker.model.model.layers[0].mlp.up_proj, "head": getattr(parent, name)}
    seen: dict[str, torch.dtype] = {}

    def record(key: str):
        def hook(module, args, output) -> None:
            seen.setdefault(key, module.weight.dtype)

        return hook

    hooks = [module.register_forward_hook(record(key)) for key, module in watched.items()]
    worker.compute_values(make_batch(4, 5, 4))
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize(
    ("dtype", "head_dtype", "layer", "head"),
    [
        ("bfloat16", None, torch.bfloat16, torch.bfloat16),
        ("bfloat16", "float32", torch.bfloat16, torch.float32),
        ("float16", "float32", torch.float16, torch.float32),
        ("float32", None, torch.float32, torch.float32),
        (None, None, torch.float32, torch.float32),  # the CPU default; CUDA's is bf16 (test_mesh)
    ],
)
def test_fsdp2_computes_in_the_configured_dtype_and_the_head_in_its_own(
    one_process_group, dtype, head_dtype, layer, head
):
    worker = fsdp2_worker(dtype, head_dtype)
    assert dtypes_in_forward(worker) == {"layer": layer, "head": head}
    worker.model.reshard()  # the root keeps its parameters gathered after a forward
    assert {p.dtype for p in worker.model.parameters()} == {torch.float32}  # the shards the optimizer steps
    metrics = worker.update_critic(make_batch(4, 5, 4) | {"values": torch.zeros(4, 4)})
    assert metrics["critic/skipped_steps"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "layer"), [(None, torch.bfloat16), ("float32", torch.float32)])
def test_fsdp2_on_cuda_computes_in_the_configured_dtype(one_process_group, dtype, layer):
    model = {"override_config": tiny_config("qwen2"), "value_head_dtype": "float32"}
    worker = CriticWorker({"strategy": "fsdp2", "ppo_mini_batch_size": 4, "dtype": dtype, "model": model})
    assert dtypes_in_forward(worker) == {"layer": layer, "head": torch.float32}


@pytest.fixture
def one_process_cuda_group():
    """A one-rank group as ppo-critic starts one under torchrun on CUDA (NCCL, gloo for CPU tensors)."""
    from ppo_critic.parallel.mesh import BACKEND_CUDA

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group(BACKEND_CUDA, store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp2", "none"])
def test_every_strategy_updates_on_cuda_under_nccl(one_process_cuda_group, strategy):
    """DDP's device_ids, FSDP1's device_id and sync_module_states, FSDP2's policy, and every collective of the update
    and of compute_values (on NCCL: CUDA buffers only) on a real GPU."""
    model = {"override_config": tiny_config("qwen2")}
    worker = CriticWorker({"strategy": strategy, "ppo_mini_batch_size": 4, "model": model})
    batch = make_batch(4, 5, 4)
    batch["values"] = worker.compute_values(batch)
    metrics = worker.update_critic(batch)
    assert metrics["critic/skipped_steps"] == 0 and metrics["perf/tokens_per_s"] > 0


def test_the_former_path_resolves_the_same_functions():
    from ppo_critic.backends.data_parallel import fsdp
    from ppo_critic.parallel.fsdp import parallelize, shard

    assert (parallelize, shard) == (fsdp.parallelize, fsdp.shard)
    with pytest.raises(ImportError, match="no_such_name"):
        from ppo_critic.parallel.fsdp import no_such_name  # noqa: F401
