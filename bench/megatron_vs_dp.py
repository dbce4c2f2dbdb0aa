"""Megatron (TP=1/PP=1) vs the data-parallel critic (packed): `compute_values` and `update_critic` throughput and
peak memory, side by side in one process on the same weights and rollouts.

Both workers are built from one config (the megatron one converts the same HF weights); runs alternate so that
machine noise hits both alike; the table reports median valid tokens/s and the megatron/dp ratio. On CPU the
test-only redirect of megatron's CUDA assumptions (tests/megatron_cpu.py) is applied.

    python bench/megatron_vs_dp.py                                   # CPU: 2 layers, hidden 128, 8 x (64 + 128)
    python bench/megatron_vs_dp.py --device cuda --dtype bfloat16 --layers 24 --hidden 896 --heads 14 --kv-heads 2 \\
        --intermediate 4864 --vocab 151936 --batch 32 --prompt 512 --response 1024 --micro 8
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
from packing import rollouts, timed

from ppo_critic.worker import CriticWorker, MegatronCriticWorker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="compute dtype (megatron: parameter dtype)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=0, help="MLP width (default 4 x hidden)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=128)
    p.add_argument("--fill", type=float, default=0.5)
    p.add_argument("--micro", type=int, default=4, help="micro-batch size (both critics)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()

    device = torch.device(args.device)
    if device.type == "cpu":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from megatron_cpu import redirect_cuda_to_cpu

        redirect_cuda_to_cpu()
    model = {
        "override_config": {
            "model_type": "qwen2",
            "hidden_size": args.hidden,
            "intermediate_size": args.intermediate or 4 * args.hidden,
            "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads,
            "vocab_size": args.vocab,
            "max_position_embeddings": args.prompt + args.response,
        }
    }
    cfg = {
        "ppo_mini_batch_size": args.batch,
        "ppo_micro_batch_size_per_gpu": args.micro,
        "dtype": args.dtype,
        "optim": {"lr": 1e-6},
    }
    packed = model | {"use_remove_padding": True}
    workers = {
        "dp": CriticWorker(cfg | {"strategy": "none", "model": packed}, device=args.device),
        "megatron": MegatronCriticWorker(cfg | {"strategy": "megatron", "model": model}, device=args.device),
    }
    batch = rollouts(args.batch, args.prompt, args.response, args.fill, args.vocab, seed=0)
    valid = int(batch["attention_mask"].sum())
    results = {n: {"compute_values": [], "update_critic": [], "peak_mib": []} for n in workers}
    for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
        for name, worker in workers.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            forward = timed(lambda w=worker: w.compute_values(batch), device)
            update = timed(lambda w=worker: w.update_critic(batch), device)
            if repeat:
                results[name]["compute_values"].append(valid / forward)
                results[name]["update_critic"].append(valid / update)
                peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else 0.0
                results[name]["peak_mib"].append(peak)
    medians = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
    summary = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "args": vars(args),
        "valid_tokens": valid,
        "median": medians,
        "runs": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    print(f"{valid} valid tokens, {args.layers} layers x {args.hidden}, {args.dtype}, {summary['device']}")
    print(f"{'':16} {'dp tok/s':>12} {'megatron tok/s':>15} {'megatron/dp':>12}")
    for key in ("compute_values", "update_critic"):
        a, b = medians["dp"][key], medians["megatron"][key]
        print(f"{key:16} {a:>12.0f} {b:>15.0f} {b / a:>11.2f}x")
    print(f"{'peak MiB':16} {medians['dp']['peak_mib']:>12.0f} {medians['megatron']['peak_mib']:>15.0f}")


if __name__ == "__main__":
    main()
