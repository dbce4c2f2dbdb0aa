"""Hand-computed checks of the PPO value math in `ppo_critic.algos` (DESIGN §3).

Every expected number below is written out and derived by hand in the comments; nothing re-implements the
function under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from ppo_critic.algos import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_decoupled_gae_advantage_return,
    compute_gae_advantage_return,
    compute_length_adaptive_gae_advantage_return,
    compute_value_loss,
    doubled_error_loss,
    explained_variance,
    length_adaptive_lambda,
    masked_mean,
    masked_var,
    masked_whiten,
    shared_prefix_mean,
)

NAN, INF = float("nan"), float("inf")
F64 = torch.float64
# Tolerances: `assert_close`'s defaults unless a line says otherwise (float64: rtol 1e-7, atol 1e-7; float32: rtol
# 1.3e-6 ~ 22 unit roundoffs u = 2**-24, atol 1e-5). Each check is a handful of float ops (< 10 roundings, each
# <= u or 2**-53 relative) on O(1) numbers, against a hand value that is exact or written to 7 significant digits
# (<= 5e-8 relative), so the defaults bound it on any IEEE-754 CPU; a bug moves the numbers by > 1e-3.
UNIT_ROUNDOFF_F32 = 2.0**-24


def t64(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# --------------------------------------------------------------------------------------------------------------
# compute_value_loss
# --------------------------------------------------------------------------------------------------------------
# Clip range c = 0.5. Row 0 is fully valid, row 1 has its last token masked, row 2 is fully masked.
#
# row 0:  vpred  v_old  return  clip range   vclip   l1=(vpred-R)^2      l2=(vclip-R)^2     max     l2>l1
#   t0    2.0    1.0    3.0     [0.5, 1.5]   1.5     1                   2.25               2.25    yes
#   t1    0.25   0.0    1.0     [-.5, 0.5]   0.25    0.5625              0.5625             0.5625  no
#   t2    1.0    2.0    1.0     [1.5, 2.5]   1.5     0                   0.25               0.25    yes
#   row sum 3.0625 = 49/16 over 3 tokens            (unclipped row sum: 1 + 0.5625 + 0 = 1.5625 = 25/16)
# row 1:
#   t0   -1.0    0.0    0.0     [-.5, 0.5]  -0.5     1                   0.25               1       no
#   t1    1.0    2.0    0.5     [1.5, 2.5]   1.5     0.25                1                  1       yes
#   t2    masked (garbage)
#   row sum 2 over 2 tokens                          (unclipped row sum: 1 + 0.25 = 1.25 = 5/4)
# row 2: masked (garbage)
#
# valid tokens 5, non-empty sequences 2, horizon R = 3, clipped (l2 > l1) tokens 3 -> clipfrac 3/5 = 0.6
# clipped total 81/16 = 5.0625:
#   token-mean               0.5 * 5.0625 / 5            = 0.50625
#   seq-mean-token-sum       0.5 * 5.0625 / 2            = 1.265625
#   seq-mean-token-mean      0.5 * (49/48 + 2/2) / 2     = 97/192
#   seq-mean-token-sum-norm  0.5 * 5.0625 / (2 * 3)      = 0.421875
# unclipped total 45/16 = 2.8125:
#   token-mean               0.5 * 2.8125 / 5            = 0.28125
#   seq-mean-token-sum       0.5 * 2.8125 / 2            = 0.703125
#   seq-mean-token-mean      0.5 * (25/48 + 5/8) / 2     = 55/192
#   seq-mean-token-sum-norm  0.5 * 2.8125 / (2 * 3)      = 0.234375
CLIP = 0.5
CLIPPED_LOSS = {
    "token-mean": 0.50625,
    "seq-mean-token-sum": 1.265625,
    "seq-mean-token-mean": 97 / 192,
    "seq-mean-token-sum-norm": 0.421875,
}
UNCLIPPED_LOSS = {
    "token-mean": 0.28125,
    "seq-mean-token-sum": 0.703125,
    "seq-mean-token-mean": 55 / 192,
    "seq-mean-token-sum-norm": 0.234375,
}


def value_loss_inputs(garbage: float = 100.0):
    """The example above; `garbage` fills every masked position of vpreds, returns and values."""
    g = garbage
    vpreds = t64([[2.0, 0.25, 1.0], [-1.0, 1.0, g], [g, g, g]])
    returns = t64([[3.0, 1.0, 1.0], [0.0, 0.5, g], [g, g, g]])
    values = t64([[1.0, 0.0, 2.0], [0.0, 2.0, g], [g, g, g]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    return vpreds, returns, values, mask


def test_loss_agg_modes_are_the_four_documented():
    assert set(LOSS_AGG_MODES) == set(CLIPPED_LOSS)


@pytest.mark.parametrize("mode", list(CLIPPED_LOSS))
def test_value_loss_clipped(mode):
    vf_loss, clipfrac = compute_value_loss(*value_loss_inputs(), cliprange_value=CLIP, loss_agg_mode=mode)
    assert_close(vf_loss, torch.tensor(CLIPPED_LOSS[mode], dtype=F64))
    assert_close(clipfrac, torch.tensor(0.6, dtype=F64))


@pytest.mark.parametrize("mode", list(UNCLIPPED_LOSS))
def test_value_loss_without_clipping(mode):
    vf_loss, clipfrac = compute_value_loss(*value_loss_inputs(), cliprange_value=None, loss_agg_mode=mode)
    assert_close(vf_loss, torch.tensor(UNCLIPPED_LOSS[mode], dtype=F64))
    assert clipfrac.item() == 0.0


def test_value_loss_default_mode_is_token_mean():
    vf_loss, _ = compute_value_loss(*value_loss_inputs(), cliprange_value=CLIP)
    assert_close(vf_loss, torch.tensor(0.50625, dtype=F64))


def test_value_loss_wide_cliprange_equals_unclipped():
    # c = 10 contains every vpred: vclip == vpred, so l2 == l1 and nothing counts as clipped.
    vf_loss, clipfrac = compute_value_loss(*value_loss_inputs(), cliprange_value=10.0)
    assert_close(vf_loss, torch.tensor(0.28125, dtype=F64))
    assert clipfrac.item() == 0.0


def test_value_loss_bool_mask_and_float_mask_agree():
    vpreds, returns, values, mask = value_loss_inputs()
    for m in (mask.bool(), mask.to(F64)):
        vf_loss, clipfrac = compute_value_loss(vpreds, returns, values, m, CLIP, "seq-mean-token-mean")
        assert_close(vf_loss, torch.tensor(97 / 192, dtype=F64))
        assert_close(clipfrac, torch.tensor(0.6, dtype=F64))


@pytest.mark.parametrize("garbage", [NAN, INF, -INF])
@pytest.mark.parametrize("mode", list(CLIPPED_LOSS))
def test_value_loss_ignores_nonfinite_padding_in_loss_and_grad(mode, garbage):
    vpreds, returns, values, mask = value_loss_inputs(garbage)
    vpreds.requires_grad_(True)
    vf_loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, CLIP, mode)
    assert_close(vf_loss.detach(), torch.tensor(CLIPPED_LOSS[mode], dtype=F64))
    assert_close(clipfrac, torch.tensor(0.6, dtype=F64))
    vf_loss.backward()
    grad = vpreds.grad
    assert torch.isfinite(grad).all()
    assert (grad[~mask.bool()] == 0).all()
    if mode == "token-mean":
        # d/dvpred of 0.5 * max(l1, l2) / 5: zero where the clipped branch wins (vclip is a clamped constant),
        # (vpred - R) / 5 where l1 wins or l1 == l2 (vclip == vpred): row0 t1 (0.25-1)/5, row1 t0 (-1-0)/5.
        assert_close(grad, t64([[0.0, -0.15, 0.0], [-0.2, 0.0, 0.0], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("cliprange", [CLIP, None])
@pytest.mark.parametrize("mode", list(CLIPPED_LOSS))
def test_value_loss_fully_masked_batch_is_zero(mode, cliprange):
    vpreds = t64([[NAN, 1.0, INF], [2.0, -INF, NAN]]).requires_grad_(True)
    returns = t64([[NAN, 3.0, -INF], [INF, 0.0, NAN]])
    values = t64([[INF, NAN, 1.0], [NAN, NAN, -INF]])
    mask = torch.zeros(2, 3, dtype=torch.long)
    vf_loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange, mode)
    assert vf_loss.item() == 0.0
    assert clipfrac.item() == 0.0
    vf_loss.backward()
    assert (vpreds.grad == 0).all()
    # Also with (zero) global denominators, as a rank whose whole share of the mini-batch is padding sees them.
    vf_loss, _ = compute_value_loss(
        vpreds, returns, values, mask, cliprange, mode, batch_num_tokens=0, global_batch_size=0, dp_size=2
    )
    assert vf_loss.item() == 0.0


def test_unknown_loss_agg_mode_raises_naming_it():
    vpreds, returns, values, mask = value_loss_inputs()
    with pytest.raises(ValueError, match="seq-mean-token-median"):
        compute_value_loss(vpreds, returns, values, mask, CLIP, loss_agg_mode="seq-mean-token-median")
    with pytest.raises(ValueError, match="token_mean"):
        agg_loss(torch.ones(1, 2), torch.ones(1, 2), "token_mean")


# --------------------------------------------------------------------------------------------------------------
# agg_loss with global denominators
# --------------------------------------------------------------------------------------------------------------
# A [4, 3] loss matrix; garbage at masked positions.
#   row 0  [1, 2, 3]      mask 1 1 1   sum 6  tokens 3  token-mean of row 2
#   row 1  [4, *, *]      mask 1 0 0   sum 4  tokens 1  token-mean of row 4
#   row 2  [*, *, *]      mask 0 0 0   empty
#   row 3  [2, 6, *]      mask 1 1 0   sum 8  tokens 2  token-mean of row 4
# whole batch: 6 valid tokens, 3 non-empty sequences, total 18, R = 3
#   token-mean              18 / 6        = 3
#   seq-mean-token-sum      18 / 3        = 6
#   seq-mean-token-mean     (2+4+4) / 3   = 10/3
#   seq-mean-token-sum-norm 18 / (3 * 3)  = 2
# halves (rows 0-1: total 10, row means 2+4 = 6; rows 2-3: total 8, row means 4), whole-batch denominators:
#   token-mean              10/6 + 8/6
#   seq-mean-token-sum      10/3 + 8/3
#   seq-mean-token-mean     6/3 + 4/3
#   seq-mean-token-sum-norm 10/9 + 8/9
AGG_LOSS_MAT = t64([[1.0, 2.0, 3.0], [4.0, NAN, INF], [NAN, -INF, 5.0], [2.0, 6.0, NAN]])
AGG_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]])
AGG_WHOLE = {
    "token-mean": 3.0,
    "seq-mean-token-sum": 6.0,
    "seq-mean-token-mean": 10 / 3,
    "seq-mean-token-sum-norm": 2.0,
}
AGG_HALVES = {
    "token-mean": (10 / 6, 8 / 6),
    "seq-mean-token-sum": (10 / 3, 8 / 3),
    "seq-mean-token-mean": (6 / 3, 4 / 3),
    "seq-mean-token-sum-norm": (10 / 9, 8 / 9),
}
GLOBAL = {"batch_num_tokens": 6, "global_batch_size": 3}


def scalar(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_local_denominators(mode):
    assert_close(agg_loss(AGG_LOSS_MAT, AGG_MASK, mode), scalar(AGG_WHOLE[mode]))
    # Passing the whole batch's own counts explicitly changes nothing.
    assert_close(agg_loss(AGG_LOSS_MAT, AGG_MASK, mode, **GLOBAL), scalar(AGG_WHOLE[mode]))


@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_halves_with_global_denominators_sum_to_whole(mode, as_tensor):
    norm = {k: torch.tensor(v) if as_tensor else v for k, v in GLOBAL.items()}
    first = agg_loss(AGG_LOSS_MAT[:2], AGG_MASK[:2], mode, **norm)
    second = agg_loss(AGG_LOSS_MAT[2:], AGG_MASK[2:], mode, **norm)
    assert_close(first, scalar(AGG_HALVES[mode][0]))
    assert_close(second, scalar(AGG_HALVES[mode][1]))
    assert_close(first + second, scalar(AGG_WHOLE[mode]))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_dp_size_multiplies(mode):
    # Two DP ranks hold one half each; DP averages gradients, so each rank's loss is scaled by dp_size = 2
    # and the average over ranks equals the whole-batch loss.
    first = agg_loss(AGG_LOSS_MAT[:2], AGG_MASK[:2], mode, dp_size=2, **GLOBAL)
    second = agg_loss(AGG_LOSS_MAT[2:], AGG_MASK[2:], mode, dp_size=2, **GLOBAL)
    assert_close(first, scalar(2 * AGG_HALVES[mode][0]))
    assert_close(second, scalar(2 * AGG_HALVES[mode][1]))
    assert_close((first + second) / 2, scalar(AGG_WHOLE[mode]))
    assert_close(agg_loss(AGG_LOSS_MAT, AGG_MASK, mode, dp_size=4), scalar(4 * AGG_WHOLE[mode]))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_trimmed_micro_batch_with_loss_scale_factor(mode):
    # Rows 2-3 have nothing valid in column 2: a micro-batch trimmed to width 2 (as after removing padding)
    # must give the same share when the horizon is pinned to the whole batch's R = 3.
    second = agg_loss(AGG_LOSS_MAT[2:, :2], AGG_MASK[2:, :2], mode, loss_scale_factor=3, **GLOBAL)
    assert_close(second, scalar(AGG_HALVES[mode][1]))


def test_agg_loss_scale_factor_sets_the_horizon():
    # seq-mean-token-sum-norm: 18 / (3 sequences * horizon 4) = 1.5; the default horizon is R = 3 (-> 2).
    assert_close(agg_loss(AGG_LOSS_MAT, AGG_MASK, "seq-mean-token-sum-norm", loss_scale_factor=4), scalar(1.5))
    # Only seq-mean-token-sum-norm reads it.
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert_close(agg_loss(AGG_LOSS_MAT, AGG_MASK, mode, loss_scale_factor=4), scalar(AGG_WHOLE[mode]))


@pytest.mark.parametrize("mode", list(CLIPPED_LOSS))
def test_value_loss_forwards_global_denominators(mode):
    # The value-loss example split into row 0 and rows 1-2; whole-batch counts: 5 tokens, 2 sequences.
    vpreds, returns, values, mask = value_loss_inputs(NAN)
    norm = {"batch_num_tokens": 5, "global_batch_size": 2}
    first, clip0 = compute_value_loss(vpreds[:1], returns[:1], values[:1], mask[:1], CLIP, mode, **norm)
    second, clip1 = compute_value_loss(vpreds[1:], returns[1:], values[1:], mask[1:], CLIP, mode, **norm)
    assert_close(first + second, torch.tensor(CLIPPED_LOSS[mode], dtype=F64))
    # clipfrac stays the micro-batch's own token mean: row 0 has 2/3 clipped, rows 1-2 have 1/2.
    assert_close(clip0, torch.tensor(2 / 3, dtype=F64))
    assert_close(clip1, torch.tensor(0.5, dtype=F64))


# --------------------------------------------------------------------------------------------------------------
# compute_gae_advantage_return
# --------------------------------------------------------------------------------------------------------------
GAMMA, LAM = 0.9, 0.8  # gamma * lam = 0.72


def test_gae_right_padded_hand_example():
    # row 0 (all valid): rewards [0, 0, 1], values [0.5, 0.2, 0.4]
    #   t2: delta = 1 + 0.9*0 - 0.4 = 0.6                 gae = 0.6
    #   t1: delta = 0 + 0.9*0.4 - 0.2 = 0.16              gae = 0.16 + 0.72*0.6 = 0.592
    #   t0: delta = 0 + 0.9*0.2 - 0.5 = -0.32             gae = -0.32 + 0.72*0.592 = 0.10624
    #   returns = gae + values = [0.60624, 0.792, 1.0]
    # row 1 (last token padding, garbage reward 9 / value 7 there): rewards [0, 2, *], values [1.0, 0.5, *]
    #   t1: delta = 2 + 0 - 0.5 = 1.5                     gae = 1.5
    #   t0: delta = 0 + 0.9*0.5 - 1.0 = -0.55             gae = -0.55 + 0.72*1.5 = 0.53
    #   returns = [1.53, 2.0, 0]
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    values = torch.tensor([[0.5, 0.2, 0.4], [1.0, 0.5, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, GAMMA, LAM)

    assert_close(returns, torch.tensor([[0.60624, 0.792, 1.0], [1.53, 2.0, 0.0]]))

    # Whitening the raw advantages [0.10624, 0.592, 0.6, 0.53, 1.5] over the 5 valid tokens:
    #   mean 3.32824 / 5 = 0.665648
    #   deviations [-0.559408, -0.073648, -0.065648, -0.135648, 0.834352], squares sum 1.03721463808
    #   unbiased var 1.03721463808 / 4 = 0.25930365952, std 0.50921867554
    #   whitened = deviations / std = [-1.0985614, -0.1446294, -0.1289191, -0.2663846, 1.6384945]
    expected = torch.tensor([[-1.0985614, -0.1446294, -0.1289191], [-0.2663846, 1.6384945, 0.0]])
    assert_close(advantages, expected)
    raw = torch.tensor([[0.10624, 0.592, 0.6], [0.53, 1.5, 0.0]])
    assert_close(advantages, masked_whiten(raw, mask) * mask)
    assert advantages[1, 2].item() == 0.0
    # float32, 5 values, |a| <= 1.64: the mean is off by the rounding of the whitening mean (<= 4u·Σ|x| / 5 / std
    # ~ 6.5u) plus that of each a (2u·|a|) and of the new mean (4u·mean|a|): <= ~11u -> 16u. The variance (all
    # terms >= 0, no cancellation) by <= 2 x std's (5u) + 2 x each a's (2u) + the new variance's (8u) = 22u -> 24u.
    assert_close(masked_mean(advantages, mask), torch.tensor(0.0), atol=16 * UNIT_ROUNDOFF_F32, rtol=0)
    assert_close(masked_var(advantages, mask), torch.tensor(1.0), atol=24 * UNIT_ROUNDOFF_F32, rtol=0)


def test_gae_takes_a_lambda_per_token():
    """A [B, R] λ is λ_t of A_t = δ_t + γ·λ_t·A_{t+1}: constant over t it is the row's λ; λ_1 = 0 cuts row 0's
    returns at t1 to the one-step target, while its t0 still sees λ_0 = 1 over the cut."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    values = torch.tensor([[0.5, 0.2, 0.4], [1.0, 0.5, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rows = torch.tensor([0.8, 0.3])
    per_row = compute_gae_advantage_return(rewards, values, mask, GAMMA, rows)
    per_token = compute_gae_advantage_return(rewards, values, mask, GAMMA, rows[:, None].expand(-1, 3))
    assert all(torch.equal(a, b) for a, b in zip(per_row, per_token, strict=True))
    lam = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    _, returns = compute_gae_advantage_return(rewards, values, mask, GAMMA, lam)
    # row 0: t2 return 1.0; t1 = 0 + 0.9·0.4 = 0.36 (λ_1 = 0); t0 = 0 + 0.9·0.36 = 0.324 (λ_0 = 1: the return of t1)
    # row 1 (λ 1): t1 2.0, t0 0 + 0.9·2.0 = 1.8
    assert_close(returns, torch.tensor([[0.324, 0.36, 1.0], [1.8, 2.0, 0.0]]))


def test_gae_interior_masked_gap_carries_next_value():
    # mask [1, 0, 1]; the masked middle token has garbage reward 100 / value -50 that must not matter.
    #   t2: delta = 1.0 + 0 - 0.3 = 0.7                   gae = 0.7
    #   t1: masked -> advantage 0; next value stays 0.3, last gae stays 0.7
    #   t0: delta = 0.5 + 0.9*0.3 - 0.2 = 0.57            gae = 0.57 + 0.72*0.7 = 1.074
    #   returns = [1.074 + 0.2, 0, 0.7 + 0.3] = [1.274, 0, 1.0]
    # Whitened over two valid tokens (unbiased var): always -/+ 1/sqrt(2); 1.074 > 0.7, so [+, 0, -].
    rewards = torch.tensor([[0.5, 100.0, 1.0]])
    values = torch.tensor([[0.2, -50.0, 0.3]])
    mask = torch.tensor([[1, 0, 1]])
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, GAMMA, LAM)
    assert_close(returns, torch.tensor([[1.274, 0.0, 1.0]]))
    s = 1 / math.sqrt(2)
    assert_close(advantages, torch.tensor([[s, 0.0, -s]]))


def test_gae_nonfinite_padding_and_empty_row():
    # Row 0 as in the gap test but with NaN / Inf in the gap; row 1 is fully masked (all garbage).
    rewards = torch.tensor([[0.5, NAN, 1.0], [INF, NAN, -INF]])
    values = torch.tensor([[0.2, INF, 0.3], [NAN, NAN, INF]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]])
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, GAMMA, LAM)
    assert_close(returns, torch.tensor([[1.274, 0.0, 1.0], [0.0, 0.0, 0.0]]))
    s = 1 / math.sqrt(2)
    assert_close(advantages, torch.tensor([[s, 0.0, -s], [0.0, 0.0, 0.0]]))


def test_gae_fully_masked_batch_is_zero():
    rewards = torch.tensor([[NAN, 1.0], [2.0, INF]])
    advantages, returns = compute_gae_advantage_return(rewards, rewards.clone(), torch.zeros(2, 2), GAMMA, LAM)
    assert (advantages == 0).all()
    assert (returns == 0).all()


# --------------------------------------------------------------------------------------------------------------
# decoupled and length-adaptive GAE (VAPO)
# --------------------------------------------------------------------------------------------------------------
def test_decoupled_gae_hand_example():
    # The right-padded example above (gamma 0.9): the actor's lam 0.8 gives the same raw advantages
    # [0.10624, 0.592, 0.6], [0.53, 1.5] and so the same whitened ones. The critic's lam 1 (gamma*lam = 0.9):
    # row 0: deltas [-0.32, 0.16, 0.6]; t2: 0.6; t1: 0.16 + 0.9*0.6 = 0.7; t0: -0.32 + 0.9*0.7 = 0.31
    #   returns = [0.31 + 0.5, 0.7 + 0.2, 0.6 + 0.4] = [0.81, 0.9, 1.0] (the discounted reward-to-go 0.9², 0.9, 1)
    # row 1: deltas [-0.55, 1.5]; t1: 1.5; t0: -0.55 + 0.9*1.5 = 0.8; returns [1.8, 2.0, 0] (0.9*2, 2)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    values = torch.tensor([[0.5, 0.2, 0.4], [1.0, 0.5, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = compute_decoupled_gae_advantage_return(rewards, values, mask, GAMMA, 0.8, 1.0)
    assert_close(returns, torch.tensor([[0.81, 0.9, 1.0], [1.8, 2.0, 0.0]]))
    assert_close(advantages, torch.tensor([[-1.0985614, -0.1446294, -0.1289191], [-0.2663846, 1.6384945, 0.0]]))


@pytest.mark.parametrize("lam", [0.0, 0.8, 1.0])
def test_decoupled_gae_with_equal_lambdas_is_gae(lam):
    generator = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 6, generator=generator), torch.randn(4, 6, generator=generator)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    expected = compute_gae_advantage_return(rewards, values, mask, GAMMA, lam)
    got = compute_decoupled_gae_advantage_return(rewards, values, mask, GAMMA, lam_actor=lam, lam_critic=lam)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


# Length-adaptive example: alpha 1, gamma 0.5, lam_actor = 1 - 1/l per row:
#   row A, l = 4 -> lam 0.75 (gamma*lam = 0.375): rewards [0, 1, 0, 2], values [1, 0.5, 1, 0.5]
#     t3: delta = 2 + 0 - 0.5 = 1.5                gae = 1.5
#     t2: delta = 0 + 0.5*0.5 - 1 = -0.75          gae = -0.75 + 0.375*1.5 = -0.1875
#     t1: delta = 1 + 0.5*1 - 0.5 = 1.0            gae = 1.0 + 0.375*(-0.1875) = 0.9296875
#     t0: delta = 0 + 0.5*0.5 - 1 = -0.75          gae = -0.75 + 0.375*0.9296875 = -0.4013671875
#   row B, mask [1, 0, 1, 0], l = 2 -> lam 0.5 (gamma*lam = 0.25): rewards [1, *, 4, *], values [2, *, 1, *]
#     t2: delta = 4 + 0 - 1 = 3                    gae = 3
#     t1: masked: advantage 0; the next value stays 1, the last gae 3
#     t0: delta = 1 + 0.5*1 - 2 = -0.5             gae = -0.5 + 0.25*3 = 0.25
#   row C, l = 1 -> lam 0 (a sequence of one token): reward 3, value 1: delta = gae = 3 - 1 = 2
# The critic's lam 1 makes the returns the discounted reward-to-go (values cancel):
#   A: [0 + 0.5*1.5, 1 + 0.5*1, 0 + 0.5*2, 2] = [0.75, 1.5, 1, 2]; B: [1 + 0.5*4, 0, 4, 0]; C: [3, 0, 0, 0]
LA_REWARDS = torch.tensor([[0.0, 1.0, 0.0, 2.0], [1.0, 100.0, 4.0, 9.0], [3.0, NAN, INF, 5.0]])
LA_VALUES = torch.tensor([[1.0, 0.5, 1.0, 0.5], [2.0, -50.0, 1.0, 7.0], [1.0, INF, NAN, -3.0]])
LA_MASK = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 0], [1, 0, 0, 0]])
LA_RAW = torch.tensor([[-0.4013671875, 0.9296875, -0.1875, 1.5], [0.25, 0.0, 3.0, 0.0], [2.0, 0.0, 0.0, 0.0]])


def test_length_adaptive_gae_hand_example():
    advantages, returns = compute_length_adaptive_gae_advantage_return(LA_REWARDS, LA_VALUES, LA_MASK, 0.5, alpha=1.0)
    assert_close(returns, torch.tensor([[0.75, 1.5, 1.0, 2.0], [3.0, 0.0, 4.0, 0.0], [3.0, 0.0, 0.0, 0.0]]))
    assert_close(advantages, masked_whiten(LA_RAW, LA_MASK))  # whitening itself: test_masked_whiten
    # a single lam for all rows is not the same: with lam 0.75 row B's t0 would be -0.5 + 0.375*3 = 0.625
    single, _ = compute_gae_advantage_return(LA_REWARDS, LA_VALUES, LA_MASK, 0.5, 0.75)
    assert not torch.allclose(single, advantages)


def test_length_adaptive_gae_clamps_lambda_of_short_sequences_at_zero():
    # alpha 0.4, gamma 1: row X (l = 2) has 1 - 1/0.8 = -0.25 -> lam 0; row Y (l = 4) has 1 - 1/1.6 = 0.375
    #   X: rewards [1, 2], values [0.5, 1]: t1: delta = 2 - 1 = 1; t0: delta = 1 + 1 - 0.5 = 1.5, gae = 1.5 + 0*1
    #      (unclamped lam -0.25 would give 1.5 - 0.25*1 = 1.25); returns (critic lam 1) [3, 2]
    #   Y: rewards [0, 0, 0, 1], values 0.5: t3: 0.5; t2: 0 + 0.375*0.5 = 0.1875; t1: 0.375*0.1875 = 0.0703125;
    #      t0: 0.375*0.0703125 = 0.0263671875; returns [1, 1, 1, 1]
    rewards = torch.tensor([[1.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 1.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    advantages, returns = compute_length_adaptive_gae_advantage_return(rewards, values, mask, 1.0, alpha=0.4)
    assert_close(returns, torch.tensor([[3.0, 2.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]))
    raw = torch.tensor([[1.5, 1.0, 0.0, 0.0], [0.0263671875, 0.0703125, 0.1875, 0.5]])
    assert_close(advantages, masked_whiten(raw, mask))


def test_length_adaptive_gae_default_alpha_and_its_check():
    # alpha 0.05 (VAPO's): a 100-token response gets lam 1 - 1/5 = 0.8, a 10-token one lam 0 (clamped from -1)
    generator = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(2, 100, generator=generator), torch.randn(2, 100, generator=generator)
    mask = torch.ones(2, 100, dtype=torch.long)
    mask[1, 10:] = 0
    advantages, returns = compute_length_adaptive_gae_advantage_return(rewards, values, mask, 0.9)
    expected = compute_decoupled_gae_advantage_return(rewards, values, mask, 0.9, torch.tensor([0.8, 0.0]), 1.0)
    assert_close(advantages, expected[0])  # 0.05 * 100 is 5 only up to rounding: close, not equal
    assert torch.equal(returns, expected[1])
    with pytest.raises(ValueError, match="alpha must be > 0"):
        compute_length_adaptive_gae_advantage_return(rewards, values, mask, 0.9, alpha=0.0)


def test_length_adaptive_lambda_counts_discounted_tokens_under_gamma():
    # lengths 4, 2, 0 at alpha 0.5: gamma 1 gives 1 - 1/2 = 0.5, 1 - 1/1 = 0, (empty) 0;
    # gamma 0.5: l_gamma = (1 - 0.5^l)/0.5 = 1.875 and 1.5 -> 1 - 1/0.9375 = -0.0667 -> 0 and 1 - 1/0.75 -> 0;
    # alpha 2, gamma 0.5: 1 - 1/3.75 = 0.7333..., 1 - 1/3 = 0.6666...
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert_close(length_adaptive_lambda(mask, 0.5), torch.tensor([0.5, 0.0, 0.0]))
    assert_close(length_adaptive_lambda(mask, 0.5, gamma=0.5), torch.tensor([0.0, 0.0, 0.0]))
    assert_close(length_adaptive_lambda(mask, 2.0, gamma=0.5), torch.tensor([1 - 1 / 3.75, 1 - 1 / 3, 0.0]))
    assert torch.equal(length_adaptive_lambda(mask, 2.0, gamma=1.0), length_adaptive_lambda(mask, 2.0))
    assert_close(length_adaptive_lambda(mask, 2.0, gamma=0.0), torch.tensor([0.5, 0.5, 0.0]))  # l_gamma = 1
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\], got 1.5"):
        length_adaptive_lambda(mask, 2.0, gamma=1.5)


def test_batch_scope_gives_every_row_the_lambda_of_the_mean_length():
    # lengths 4, 2, 0 (empty: not counted): mean 3; alpha 1 -> 1 - 1/3 = 2/3 for every row;
    # gamma 0.5: l_gamma 1.875 and 1.5, mean 1.6875; alpha 2 -> 1 - 1/3.375 = 0.7037...
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert_close(length_adaptive_lambda(mask, 1.0, scope="batch"), torch.full((3,), 2 / 3))
    assert_close(length_adaptive_lambda(mask, 2.0, gamma=0.5, scope="batch"), torch.full((3,), 1 - 1 / 3.375))
    assert_close(length_adaptive_lambda(mask, 1.0), torch.tensor([0.75, 0.5, 0.0]))  # each row's own: not that
    assert torch.equal(length_adaptive_lambda(mask[2:], 1.0, scope="batch"), torch.zeros(1))  # all empty: 0
    with pytest.raises(ValueError, match="scope must be one of response, batch, got 'token'"):
        length_adaptive_lambda(mask, 1.0, scope="token")


def test_batch_scope_keeps_the_targets_unbiased_where_length_and_reward_correlate():
    # Two equally likely responses with the same first two tokens: A ends after 2 tokens unrewarded, B goes on to 4
    # and is rewarded 1 on its last. True values (before each token): 0.5, 0.5 for both (the end is not known
    # yet), then 1, 1 for B. Every λ-return from the true values must then average 0.5 at the first token.
    #   own length, alpha 1: A λ 1 - 1/2 = 0.5, B λ 1 - 1/4 = 0.75; TD errors A [0, -0.5], B [0, 0.5, 0, 0]:
    #     A 0.5 + 0.5*(-0.5) = 0.25, B 0.5 + 0.75*0.5 = 0.875, mean 0.5625: biased by the length B's reward needs
    #   batch: mean length 3, λ 2/3 for both: A 0.5 - 1/3, B 0.5 + 1/3, mean 0.5
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    for scope, first_token in (("response", [0.25, 0.875]), ("batch", [0.5 - 1 / 3, 0.5 + 1 / 3])):
        lam = length_adaptive_lambda(mask, 1.0, scope=scope)
        _, returns = compute_gae_advantage_return(rewards, values, mask, 1.0, lam)
        assert_close(returns[:, 0], torch.tensor(first_token))


def test_on_the_lengths_task_only_the_batch_scope_leaves_the_targets_unbiased():
    # The lengths task rewards responses that saw its target often enough, so long ones more often. λ-returns from
    # the *true* values average to the values under the batch scope; under λ by each response's own length they do
    # not. Each response's sum of (return - value) over its tokens is one independent sample (64 batches of 192 as
    # in `ppo-critic train`): a z-score beyond 6 is no sampling accident (at seed 0: +0.58 per response, z 15.8),
    # one within 4 is (batch: -0.04, z -1.3; the row's own 1/192 share of the mean length adds no visible bias).
    from ppo_critic.tasks import LengthsTask

    task, generator = LengthsTask(), torch.Generator().manual_seed(0)
    sums = {"response": [], "batch": []}
    for _ in range(64):
        batch = task.sample(192, generator)
        values, mask = batch["true_values"].double(), batch["response_mask"]
        for scope, out in sums.items():
            lam = length_adaptive_lambda(mask, 0.5, torch.float64, scope=scope)
            _, returns = compute_gae_advantage_return(batch["token_level_rewards"].double(), values, mask, 1.0, lam)
            out.append(((returns - values) * mask).sum(-1))
    z = {scope: (s := torch.cat(out)).mean().item() / (s.std().item() / len(s) ** 0.5) for scope, out in sums.items()}
    assert z["response"] > 6 and abs(z["batch"]) < 4, z


# --------------------------------------------------------------------------------------------------------------
# masked statistics
# --------------------------------------------------------------------------------------------------------------
# Valid entries of STAT_X: 1, 2, 4 (row 0: 1, 2; row 1: 4; row 2: none)
#   mean 7/3; deviations -4/3, -1/3, 5/3; squared deviations sum 16/9 + 1/9 + 25/9 = 14/3
#   biased var 14/9, unbiased var 7/3; whitened (x - 7/3) / sqrt(7/3) = [-4, -1, 5] / sqrt(21)
STAT_X = t64([[1.0, 2.0, NAN], [4.0, INF, -INF], [NAN, 3.0, 5.0]])
STAT_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


def test_masked_mean():
    assert_close(masked_mean(STAT_X, STAT_MASK), scalar(7 / 3))
    # Per row: 1.5, 4, and 0 (not NaN) for the empty row.
    assert_close(masked_mean(STAT_X, STAT_MASK, axis=-1), t64([1.5, 4.0, 0.0]))
    # Per column: column 0 -> (1 + 4) / 2, column 1 -> 2, column 2 -> nothing -> 0.
    assert_close(masked_mean(STAT_X, STAT_MASK, axis=0), t64([2.5, 2.0, 0.0]))
    assert masked_mean(STAT_X, torch.zeros(3, 3)).item() == 0.0


def test_masked_var():
    assert_close(masked_var(STAT_X, STAT_MASK), scalar(7 / 3))
    assert_close(masked_var(STAT_X, STAT_MASK, unbiased=True), scalar(7 / 3))
    assert_close(masked_var(STAT_X, STAT_MASK, unbiased=False), scalar(14 / 9))
    # One valid entry: the Bessel correction is skipped (variance 0, not NaN / inf); no valid entry: 0.
    one = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 0, 0]])
    assert masked_var(STAT_X, one).item() == 0.0
    assert masked_var(STAT_X, torch.zeros(3, 3)).item() == 0.0


def test_masked_whiten():
    valid = STAT_MASK.bool()
    expected = t64([-4.0, -1.0, 5.0]) / math.sqrt(21)  # the 1e-8 epsilon is far below the tolerance
    assert_close(masked_whiten(STAT_X, STAT_MASK)[valid], expected)
    assert_close(masked_whiten(STAT_X, STAT_MASK, shift_mean=False)[valid], expected + 7 / 3)


def test_masked_whiten_gradient_is_zero_at_padding():
    x = torch.where(STAT_MASK.bool(), STAT_X, t64(-7.0)).requires_grad_(True)  # finite padding
    masked_whiten(x, STAT_MASK)[STAT_MASK.bool()].pow(2).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[~STAT_MASK.bool()] == 0).all()


def test_masked_whiten_nonfinite_padding_does_not_reach_gradient():
    x = STAT_X.clone().requires_grad_(True)
    masked_whiten(x, STAT_MASK)[STAT_MASK.bool()].pow(2).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_explained_variance_hand_example():
    # y_true valid [1, 2, 3, 4], y_pred valid [1, 2, 3, 5]; garbage at the masked positions.
    #   Var(y_true) (biased): mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5 -> 1.25
    #   error [0, 0, 0, -1]: mean -0.25, squared deviations 3 * 0.0625 + 0.5625 = 0.75 -> 0.1875
    #   explained variance 1 - 0.1875 / 1.25 = 0.85
    y_true = torch.tensor([[1.0, 2.0, NAN], [3.0, 4.0, INF]])
    y_pred = torch.tensor([[1.0, 2.0, INF], [3.0, 5.0, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    ev = explained_variance(y_pred, y_true, mask)
    assert_close(ev, torch.tensor(0.85))
    # A perfect prediction explains everything; predicting the mean explains nothing.
    assert_close(explained_variance(y_true, y_true, mask), torch.tensor(1.0))
    assert_close(explained_variance(torch.full((2, 3), 2.5), y_true, mask), torch.tensor(0.0))


def test_explained_variance_undefined_is_zero():
    mask = torch.tensor([[1, 1, 1, 0]])
    # Var(y_true) = 0 (constant 2.0 on valid tokens): undefined -> 0.0, not NaN / inf.
    y_true = torch.tensor([[2.0, 2.0, 2.0, NAN]])
    y_pred = torch.tensor([[1.0, 2.0, 4.0, INF]])
    ev = explained_variance(y_pred, y_true, mask)
    assert not torch.isnan(ev)
    assert ev.item() == 0.0
    # Fully masked input: 0.0.
    ev = explained_variance(torch.tensor([[NAN, 1.0]]), torch.tensor([[INF, 2.0]]), torch.zeros(1, 2))
    assert not torch.isnan(ev)
    assert ev.item() == 0.0
    # A single valid token: Var(y_true) = 0 as well.
    assert explained_variance(torch.tensor([[3.0, 1.0]]), torch.tensor([[1.0, 2.0]]), torch.tensor([[1, 0]])) == 0


def test_explained_variance_constant_inexact_target_is_zero():
    y_true = torch.full((1, 7), 0.1)
    y_pred = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]])
    assert explained_variance(y_pred, y_true, torch.ones(1, 7)).item() == 0.0


# --- Huber value loss (critic.vf_loss_type=huber) ---


def test_huber_is_half_the_squared_error_inside_delta_and_linear_beyond():
    err = torch.tensor([-3.0, -1.0, -0.25, 0.0, 0.5, 1.0, 2.5])
    delta = 1.0
    expected = torch.where(err.abs() <= delta, 0.5 * err**2, delta * (err.abs() - 0.5 * delta))
    assert_close(0.5 * doubled_error_loss(err, "huber", delta), expected)
    assert_close(doubled_error_loss(err, "mse"), err**2)
    # the gradient of the halved loss is the error inside δ and ±δ outside
    err = err.clone().requires_grad_(True)
    (0.5 * doubled_error_loss(err, "huber", delta)).sum().backward()
    assert_close(err.grad, err.detach().clamp(-delta, delta))


@pytest.mark.parametrize("cliprange", [None, 0.2])
def test_huber_value_loss_keeps_the_clipped_formulation(cliprange):
    g = torch.Generator().manual_seed(3)
    vpreds, returns, values = (torch.randn(4, 6, generator=g) * 2 for _ in range(3))
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    delta = 0.7
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange, loss_type="huber", huber_delta=delta)

    def huber(e):
        return torch.where(e.abs() <= delta, 0.5 * e**2, delta * (e.abs() - 0.5 * delta))

    elementwise = huber(vpreds - returns)
    if cliprange is not None:
        elementwise = torch.maximum(
            elementwise, huber(values + (vpreds - values).clamp(-cliprange, cliprange) - returns)
        )
    assert_close(loss, (elementwise * mask).sum() / mask.sum())
    _, mse_clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange)
    assert_close(clipfrac, mse_clipfrac)  # both losses grow with |error|: the same tokens are clipped


def test_huber_with_errors_inside_delta_equals_mse():
    g = torch.Generator().manual_seed(4)
    vpreds, returns, values = (torch.rand(3, 5, generator=g) for _ in range(3))  # errors < 1
    mask = torch.ones(3, 5)
    huber, _ = compute_value_loss(vpreds, returns, values, mask, 0.5, loss_type="huber", huber_delta=1.0)
    mse, _ = compute_value_loss(vpreds, returns, values, mask, 0.5)
    assert_close(huber, mse, rtol=0, atol=0)  # exact: inside delta both are err**2, then the same aggregation


def test_unknown_loss_type_is_rejected():
    with pytest.raises(ValueError, match="vf_loss_type='l1' is unknown"):
        compute_value_loss(
            torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), None, loss_type="l1"
        )


def test_critic_config_checks_loss_type_and_delta():
    from ppo_critic import CriticConfig

    with pytest.raises(ValueError, match="vf_loss_type='l1' is unknown"):
        CriticConfig.from_any({"vf_loss_type": "l1"})
    with pytest.raises(ValueError, match=r"huber_delta=0\.0 must be a positive \(finite\) number"):
        CriticConfig.from_any({"vf_loss_type": "huber", "huber_delta": 0})


def _rows(prompts: list[list[int]], responses: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of rows whose prompts (0: left padding) precede their responses."""
    ids = torch.tensor([p + r for p, r in zip(prompts, responses, strict=True)])
    attention = torch.tensor([[int(t != 0) for t in p] + [1] * len(r) for p, r in zip(prompts, responses, strict=True)])
    return ids, attention


def test_shared_prefix_mean_averages_each_state_over_the_rows_that_reach_it():
    # rows 0-2 share the prompt [5, 6]; row 2 diverges at its first response token, rows 0 and 1 at their second;
    # row 3's prompt differs. Response position t's state is the prompt plus the first t response tokens.
    ids, attention = _rows([[5, 6], [5, 6], [5, 6], [5, 7]], [[1, 2, 3], [1, 2, 4], [2, 2, 3], [1, 2, 3]])
    targets = torch.tensor([[1.0, 10.0, 100.0], [2.0, 20.0, 200.0], [3.0, 30.0, 300.0], [4.0, 40.0, 400.0]])
    out = shared_prefix_mean(targets, ids, attention, torch.ones(4, 3))
    expected = torch.tensor(
        [
            [2.0, 15.0, 150.0],  # t0: rows 0-2 (1+2+3)/3; t1: [1] rows 0, 1; t2: [1, 2] rows 0, 1
            [2.0, 15.0, 150.0],
            [2.0, 30.0, 300.0],  # from t1 on its own state ([2])
            [4.0, 40.0, 400.0],  # another prompt: nothing shared
        ]
    )
    assert_close(out, expected)


def test_shared_prefix_mean_reads_attended_tokens_only_and_skips_masked_positions():
    # [5, pad, 6] and [pad, 5, 6] are one state (a padded column's token id is never read); [5, 6, 6] is another.
    # A masked position neither gets nor gives a value.
    ids, attention = _rows([[5, 0, 6], [0, 5, 6]], [[1, 2], [1, 2]])
    ids[0, 1] = 9
    targets = torch.tensor([[1.0, NAN], [3.0, 5.0]])
    mask = torch.tensor([[1, 0], [1, 1]])
    assert_close(shared_prefix_mean(targets, ids, attention, mask), torch.tensor([[2.0, 0.0], [2.0, 5.0]]))
    other, other_attention = _rows([[0, 5, 6], [5, 6, 6]], [[1, 2], [1, 2]])
    alone = shared_prefix_mean(targets, other, other_attention, mask)
    assert_close(alone, torch.tensor([[1.0, 0.0], [3.0, 5.0]]))
