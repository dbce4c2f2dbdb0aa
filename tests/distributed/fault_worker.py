"""Run under torchrun with 2 ranks. argv: <mode> <timeout_s> [<pid_dir>]. Rank 0 always ends up waiting in a
collective while rank 1 fails:
- `raise`: rank 1 raises;
- `hang`: rank 1 sleeps past the timeout;
- `die`: rank 1 is killed (SIGKILL), as by the OOM killer or a lost node;
- `options`: `ppo-critic train` where rank 1 was started with other options (its seed, and its model's size):
  every rank refuses, naming the keys, before any model is built;
- `api-options`: `DataParallelPPOCritic` built on each rank from another config (ppo_epochs) and model (hidden size):
  every rank refuses at construction, naming the keys and each rank's value;
- `bad-batch`: a CriticWorker job (DP=2, `dist_timeout_s`=timeout) where only rank 1's share of the global batch holds a
  NaN return, so rank 1 rejects it while rank 0 enters the update's collectives.
With <pid_dir>, each rank first writes its process id there (the test checks that every rank is gone)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ppo_critic.parallel.mesh import init_distributed

mode, timeout_s = sys.argv[1], float(sys.argv[2])
if len(sys.argv) > 3:
    Path(sys.argv[3], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
if mode == "bad-batch":
    from conftest import TINY, make_batch
    from ppo_critic.worker import CriticWorker

    model = {"override_config": {"model_type": "qwen2", **TINY}}
    config = {"strategy": "none", "ppo_mini_batch_size": 4, "model": model}
    worker = CriticWorker(config, dist_timeout_s=timeout_s)
    batch = make_batch(8, 6, 5)
    worker.update_critic(batch)  # both ranks healthy: one good update
    batch["returns"][2, 0] = float("nan")  # row 2 is in rank 1's share (rows 2-3 of every block of 4)
    worker.update_critic(batch)
    print(f"rank {dist.get_rank()} finished")  # must not happen
    sys.exit(0)
if mode == "api-options":
    from conftest import TINY
    from ppo_critic import DataParallelPPOCritic, build_value_model

    init_distributed(timeout_s=timeout_s)
    rank = dist.get_rank()
    model = build_value_model({"model_type": "qwen2", **TINY, "hidden_size": 32 if rank == 0 else 64})
    config = {"ppo_mini_batch_size": 4, "ppo_epochs": 1 + rank}
    DataParallelPPOCritic(config, model, torch.optim.AdamW(model.parameters()))
    print(f"rank {rank} finished")  # must not happen
    sys.exit(0)
if mode == "options":
    from ppo_critic.cli import main
    from test_train import SHORT

    rank = int(os.environ["RANK"])
    sizes = "{hidden_size: 64}" if rank == 0 else "{hidden_size: 128}"
    argv = ["train", *SHORT, f"trainer.seed={rank}", f"trainer.run_dir={sys.argv[3]}/run"]
    sys.exit(main([*argv, f"critic.model.override_config={sizes}"]))
init_distributed(timeout_s=timeout_s)
if dist.get_rank() == 1:
    if mode == "raise":
        raise RuntimeError("injected failure on rank 1")
    if mode == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(timeout_s * 20)
dist.all_reduce(torch.ones(1))
