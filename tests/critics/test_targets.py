"""critic.targets_lam (issue 53): the critic regresses on returns of its own λ, recomputed from the batch's rewards and
old values (VC-PPO's decoupled λ) where a trainer hands over returns of the actor's λ (verl's)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_batch
from ppo_critic import DataParallelPPOCritic
from ppo_critic.algos import compute_gae_advantage_return
from ppo_critic.cli import load_config
from ppo_critic.config.critic import CriticConfig
from ppo_critic.data.batch import Batch


def trained(tiny_qwen2, batch, **config) -> dict[str, torch.Tensor]:
    """The parameters after one update (SGD) of a fresh tiny critic on `batch`."""
    torch.manual_seed(0)
    model = tiny_qwen2()
    critic = DataParallelPPOCritic(
        {"ppo_mini_batch_size": 4, **config}, model, torch.optim.SGD(model.parameters(), lr=0.1)
    )
    critic.update_critic(batch)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def rewarded(seed: int = 0) -> dict[str, torch.Tensor]:
    batch = make_batch(8, 6, 5, seed=seed)
    batch["token_level_rewards"] = torch.randn(batch["returns"].shape, generator=torch.Generator().manual_seed(seed))
    return batch


def test_the_critic_trains_on_its_own_lambdas_returns_instead_of_the_batchs(tiny_qwen2):
    batch = rewarded()
    own = trained(tiny_qwen2, batch, targets_lam=0.5, targets_gamma=0.9)
    mask = Batch.from_any(batch).response_mask
    expected = compute_gae_advantage_return(batch["token_level_rewards"], batch["values"], mask, 0.9, 0.5)[1]
    fed = trained(tiny_qwen2, {**batch, "returns": expected})
    assert all(torch.equal(p, fed[name]) for name, p in own.items())
    handed = trained(tiny_qwen2, batch)  # the batch's own returns: another update
    assert not all(torch.equal(p, handed[name]) for name, p in own.items())


def test_at_lambda_one_the_targets_are_the_discounted_rewards_to_go_whatever_the_values(tiny_qwen2):
    batch = rewarded(seed=1)
    other_values = {**batch, "values": batch["values"] + 3.0}
    one, two = (trained(tiny_qwen2, b, targets_lam=1.0, cliprange_value=None) for b in (batch, other_values))
    mask = Batch.from_any(batch).response_mask
    to_go = compute_gae_advantage_return(batch["token_level_rewards"], batch["values"] * 0, mask, 1.0, 1.0)[1]
    fed = trained(tiny_qwen2, {**batch, "returns": to_go}, cliprange_value=None)
    # (to_go − V) + V equals to_go to float32 rounding (~1e-7 here): one SGD step at lr 0.1 carries it no further
    assert all(
        torch.allclose(p, fed[name], atol=1e-6) and torch.allclose(p, two[name], atol=1e-6) for name, p in one.items()
    )


def test_verls_v1_trainers_rm_scores_stand_for_the_rewards(tiny_qwen2):
    """verl 0.9's v1 trainer hands its critic `rm_scores` (the rewards, unless a KL penalty made them
    token_level_rewards, which it then hands over too, and which win)."""
    batch = rewarded(seed=2)
    scores = {**batch, "rm_scores": batch.pop("token_level_rewards")}
    with_both = {**scores, "token_level_rewards": scores["rm_scores"] * 0}
    fed = trained(tiny_qwen2, rewarded(seed=2), targets_lam=0.5)
    for other, same in ((scores, True), (with_both, False)):
        got = trained(tiny_qwen2, other, targets_lam=0.5)
        assert all(torch.equal(p, fed[name]) for name, p in got.items()) is same


def test_a_batch_without_rewards_is_refused_naming_the_option(tiny_qwen2):
    with pytest.raises(ValueError, match=r"critic.targets_lam=1.0 recomputes .* no token_level_rewards"):
        trained(tiny_qwen2, make_batch(8, 6, 5), targets_lam=1.0)
    batch = rewarded()
    batch["token_level_rewards"] = batch["token_level_rewards"][:, :3]
    with pytest.raises(ValueError, match=r"one reward per response token"):
        trained(tiny_qwen2, batch, targets_lam=1.0)


@pytest.mark.parametrize(
    "option, message",
    [
        ({"targets_lam": 1.5}, "targets_lam=1.5 must be a number in [0, 1] or null"),
        ({"targets_lam": True}, "targets_lam=True must be a number in [0, 1] or null"),
        ({"targets_gamma": None}, "targets_gamma=None must be a number in [0, 1]"),
        ({"targets_gamma": -0.1}, "targets_gamma=-0.1 must be a number in [0, 1]"),
    ],
)
def test_an_invalid_targets_option_is_refused_naming_it(option, message):
    with pytest.raises(ValueError) as refused:
        CriticConfig(**option).validate(prefix="critic.", worker=False)
    assert "critic." + message in str(refused.value)


def test_ppo_critic_train_refuses_it_naming_its_own_keys():
    """The built-in trainer computes its critic's targets itself (trainer.lam): two λs for one thing are refused."""
    with pytest.raises(ValueError, match=r"critic.targets_lam=1.0 is for verl's trainer; .* trainer.lam"):
        load_config(None, ["critic.targets_lam=1.0"])
