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
    refusals = refused_mismatches(next(iter(ref["models"].values()))["model"], batch, mini, ranks)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, refusals)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"rows": results, "collectives_checked": checked, "refusals": every}, f)
    dist.destroy_process_group()


def refused_mismatches(model, batch, mini, ranks) -> list:
    """Issue 43 family 6: the second rank of each sp group holds one row fewer (compute_values), then one other
    token id (update_critic). Every rank's error text (None: no error), and whether the update left the weights."""
    model = shard(copy.deepcopy(model), "fsdp2", torch.device("cpu"))
    cfg = {"ppo_mini_batch_size": mini, "ulysses_sequence_parallel_size": ranks.sp}
    cfg["model"] = {"use_remove_padding": True}
    critic = DataParallelPPOCritic(cfg, model, torch.optim.SGD(model.parameters(), lr=0.1))
    fewer = {k: v[: len(v) - ranks.sp_rank] for k, v in batch.items()}
    other = {k: v.clone() for k, v in batch.items()}
    other["input_ids"][0, -1] += ranks.sp_rank
    before = full_params(model)
    out = []
    for call, data in ((critic.compute_values, fewer), (critic.update_critic, other)):
        try:
            call(data)
            out.append(None)
        except ValueError as err:
            out.append(str(err))
    after = full_params(model)
    return [*out, all(torch.equal(before[k], after[k]) for k in before)]


if __name__ == "__main__":
    main()
