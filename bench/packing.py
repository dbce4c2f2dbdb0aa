"""Padded vs packed (remove padding) throughput of `compute_values` and `update_critic`, side by side in one run.

Both critics hold the same weights and see the same rollouts (prompts left-padded, responses right-padded,
about `--fill` of the [B, T] grid valid). Runs alternate padded/packed so machine noise hits both alike; the
table reports the median valid tokens/s of each and their ratio.

    python bench/packing.py                       # CPU defaults: 4 layers, hidden 256, 16 x (256 + 512) tokens
    python bench/packing.py --device cuda --dtype bfloat16 --layers 24 --hidden 896 --heads 14 --kv-heads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch

from ppo_critic import DataParallelPPOCritic, build_value_model


def rollouts(batch: int, prompt: int, response: int, fill: float, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Random rollouts whose valid lengths are uniform around `fill` of the padded widths."""
    g = torch.Generator().manual_seed(seed)
    t = prompt + response
    low_p, low_r = max(1, int(prompt * (2 * fill - 1))), max(1, int(response * (2 * fill - 1)))
    p_len = torch.randint(low_p, prompt + 1, (batch,), generator=g)
    r_len = torch.randint(low_r, response + 1, (batch,), generator=g)
    pos = torch.arange(t)
    mask = ((pos >= prompt - p_len[:, None]) & (pos < prompt + r_len[:, None])).long()
    ids = torch.randint(0, vocab, (batch, t), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, prompt:],
        "values": torch.randn(batch, response, generator=g) * 0.1,
        "returns": torch.randn(batch, response, generator=g),
    }


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="autocast dtype of the critic (float32 / bfloat16)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=0, help="MLP width (default 4 x hidden)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=512)
    p.add_argument("--fill", type=float, default=0.5)
    p.add_argument("--micro", type=int, default=4, help="micro-batch size (both critics)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_value_model(
        {
            "model_type": "qwen2",
            "hidden_size": args.hidden,
            "intermediate_size": args.intermediate or 4 * args.hidden,
            "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads,
            "vocab_size": args.vocab,
            "max_position_embeddings": args.prompt + args.response,
        }
    ).to(device)
    batch = rollouts(args.batch, args.prompt, args.response, args.fill, args.vocab, seed=0)
    valid = int(batch["attention_mask"].sum())
    cfg = {"ppo_mini_batch_size": args.batch, "ppo_micro_batch_size_per_gpu": args.micro, "dtype": args.dtype}
    critics = {}
    for name, packed in (("padded", False), ("packed", True)):
        m = copy.deepcopy(model)
        critics[name] = DataParallelPPOCritic(
            {**cfg, "model": {"use_remove_padding": packed}}, m, torch.optim.AdamW(m.parameters(), lr=1e-5)
        )
    results: dict[str, dict[str, list[float]]] = {n: {"compute_values": [], "update_critic": []} for n in critics}
    for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
        for name, critic in critics.items():
            forward = timed(lambda c=critic: c.compute_values(batch), device)
            update = timed(lambda c=critic: c.update_critic(batch), device)
            if repeat:
                results[name]["compute_values"].append(valid / forward)
                results[name]["update_critic"].append(valid / update)
    medians = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
    summary = {
        "device": str(device),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "args": vars(args),
        "fill": valid / batch["attention_mask"].numel(),
        "valid_tokens": valid,
        "median_tokens_per_s": medians,
        "runs": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    print(f"fill {summary['fill']:.2f}, {valid} valid tokens, {args.layers} layers x {args.hidden}, {device}")
    print(f"{'':16} {'padded tok/s':>14} {'packed tok/s':>14} {'packed/padded':>14}")
    for key in ("compute_values", "update_critic"):
        a, b = medians["padded"][key], medians["packed"][key]
        print(f"{key:16} {a:>14.0f} {b:>14.0f} {b / a:>13.2f}x")


if __name__ == "__main__":
    main()
