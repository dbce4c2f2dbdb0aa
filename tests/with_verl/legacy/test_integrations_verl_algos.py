"""verl's functions, verbatim: `ppo_critic.algos` takes verl's positional and keyword signatures and gives verl's
numbers (where it deliberately differs — zeros at masked positions — the test says so)."""

from __future__ import annotations

import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F

from ppo_critic import algos
from verl_shared import MODES

# verl adds 1e-8 to its count denominators (masked_mean, seq-mean-token-mean); ours divide by the count (>= 1). In
# float64 that is the only difference: relative <= 1e-8 per division, so 2e-8 on O(1) numbers bounds it.
EPS = {"rtol": 2e-8, "atol": 2e-8}


def sample(seed: int = 0, b: int = 6, r: int = 7):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, r, generator=g) > 0.3).float()
    mask[:, 0] = 1  # every row has a valid token (verl's masked_var refuses fewer than two overall)
    mask[-1, 1:] = 0  # and one row has exactly one
    vpreds, returns, values = (torch.randn(b, r, generator=g, dtype=torch.float64) for _ in range(3))
    return vpreds, returns, values, mask.double()


@pytest.mark.parametrize("mode", MODES)
def test_value_loss_positional_and_keyword_as_in_verl(mode):
    vpreds, returns, values, mask = sample()
    theirs = core_algos.compute_value_loss(vpreds, returns, values, mask, 0.2, mode)
    ours = algos.compute_value_loss(vpreds, returns, values, mask, 0.2, mode)
    keyword = algos.compute_value_loss(
        vpreds=vpreds, values=values, returns=returns, response_mask=mask, cliprange_value=0.2, loss_agg_mode=mode
    )
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **EPS)
    assert all(torch.equal(a, k) for a, k in zip(ours, keyword, strict=True))


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_positional_with_global_denominators_as_in_verl(mode):
    loss_mat, _, _, mask = sample(seed=1)
    for args in ((), (4, 37.0, 9.0, 11.0), (2, None, None, None)):
        if args and args[0] > 1 and args[1] is None:
            continue  # verl raises without global denominators at dp_size > 1; we fall back to the local ones
        theirs = core_algos.agg_loss(loss_mat, mask, mode, *args)
        ours = algos.agg_loss(loss_mat, mask, mode, *args)
        torch.testing.assert_close(ours, theirs, **EPS)
    keyword = {"dp_size": 4, "batch_num_tokens": 37.0, "global_batch_size": 9.0, "loss_scale_factor": 11.0}
    torch.testing.assert_close(
        algos.agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=mode, **keyword),
        core_algos.agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=mode, **keyword),
        **EPS,
    )


def test_gae_as_in_verl_at_valid_positions_and_zero_elsewhere():
    rewards, values, _, mask = sample(seed=2)
    theirs = core_algos.compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8)
    ours = algos.compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8)
    keyword = algos.compute_gae_advantage_return(
        token_level_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.8
    )
    valid = mask.bool()
    for a, b, k in zip(ours, theirs, keyword, strict=True):
        torch.testing.assert_close(a[valid], b[valid], **EPS)
        assert (a[~valid] == 0).all() and torch.equal(a, k)  # verl leaves carried values at masked positions


def test_masked_statistics_take_verls_names():
    x, _, _, mask = sample(seed=3)
    for axis in (None, 0, -1):
        torch.testing.assert_close(
            algos.masked_mean(values=x, mask=mask, axis=axis), verl_F.masked_mean(x, mask, axis), **EPS
        )
        torch.testing.assert_close(
            algos.masked_sum(values=x, mask=mask, axis=axis), verl_F.masked_sum(x, mask, axis), **EPS
        )
    torch.testing.assert_close(
        algos.masked_var(x, mask, unbiased=True), verl_F.masked_var(x, mask, unbiased=True), **EPS
    )
    for shift in (True, False):
        ours = algos.masked_whiten(values=x, mask=mask, shift_mean=shift)
        theirs = verl_F.masked_whiten(x, mask, shift_mean=shift)
        torch.testing.assert_close(ours[mask.bool()], theirs[mask.bool()], **EPS)
