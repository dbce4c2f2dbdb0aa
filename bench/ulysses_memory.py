"""Peak activation memory per rank of one `update_critic` on a long sequence, with and without Ulysses.

Run once plainly (sp=1) and once under torchrun (sp = number of processes); each run prints one line, rank 0's.
Memory: on CUDA the peak allocated bytes; on CPU the growth of the process's peak RSS during the update (the
activations, since weights and data exist before) — both per rank.

    python bench/ulysses_memory.py --tokens 8192
    torchrun --standalone --nproc_per_node=2 bench/ulysses_memory.py --tokens 8192
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
import torch.distributed as dist

from ppo_critic import DataParallelPPOCritic, build_value_model
from ppo_critic.backends.data_parallel.fsdp import shard
from ppo_critic.parallel.mesh import init_distributed
from ppo_critic.run.files import write_file


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192, help="length of the one response-carrying sequence")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    distributed = init_distributed(timeout_s=600)
    sp = dist.get_world_size() if distributed else 1
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = build_value_model(
        {
            "model_type": "qwen2",
            "hidden_size": args.hidden,
            "intermediate_size": 4 * args.hidden,
            "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads,
            "num_key_value_heads": args.heads,
            "vocab_size": 1024,
            "max_position_embeddings": args.tokens,
        }
    ).to(device)
    model = shard(model, "fsdp2", device)
    t, r = args.tokens, args.tokens // 2
    ids = torch.randint(0, 1024, (1, t), generator=torch.Generator().manual_seed(0))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(1, t, dtype=torch.long),
        "position_ids": torch.arange(t).unsqueeze(0),
        "responses": ids[:, -r:],
        "values": torch.zeros(1, r),
        "returns": torch.ones(1, r),
    }
    cfg = {"ppo_mini_batch_size": 1, "ulysses_sequence_parallel_size": sp, "model": {"use_remove_padding": True}}
    critic = DataParallelPPOCritic(cfg, model, torch.optim.SGD(model.parameters(), lr=1e-3))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = peak_rss_mib()
    start = time.perf_counter()
    critic.update_critic(batch)
    elapsed = time.perf_counter() - start
    after = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else peak_rss_mib()
    result = {"sp": sp, "tokens": t, "device": str(device), "peak_activation_mib": after - before, "seconds": elapsed}
    if not distributed or dist.get_rank() == 0:
        print(json.dumps(result))
        if args.out:
            write_file(args.out, json.dumps(result))


if __name__ == "__main__":
    main()
