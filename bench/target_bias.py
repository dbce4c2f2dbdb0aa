"""Bias of the critic's λ-return targets under each λ rule, measured with the *true* values as the bootstrap.

With a perfect critic every fixed λ gives returns that average to the values; a λ chosen by a response's own length
need not (docs/QUALITY.md, "Whose length"). Two measurements per suite task, rollouts as `ppo-critic train` draws
them (batches of the suite's size, seed 0):

- z: the mean over responses of Σ_t (return_t − value_t), in standard errors (responses are independent);
- on `lengths` also the critic's fixed point under each rule: the mean return of every state (pace, position, targets
  seen), whose explained variance of the true values bounds what a critic regressed on those targets can reach.

    python bench/target_bias.py            # prints two markdown tables
"""

from __future__ import annotations

import torch

from ppo_critic.algos import compute_gae_advantage_return, explained_variance, length_adaptive_lambda
from ppo_critic.tasks import TASKS

TASK_SETTINGS = {"counting": 1.0, "dense": 0.9, "recall": 1.0, "lengths": 1.0, "scale": 1.0, "long": 1.0}  # γ
BATCH = {"long": 96, "recall": 96}  # rollouts per iteration in the suite (192 otherwise)
RULES = {"λ 1": 1.0, "λ 0.8": 0.8, "α 0.5, own length": ("response", 0.5), "α 0.5, batch mean": ("batch", 0.5)}


def returns_of(rule, batch: dict, values: torch.Tensor, gamma: float) -> torch.Tensor:
    """The λ-returns of `batch` bootstrapped from `values` under one of `RULES` (or an α for the own-length rule)."""
    mask = batch["response_mask"]
    if isinstance(rule, tuple):
        scope, alpha = rule
        rule = length_adaptive_lambda(mask, alpha, torch.float64, gamma=gamma, scope=scope)
    return compute_gae_advantage_return(batch["token_level_rewards"].double(), values, mask, gamma, rule)[1]


def z_table(batches: int = 64) -> str:
    lines = ["| task | " + " | ".join(RULES) + " |", "|---|" + "---|" * len(RULES)]
    for name, gamma in TASK_SETTINGS.items():
        task, generator = TASKS[name][0](), torch.Generator().manual_seed(0)
        sums: dict[str, list] = {rule: [] for rule in RULES}
        for _ in range(batches // 4 if name == "long" else batches):
            batch = task.sample(BATCH.get(name, 192), generator)
            values = task.true_values(batch, gamma=gamma).double()
            for rule, out in sums.items():
                out.append(((returns_of(RULES[rule], batch, values, gamma) - values) * batch["response_mask"]).sum(-1))
        cells = []
        for out in sums.values():
            s = torch.cat(out)
            cells.append(f"{s.mean().item():+.3f} (z {s.mean().item() / (s.std().item() / len(s) ** 0.5):+.1f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fixed_point_table(batches: int = 40, size: int = 4096) -> str:
    task, generator = TASKS["lengths"][0](), torch.Generator().manual_seed(0)
    parts = [task.sample(size, generator) for _ in range(batches)]
    batch = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
    values, mask = batch["true_values"].double(), batch["response_mask"]
    valid = mask.bool()
    targets, paces = task.read_prompt(batch)
    m, width = task.config.min_count, task.response_width
    hits = ((batch["responses"] == targets[:, None]) & valid).long()
    seen = (hits.cumsum(-1) - hits).clamp(max=m)
    state = ((paces[:, None] * width + torch.arange(width)) * (m + 1) + seen)[valid]
    lines = [
        f"The critic's fixed point on `lengths` ({batches * size} responses):",
        "",
        "| rule on `lengths` | EV of the fixed point vs the truth | mean abs(fixed point − truth) |",
        "|---|---|---|",
    ]
    rules = {**RULES, **{f"α {a}, own length": ("response", a) for a in (0.2, 1.0, 2.0)}}
    for rule, how in rules.items():
        returns = returns_of(how, batch, values, 1.0)[valid]
        total = torch.zeros(int(state.max()) + 1, dtype=torch.float64).index_add_(0, state, returns)
        count = torch.zeros_like(total).index_add_(0, state, torch.ones_like(returns))
        point = torch.zeros_like(values)
        point[valid] = (total / count.clamp(min=1))[state]
        ev = explained_variance(point, values, mask).item()
        lines.append(f"| {rule} | {ev:.4f} | {(point - values)[valid].abs().mean().item():.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("Σ_t (return − true value) per response, mean (z):\n")
    print(z_table())
    print()
    print(fixed_point_table())
