"""torchrun worker: the megatron critic at several TP × PP (× VPP) layouts against the single-process reference.

argv: reference.pt, out.json, export_dir; MEGATRON_LAYOUTS (comma-separated names) picks layouts. On CUDA (NCCL)
megatron runs as it is; on CPU its CUDA assumptions are redirected (tests/megatron_cpu.py). The reference
(written by test_megatron_model.py) holds the batch, the worker config, and per batching mode the values, metrics,
weights before and after one update of the data-parallel critic. Rank 0 writes one row per layout × mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch

from megatron_cpu import redirect_cuda_to_cpu

if not torch.cuda.is_available():
    redirect_cuda_to_cpu()

import torch.distributed as dist
from megatron.core import parallel_state as ps

from ppo_critic.worker import CriticWorker

LAYOUTS = {  # name: (TP, PP, VPP); DP is what is left of the 4 processes
    "tp1pp1": (1, 1, None),
    "tp2": (2, 1, None),
    "pp2": (1, 2, None),
    "tp2pp2": (2, 2, None),
    "pp4vpp2": (1, 4, 2),
    "tp2verl": (2, 1, None),  # as verl's megatron worker builds and calls it, see `as_verl_builds_it`
}
METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/vf_explained_var")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@contextlib.contextmanager
def as_verl_builds_it(name: str):
    """For `tp2verl`: a TransformerConfig without calculate_per_token_loss (megatron then divides each loss by the
    micro-batch count and averages gradients over DP; verl's megatron worker builds such a config)."""
    if name != "tp2verl":
        yield
        return
    import ppo_critic.backends.megatron.backend as models  # where the worker looks the function up

    build = models.transformer_config

    def without_per_token_loss(*args, **kwargs):
        config = build(*args, **kwargs)
        config.calculate_per_token_loss = False
        return config

    models.transformer_config = without_per_token_loss
    try:
        yield
    finally:
        models.transformer_config = build


def update(worker: CriticWorker, name: str, batch: dict) -> dict:
    """`worker.update_critic`; for `tp2verl` the critic is called the way verl's megatron worker calls it."""
    if name != "tp2verl":
        return worker.update_critic(batch)
    critic, plain = worker.critic, worker.critic.update_critic
    critic.update_critic = lambda data: plain(dataloader=critic.make_minibatch_iterator(data))
    try:
        return worker.update_critic(batch)
    finally:
        del critic.update_critic


def run_layout(name: str, mode: str, ref: dict, export_dir: str) -> dict:
    tp, pp, vpp = LAYOUTS[name]
    cfg = ref["configs"][mode] | {"strategy": "megatron"}
    if cfg["optim"].get("optimizer") == "sgd":
        cfg["megatron"] = {"use_distributed_optimizer": False}
    cfg["megatron"] = cfg["megatron"] | {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vpp,
    }
    with as_verl_builds_it(name):
        worker = CriticWorker(cfg, seed=0)
    assert worker.critic.tf_config.calculate_per_token_loss == (name != "tp2verl")
    expect = ref["modes"][mode]
    before = worker.backend.hf_state_dict()
    exact = before.keys() == expect["before"].keys()
    round_trip = exact and all(torch.equal(v, expect["before"][k]) for k, v in before.items())
    values = worker.compute_values(ref["batch"])
    metrics = update(worker, name, ref["batch"])
    after = worker.backend.hf_state_dict()
    values_after = worker.compute_values(ref["batch"])
    delta = torch.cat([(after[k] - before[k]).flatten() for k in expect["before"]])
    row = {
        "layout": name,
        "mode": mode,
        "dp": worker.dp_size,
        "round_trip_exact": round_trip,
        "values_max_abs": float((values - expect["values"]).abs().max()),
        "values_after_max_abs": float((values_after - expect["after"]).abs().max()),
        "update_rel": rel(delta, expect["delta"]),
        "metric_rel": max(
            abs(metrics[k] - expect["metrics"][k]) / max(abs(expect["metrics"][k]), 1e-6) for k in METRICS
        ),
        "lr": metrics["critic/lr"],
        "skipped": metrics["critic/skipped_steps"],
    }
    if name == "tp2pp2" and mode == "fixed":
        worker.export_hf(export_dir)
        bad = dict(ref["batch"], returns=torch.full_like(ref["batch"]["returns"], 3e38))
        skipped = worker.update_critic(bad)
        row["nonfinite_skipped"] = skipped["critic/skipped_steps"]
        row["nonfinite_unchanged"] = all(torch.equal(after[k], v) for k, v in worker.backend.hf_state_dict().items())
        other = {k: v.clone() for k, v in ref["batch"].items()}
        other["input_ids"][0, -1] = 1 + dist.get_rank() % 2  # the ranks of one replica hold other tokens
        try:
            worker.critic.update_critic(other)
        except ValueError as err:
            row["mismatch"] = str(err)
        row["mismatch_unchanged"] = all(torch.equal(after[k], v) for k, v in worker.backend.hf_state_dict().items())
    ps.destroy_model_parallel()
    return row


def main() -> None:
    ref_path, out_path, export_dir = sys.argv[1:4]
    ref = torch.load(ref_path, weights_only=False)
    names = os.environ.get("MEGATRON_LAYOUTS", ",".join(LAYOUTS)).split(",")
    rows = [run_layout(name, mode, ref, export_dir) for name in names for mode in ref["modes"]]
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
