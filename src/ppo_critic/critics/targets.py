"""The critic's own regression targets (`critic.targets_lam`): VC-PPO's decoupled λ inside a trainer that hands
its critic returns under the actor's λ (verl's: one `algorithm.lam` for both)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from ppo_critic.algos import compute_gae_advantage_return
from ppo_critic.config.critic import CriticConfig

REWARDS = "token_level_rewards"
SCORES = "rm_scores"  # verl 0.9's v1 trainer keeps the rewards under this name unless a KL penalty changed them


def own_returns(tensors: Mapping[str, Tensor], mask: Tensor, config: CriticConfig) -> Tensor:
    """[B, R] GAE returns under `targets_gamma` and `targets_lam` (set) from the batch's rewards
    (`token_level_rewards`, else `rm_scores`) and old values, in the values' dtype."""
    lam = config.targets_lam
    rewards_key = REWARDS if REWARDS in tensors or SCORES not in tensors else SCORES
    missing = [key for key in (rewards_key, "values") if key not in tensors]
    if missing:
        raise ValueError(
            f"critic.targets_lam={lam} recomputes the returns from the batch's {REWARDS} and old values, but the "
            f"batch has no {' or '.join(missing)}: hand them over (verl's trainer does), or set "
            "critic.targets_lam=null to train on the batch's returns"
        )
    rewards, values = tensors[rewards_key], tensors["values"]
    if rewards.shape != values.shape:
        raise ValueError(
            f"batch[{rewards_key!r}] has shape {tuple(rewards.shape)} and batch['values'] {tuple(values.shape)}: "
            "critic.targets_lam needs one reward per response token"
        )
    returns = compute_gae_advantage_return(rewards, values, mask, config.targets_gamma, lam)[1]
    return returns.to(values.dtype)
