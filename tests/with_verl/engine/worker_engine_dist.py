"""Run under `torchrun --nproc_per_node=2` (gloo): verl's TrainingWorker with ppo-critic's engine at DP=2 (each rank
on its chunk of the batch, as verl's dispatch sends it) and at DP=1 × Ulysses 2 (both ranks on the whole batch).

argv: <model_dir> <batch.pt> <out.pt>. Rank 0 writes, per layout: the values before and after one update, the metrics
verl's worker reports for it, the full parameters after it, and the values after a checkpoint round trip.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
from engine_helpers import SGD, critic_metrics, engine_params, infer_values, train, training_worker

from cuda_contract import check_collective_devices
from ppo_critic.config.env import OPTIONS_ENV

LAYOUTS = {  # name: (critic settings, whether each rank takes its chunk, PPO_CRITIC_OPTIONS)
    "dp2": ({}, True, ""),
    "dp1sp2": ({"fsdp.ulysses_sequence_parallel_size": 2, "model.use_remove_padding": True}, False, ""),
    "dp2_popart": ({}, True, "value_norm=popart"),  # return statistics summed over the two ranks
    "dp2_running_zeros": ({}, True, "value_norm=running"),  # all-zero returns: no spread, the statistics never start
}


def values_of_all(worker, data, chunked: bool) -> torch.Tensor:
    """The whole batch's values: gathered over DP, or (Ulysses) reported by rank 0 of the sequence-parallel group."""
    local = infer_values(worker, data)
    if not chunked:
        box = [local]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, local)
    return torch.cat(parts)


def main() -> None:
    model_dir, batch_path, out_path = sys.argv[1:4]
    torch.distributed.init_process_group("gloo")  # verl's own initialisation asks for cpu:gloo twice on a CPU
    checked = check_collective_devices()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batch = torch.load(batch_path, weights_only=False)
    results = {}
    for name, (settings, chunked, options) in LAYOUTS.items():
        os.environ[OPTIONS_ENV] = options
        data = copy.deepcopy(batch.chunk(world)[rank] if chunked else batch)
        if name.endswith("_zeros"):
            data.batch["returns"] = torch.zeros_like(data.batch["returns"])
        worker = training_worker(Path(model_dir), **SGD, **settings)
        out = {"values": values_of_all(worker, data, chunked)}
        out["metrics"] = critic_metrics(train(worker, data, mini_batch_size=8))  # as rank 0 reports them
        out["params"] = engine_params(worker)
        out["values_after"] = values_of_all(worker, data, chunked)
        checkpoint = str(Path(out_path).parent / name / "global_step_1" / "critic")
        worker.save_checkpoint(checkpoint, global_step=1)
        fresh = training_worker(Path(model_dir), **SGD, **settings)
        fresh.load_checkpoint(checkpoint)
        out["values_loaded"] = values_of_all(fresh, data, chunked)
        results[name] = out
    if rank == 0:
        torch.save(results | {"collectives_checked": dict(checked)}, out_path)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
