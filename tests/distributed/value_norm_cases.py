"""The configurations (value normalisation, LoRA, weight averaging) and batches shared by `value_norm_worker.py`
(under torchrun) and its test (one process)."""

from __future__ import annotations

import torch

from conftest import make_batch, tiny_config

BASE = {
    "ppo_mini_batch_size": 8,
    "cliprange_value": None,
    "model": {"override_config": tiny_config("qwen2"), "value_head_init": "normal:0.2"},
    "optim": {"lr": 1e-3},
}


def case(
    strategy: str, value_norm: str = "off", lora_rank: int = 0, ema_decay: float = 0.0, head_lr_ratio: float = 1.0
) -> dict:
    model = {**BASE["model"], "lora_rank": lora_rank}
    optim = {**BASE["optim"], "value_head_lr_ratio": head_lr_ratio}
    return {
        **BASE,
        "strategy": strategy,
        "value_norm": value_norm,
        "ema_decay": ema_decay,
        "model": model,
        "optim": optim,
    }


# export_hf of an FSDP1 critic crashes (SIGSEGV) on CPU/gloo, value_norm or not: not exported here
NO_EXPORT = {"running_fsdp", "popart_fsdp", "head_lr_fsdp"}
CASES = {
    "popart_none": case("none", "popart"),
    "popart_ddp": case("ddp", "popart"),
    "popart_fsdp2": case("fsdp2", "popart"),
    "running_fsdp": case("fsdp", "running"),
    "popart_fsdp": case("fsdp", "popart"),
    "lora_ddp": case("ddp", lora_rank=4),
    "lora_fsdp2": case("fsdp2", "running", lora_rank=4),
    "ema_ddp": case("ddp", "running", ema_decay=0.5),
    "ema_fsdp2": case("fsdp2", "running", ema_decay=0.5),
    "ema_lora_fsdp2": case("fsdp2", lora_rank=4, ema_decay=0.5),
    "popart_ema_fsdp2": case("fsdp2", "popart", ema_decay=0.5),  # the average's head rescaled shard-wise too
    "head_lr_fsdp2": case("fsdp2", "running", head_lr_ratio=10.0),  # the head's own group, found through FSDP2
    "head_lr_fsdp": case("fsdp", head_lr_ratio=10.0),  # ... and through FSDP1 (use_orig_params)
}
RESUMED = {"ema_ddp", "ema_fsdp2"}  # also saved, loaded into a fresh worker and evaluated again


def batches() -> list[dict[str, torch.Tensor]]:
    """Global batches of 16 rows: all-zero returns (no spread: the statistics do not start, issue 39), constant
    returns on each rank that differ between the ranks (10 on rank 0's rows, 12 on rank 1's: spread only over both,
    so the statistics start; ~11σ from the outputs, so PopArt's first merge moves them by μ minus the old values'
    mean over both ranks), then two whose returns are far from the initial values (the statistics move)."""
    zeros, halves = make_batch(16, 6, 5, seed=2), make_batch(16, 6, 5, seed=3)
    zeros["returns"] = torch.zeros_like(zeros["returns"])
    rank1_rows = (torch.arange(16) % BASE["ppo_mini_batch_size"]) >= BASE["ppo_mini_batch_size"] // 2
    halves["returns"] = torch.where(rank1_rows[:, None], 12.0, 10.0).expand_as(halves["returns"]).clone()
    out = [zeros, halves]
    for seed in (0, 1):
        batch = make_batch(16, 6, 5, seed=seed)
        batch["returns"] = batch["returns"] * 4.0 + 10.0 * (seed + 1)
        out.append(batch)
    return out
