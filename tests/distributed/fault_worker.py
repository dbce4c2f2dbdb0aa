"""Run under torchrun with 2 ranks. argv: <mode> <timeout_s>. mode `raise`: rank 1 raises while rank 0 waits in a
collective; mode `hang`: rank 1 sleeps past the timeout while rank 0 waits in a collective."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from ppo_critic.parallel.mesh import init_distributed

mode, timeout_s = sys.argv[1], float(sys.argv[2])
init_distributed(timeout_s=timeout_s)
if dist.get_rank() == 1:
    if mode == "raise":
        raise RuntimeError("injected failure on rank 1")
    time.sleep(timeout_s * 20)
dist.all_reduce(torch.ones(1))
