"""Train a tiny critic on synthetic rollouts and print its metrics: the library's PPO-critic loop in one page.

Each rollout is a random prompt (left-padded) and a random response (right-padded). The terminal reward counts
the response's "good" tokens (ids below 4, a quarter of the vocabulary), so the value of a position depends on
what was generated so far. Explained variance of the values against the returns rises as the critic learns.
Run: `python examples/quickstart.py [--steps N]`.
"""

from __future__ import annotations

import argparse

import torch

from ppo_critic import DataParallelPPOCritic, build_value_model
from ppo_critic.algos import compute_gae_advantage_return, explained_variance

VOCAB, PROMPT, RESPONSE, GOOD = 16, 8, 12, 4


def rollouts(batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A batch in verl's layout (DESIGN §3) with token-level rewards on each response's last token."""
    input_ids = torch.randint(0, VOCAB, (batch_size, PROMPT + RESPONSE), generator=generator)
    prompt_len = torch.randint(2, PROMPT + 1, (batch_size,), generator=generator)
    response_len = torch.randint(1, RESPONSE + 1, (batch_size,), generator=generator)
    pos = torch.arange(PROMPT + RESPONSE)
    attention_mask = ((pos >= PROMPT - prompt_len[:, None]) & (pos < PROMPT + response_len[:, None])).long()
    response_mask = attention_mask[:, PROMPT:]
    good = ((input_ids[:, PROMPT:] < GOOD) & response_mask.bool()).sum(-1).float()
    rewards = torch.zeros(batch_size, RESPONSE)
    rewards[torch.arange(batch_size), response_len - 1] = good / 4
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, PROMPT:],
        "token_level_rewards": rewards,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="PPO iterations (one rollout batch each)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = build_value_model(
        {
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": VOCAB,
            "max_position_embeddings": 64,
        },
        value_head_init="zero",
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    config = {
        "ppo_mini_batch_size": args.batch_size // 2,
        "ppo_micro_batch_size_per_gpu": args.batch_size // 8,
        "ppo_epochs": 2,
        "shuffle": True,
        "data_loader_seed": args.seed,
        "cliprange_value": 0.5,
    }
    critic = DataParallelPPOCritic(config, model, optimizer)
    generator = torch.Generator().manual_seed(args.seed)
    print(f"{'step':>4} {'vf_loss':>8} {'clipfrac':>8} {'grad_norm':>9} {'EV(values,returns)':>18} {'tok/s':>8}")
    for step in range(1, args.steps + 1):
        batch = rollouts(args.batch_size, generator)
        batch["values"] = critic.compute_values(batch)
        mask = batch["attention_mask"][:, PROMPT:]
        _, batch["returns"] = compute_gae_advantage_return(
            batch["token_level_rewards"], batch["values"], mask, gamma=1.0, lam=0.95
        )
        ev = explained_variance(batch["values"], batch["returns"], mask).item()
        m = critic.update_critic(batch)
        print(
            f"{step:>4} {m['critic/vf_loss']:>8.4f} {m['critic/vf_clipfrac']:>8.3f} {m['critic/grad_norm']:>9.3f}"
            f" {ev:>18.3f} {m['perf/tokens_per_s']:>8.0f}"
        )


if __name__ == "__main__":
    main()
