"""Run under `torchrun --nproc_per_node=2`: CriticWorkers with value normalisation, LoRA and weight averaging.

argv: <out_dir>. For each case, two updates on the global batches of `cases.batches()`; rank 0 writes the
return statistics (and each rank's copy of them), the values after the updates, and an HF export; `RESUMED` cases
also the values of a fresh worker that loaded their checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cuda_contract import check_collective_devices
from ppo_critic.worker import CriticWorker
from value_norm_cases import CASES, NO_EXPORT, RESUMED, batches


def main() -> None:
    out = Path(sys.argv[1])
    checked = check_collective_devices()
    report = {}
    for name, config in CASES.items():
        worker = CriticWorker(config, device="cpu")
        for batch in batches():
            batch["values"] = worker.compute_values(batch)
            worker.update_critic(batch)
        norm = worker.critic.value_norm
        stats = torch.stack([norm.count, norm.mean, norm.var])
        every_rank = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
        dist.all_gather(every_rank, stats)
        values = worker.compute_values(batches()[0])
        if name not in NO_EXPORT:
            worker.export_hf(out / name)
        if dist.get_rank() == 0:
            report[name] = {
                "stats": [s.tolist() for s in every_rank],
                "values": values.tolist(),
            }
        if name in RESUMED:
            path = worker.save_checkpoint(out / f"{name}_ckpt")
            resumed = CriticWorker(config, device="cpu", seed=1)  # other weights and average until loaded
            resumed.load_checkpoint(path)
            again = resumed.compute_values(batches()[0])
            if dist.get_rank() == 0:
                report[name]["resumed_values"] = again.tolist()
    if dist.get_rank() == 0:
        (out / "report.json").write_text(json.dumps(report))
        (out / "collectives.json").write_text(json.dumps(checked))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
