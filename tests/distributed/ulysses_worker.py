"""Run under torchrun (2 ranks: sp=2; 4 ranks: dp=2 × sp=2). argv: <reference.pt> <out.json> <sp>.

For each model (GQA with 2 and with 1 key/value head), loss mode, wrapping (FSDP2, FSDP1) and micro-batching, and
once with gradient checkpointing: values and one update, compared with the single-process reference of
test_ulysses.py."""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist

from cuda_contract import check_collective_devices
from layouts_worker import full_params
from ppo_critic import DataParallelPPOCritic
from ppo_critic.backends.data_parallel.fsdp import shard
from ppo_critic.parallel.layout import data_parallel_layout
from ppo_critic.parallel.mesh import init_distributed

LAYOUTS = ({"ppo_micro_batch_size_per_gpu": 2}, {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 12})


def main() -> None:
    ref_path, out_path, sp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    init_distributed(timeout_s=120)
    checked = check_collective_devices()
    ranks = data_parallel_layout(sp)
    ref = torch.load(ref_path, weights_only=False)
    batch = {k: v[ranks.dp_rank :: ranks.dp] for k, v in ref["batch"].items()}
    mini = len(ref["batch"]["input_ids"]) // ranks.dp
    results = []
    for name, entry in ref["models"].items():
        for mode, expected in entry["updates"].items():
            combos = [(s, lay, False) for s in ("fsdp2", "fsdp") for lay in LAYOUTS] + [("fsdp2", LAYOUTS[0], True)]
            for strategy, layout, checkpointing in combos:
                model = copy.deepcopy(entry["model"])
                if checkpointing:  # the backward recomputes each layer's forward, all-to-alls included
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                model = shard(model, strategy, torch.device("cpu"))
                cfg = {"ppo_mini_batch_size": mini, "grad_clip": None, "loss_agg_mode": mode, **layout}
                cfg |= {"ulysses_sequence_parallel_size": sp, "model": {"use_remove_padding": True}}
                critic = DataParallelPPOCritic(cfg, model, torch.optim.SGD(model.parameters(), lr=0.1))
                values = critic.compute_values(batch)
                parts = [torch.zeros_like(values) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, values)
                full = torch.zeros_like(entry["values"])
                for r, part in enumerate(parts):
                    full[(r // sp) :: ranks.dp] = part
                critic.update_critic(batch)
                params = full_params(model)
                delta = torch.cat([(params[k] - v).flatten() for k, v in expected["before"].items()])
                rel = ((delta - expected["delta"]).norm() / expected["delta"].norm()).item()
                err = (full - entry["values"]).abs().max().item()
                results.append(
                    {"model": name, "strategy": strategy, "mode": mode, "layout": layout, "rel": rel}
                    | {"checkpointing": checkpointing}
                    | {"values_max_abs": err}
                )
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"rows": results, "collectives_checked": checked}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
