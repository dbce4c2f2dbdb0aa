"""Run under `torchrun --nproc_per_node=2`: one update per layout, compared with the single-process reference.

argv: <reference.pt> <out.json>. The reference file holds the initial weights, and per case the global batch and the
reference parameter deltas and metrics per loss mode, and the reference values (see test_layouts.py).
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from cuda_contract import check_collective_devices
from ppo_critic import DataParallelPPOCritic
from ppo_critic.backends.data_parallel.fsdp import shard
from ppo_critic.parallel.mesh import init_distributed

STRATEGIES = ("none", "ddp", "fsdp", "fsdp2")
MICRO = ({"ppo_micro_batch_size_per_gpu": 1}, {"ppo_micro_batch_size_per_gpu": 2}, {"ppo_micro_batch_size_per_gpu": 4})
DYNAMIC = ({"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 20},)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def main() -> None:
    ref_path, out_path = sys.argv[1], sys.argv[2]
    init_distributed(timeout_s=120)
    checked = check_collective_devices()
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = torch.load(ref_path, weights_only=False)
    base = ref["model"]
    results = []
    for case, reference in ref["cases"].items():
        batch = {k: v[rank::world] for k, v in reference["batch"].items()}  # rank r takes rows r, r + 2, ...
        full = case == "full"  # every layout; the other cases two, padded
        layouts, paddings = ((*MICRO, *DYNAMIC), (False, True)) if full else ((MICRO[1], *DYNAMIC), (False,))
        for mode, expected in reference["updates"].items():
            for strategy in STRATEGIES:
                for layout in layouts:
                    for packed in paddings:
                        model = shard(copy.deepcopy(base), strategy, torch.device("cpu"))
                        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                        cfg = {"ppo_mini_batch_size": 4, "grad_clip": None, "loss_agg_mode": mode, **layout}
                        critic = DataParallelPPOCritic(
                            {**cfg, "model": {"use_remove_padding": packed}}, model, optimizer
                        )
                        metrics = critic.update_critic(batch)
                        params = full_params(model)
                        delta = torch.cat([(params[k] - v).flatten() for k, v in expected["before"].items()])
                        rel = ((delta - expected["delta"]).norm() / expected["delta"].norm()).item()
                        metric_err = max(
                            abs(metrics[k] - v) / max(abs(v), 1e-12)
                            for k, v in expected["metrics"].items()
                            if not k.startswith("perf/")
                        )
                        results.append(
                            {
                                "case": case,
                                "mode": mode,
                                "strategy": strategy,
                                "layout": layout,
                                "packed": packed,
                                "rel": rel,
                                "metric_rel": metric_err,
                            }
                        )
    batch = {k: v[rank::world] for k, v in ref["cases"]["full"]["batch"].items()}
    model = shard(copy.deepcopy(base), "fsdp2", torch.device("cpu"))
    critic = DataParallelPPOCritic(
        {"ppo_mini_batch_size": 4, "use_dynamic_bsz": True, "forward_max_token_len_per_gpu": 20},
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
    )
    values = critic.compute_values(batch)
    gathered = [torch.zeros_like(values) for _ in range(world)]
    dist.all_gather(gathered, values)
    full = torch.zeros_like(ref["values"])
    for r in range(world):
        full[r::world] = gathered[r]
    values_err = (full - ref["values"]).abs().max().item()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"layouts": results, "values_max_abs": values_err, "collectives_checked": checked}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
