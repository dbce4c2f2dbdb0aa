"""Run under `torchrun --nproc_per_node=2` with VERL_USE_EXTERNAL_MODULES=ppo_critic.integrations.verl: verl's FSDP
CriticWorker at DP=2 (gloo) with ppo-critic's critic inside, each rank on its chunk of the batch as verl's
dispatch sends it.

argv: <model_dir> <batch.pt> <out.pt>. Writes (rank 0): the values of ppo-critic's critic and of verl's own critic
in the same worker, the parameters after one update, and the values after a checkpoint round trip.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from verl import DataProto
from verl_helpers import VerlCritic, make_worker, worker_values

import ppo_critic.integrations.verl as integration
from verl_shared import params

GLOBAL = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4, "forward_micro_batch_size_per_gpu": 4}
SGD = {"optim.optimizer": "SGD", "optim.weight_decay": 0.0, "optim.lr": 0.1}


def worker(model_dir: str, critic: type):
    return make_worker(Path(model_dir), critic, **GLOBAL, **SGD)


def gathered_values(w, chunk: DataProto) -> torch.Tensor:
    local = worker_values(w, chunk)
    parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, local)
    return torch.cat(parts)


def main() -> None:
    model_dir, batch_path, out_path = sys.argv[1:4]
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    chunk = torch.load(batch_path, weights_only=False).chunk(world)[rank]  # verl's dispatch: contiguous chunks
    ours = worker(model_dir, integration.DataParallelPPOCritic)
    assert type(ours.critic) is integration.DataParallelPPOCritic and ours.config.ppo_mini_batch_size == 4
    result = {
        "values": gathered_values(ours, chunk),
        "verl_values": gathered_values(worker(model_dir, VerlCritic), chunk),
    }
    metrics = ours.update_critic(chunk).meta_info["metrics"]
    result["params"], result["grad_norm"] = params(ours.critic_module), metrics["critic/grad_norm"]
    result["values_after"] = gathered_values(ours, chunk)
    checkpoint = str(Path(out_path).parent / "checkpoint")
    ours.save_checkpoint(checkpoint, global_step=1)
    fresh = worker(model_dir, integration.DataParallelPPOCritic)
    fresh.load_checkpoint(checkpoint, del_local_after_load=False)
    result["values_loaded"] = gathered_values(fresh, chunk)
    if rank == 0:
        torch.save(result, out_path)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
