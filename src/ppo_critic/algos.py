"""PPO value-function math: clipped value loss (squared or Huber error), loss aggregation, GAE and masked statistics.

Every function takes a 0/1 (or bool) mask and never lets values at masked positions reach the result or
its gradient: masked entries are replaced by zero *before* any arithmetic, so NaN/Inf padding is harmless.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ppo_critic.config.modes import LENGTH_ADAPTIVE_SCOPES, LOSS_AGG_MODES


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """`x` with masked-out entries replaced by 0 (a `where`, so NaN at masked positions cannot leak)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(values: Tensor, mask: Tensor, axis: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of `values` over valid entries (all, or along `axis`); verl's signature."""
    valid = _masked(values, mask)
    return valid.sum() if axis is None else valid.sum(axis)


def masked_mean(values: Tensor, mask: Tensor, axis: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of `values` over valid entries; 0 where there is none (verl divides by count + 1e-8 instead)."""
    count = mask.bool().sum() if axis is None else mask.bool().sum(axis)
    return masked_sum(values, mask, axis) / count.clamp(min=1).to(values.dtype)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of `values` over valid entries (Bessel-corrected when `unbiased` and there are >= 2 of them)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.bool().sum().to(var.dtype)
        var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), var)
    return var


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Normalise `values` to unit variance over valid entries (and zero mean when `shift_mean`); 0 where masked."""
    values = _masked(values, mask)
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return _masked(whitened if shift_mean else whitened + mean, mask)


def explained_variance(y_pred: Tensor, y_true: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(y_true - y_pred) / Var(y_true) over valid entries, in float64.

    Undefined (returned as 0) when y_true is constant up to rounding or nothing is valid.
    """
    out_dtype = torch.promote_types(y_true.dtype, torch.float32)
    y_pred, y_true = _masked(y_pred.double(), mask), _masked(y_true.double(), mask)
    var_true = masked_var(y_true, mask, unbiased=False)
    var_err = masked_var(y_true - y_pred, mask, unbiased=False)
    scale = masked_mean(y_true**2, mask)
    defined = var_true > 1e-12 * scale
    ratio = torch.where(defined, 1 - var_err / var_true.clamp(min=1e-300), torch.zeros_like(var_true))
    return ratio.to(out_dtype)


def _denominator(given: Tensor | float | None, local: Tensor) -> Tensor:
    """The aggregation denominator: the caller's global one if given, else the local count; at least 1."""
    d = local if given is None else torch.as_tensor(given, dtype=local.dtype, device=local.device)
    return d.clamp(min=1)


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Tensor | float | None = None,
    global_batch_size: Tensor | float | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Aggregate a [B, R] loss matrix to a scalar.

    With the optional global denominators (`batch_num_tokens`: valid tokens, `global_batch_size`: non-empty
    sequences, both counted over the whole mini-batch on all DP ranks) a micro-batch returns its share of
    the mini-batch loss, times `dp_size` because data parallelism averages gradients (DESIGN §3).
    `loss_scale_factor` is the horizon of `seq-mean-token-sum-norm` (default: R).
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is unknown; expected one of {LOSS_AGG_MODES}")
    mask = loss_mask.bool()
    loss_mat = _masked(loss_mat, mask)
    tokens_per_seq = mask.sum(-1)
    n_seqs = (tokens_per_seq > 0).sum().to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        total = loss_mat.sum()
        denom = _denominator(batch_num_tokens, tokens_per_seq.sum().to(loss_mat.dtype))
    elif loss_agg_mode == "seq-mean-token-mean":
        total = (loss_mat.sum(-1) / tokens_per_seq.clamp(min=1).to(loss_mat.dtype)).sum()
        denom = _denominator(global_batch_size, n_seqs)
    else:
        total = loss_mat.sum()
        denom = _denominator(global_batch_size, n_seqs)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            denom = denom * (loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return total / denom * dp_size


def doubled_error_loss(err: Tensor, loss_type: str = "mse", huber_delta: float = 1.0) -> Tensor:
    """Twice the per-token loss of an error: `err²` (mse), or for `huber` `err²` where |err| ≤ δ and
    `2δ·|err| − δ²` beyond (twice the Huber loss: quadratic near 0, linear in the tails, C¹ at ±δ).

    Doubled so that `0.5 ·` this is the loss, as in verl's `0.5·(v−R)²`; mse and huber agree for |err| ≤ δ.
    """
    if loss_type == "mse":
        return err**2
    if loss_type != "huber":
        raise ValueError(f"vf_loss_type={loss_type!r} is unknown; expected one of ('mse', 'huber')")
    abs_err = err.abs()
    return torch.where(abs_err <= huber_delta, err**2, 2 * huber_delta * abs_err - huber_delta**2)


def clipped_value_loss(
    error_loss: Callable[[Tensor, Tensor], Tensor],
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
    **norm,
) -> tuple[Tensor, Tensor]:
    """`agg(max(ℓ(v, R), ℓ(clip(v, v_old±c), R)))` and the clipped fraction, for any per-token loss ℓ(values, returns)
    of values and returns in one space: PPO's value clipping, shared by every objective that clips its values.

    `cliprange_value=None` turns clipping off. `norm` is forwarded to `agg_loss` (global denominators).
    """
    mask = response_mask.bool()
    vpreds, returns, values = _masked(vpreds, mask), _masked(returns, mask), _masked(values, mask)
    unclipped = error_loss(vpreds, returns)
    if cliprange_value is None:
        loss_mat, clipfrac = unclipped, torch.zeros((), dtype=vpreds.dtype, device=vpreds.device)
    else:
        vclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
        clipped = error_loss(vclipped, returns)
        loss_mat = torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).to(vpreds.dtype), mask)
    return agg_loss(loss_mat, mask, loss_agg_mode, **norm), clipfrac


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
    *,
    loss_type: str = "mse",
    huber_delta: float = 1.0,
    **norm,
) -> tuple[Tensor, Tensor]:
    """Clipped PPO value loss `0.5·agg(max(ℓ(v−R), ℓ(clip(v, v_old±c)−R)))` and the clipped fraction, where
    ℓ is `doubled_error_loss` (`loss_type` mse: ℓ(e) = e², verl's loss; huber: quadratic within `huber_delta`).

    `cliprange_value=None` turns clipping off. `norm` is forwarded to `agg_loss` (global denominators).
    """

    def error_loss(v: Tensor, r: Tensor) -> Tensor:
        return doubled_error_loss(v - r, loss_type, huber_delta)

    loss, clipfrac = clipped_value_loss(
        error_loss, vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode, **norm
    )
    return 0.5 * loss, clipfrac


@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens (`lam` one λ, one per row as a [B] tensor, or one per
    token as a [B, R] tensor: A_t = δ_t + γ·λ_t·A_{t+1}, a λ by state).

    Masked positions are skipped (a masked gap carries the next value and advantage through), so
    right padding and interior masks both work. Returns `(advantages, returns)`: advantages whitened over
    valid tokens, returns = raw advantages + values; both 0 at masked positions.
    """
    mask = response_mask.bool()
    dtype = torch.promote_types(values.dtype, torch.float32)
    rewards, values = _masked(token_level_rewards.to(dtype), mask), _masked(values.to(dtype), mask)
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        lam_t = lam[:, t] if isinstance(lam, Tensor) and lam.dim() == 2 else lam
        gae = delta + gamma * lam_t * last_gae
        advantages[:, t] = torch.where(valid, gae, 0.0)
        next_value = torch.where(valid, values[:, t], next_value)
        last_gae = torch.where(valid, gae, last_gae)
    returns = _masked(advantages + values, mask)
    return masked_whiten(advantages, mask), returns


@torch.no_grad()
def compute_decoupled_gae_advantage_return(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam_actor: float | Tensor,
    lam_critic: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Decoupled GAE (VAPO): the actor's advantages with `lam_actor`, the critic's returns with `lam_critic`.

    λ = 1 for the critic gives returns free of the bias that bootstrapping from an imperfect critic adds (the
    value of a sparse reward then reaches the first tokens), while the actor keeps a lower-variance λ < 1.
    `lam_actor` may be one λ per sequence ([B] tensor). Conventions are `compute_gae_advantage_return`'s:
    `(advantages, returns)`, advantages whitened over valid tokens, returns = raw advantages (with `lam_critic`)
    + values, both 0 at masked positions; with lam_actor == lam_critic the result is that function's.
    """
    advantages, _ = compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam_actor)
    _, returns = compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam_critic)
    return advantages, returns


@torch.no_grad()
def compute_length_adaptive_gae_advantage_return(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    alpha: float = 0.05,
    lam_critic: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Length-adaptive GAE (VAPO): decoupled GAE whose actor λ is `1 − 1/(α·l)` per sequence, l its valid tokens.

    The TD errors' weights (γ = 1) sum to Σ λ^k = 1/(1 − λ) = α·l, growing with the length, so a long response is
    not left to bootstrapped values near its start nor a short one to high-variance sums. λ is clamped to [0, 1]:
    sequences shorter than 1/α tokens (20 at α = 0.05) get λ = 0 (one-step TD); empty ones are all masked anyway.
    """
    lam_actor = length_adaptive_lambda(response_mask, alpha, torch.promote_types(values.dtype, torch.float32))
    return compute_decoupled_gae_advantage_return(
        token_level_rewards, values, response_mask, gamma, lam_actor, lam_critic
    )


def length_adaptive_lambda(
    response_mask: Tensor,
    alpha: float,
    dtype: torch.dtype = torch.float32,
    gamma: float = 1.0,
    scope: str = "response",
) -> Tensor:
    """[B] VAPO's λ = 1 − 1/(α·l), clamped to [0, 1]; l is the row's valid tokens, or with `gamma` < 1 its discounted
    length Σ_{k<l} γ^k = (1 − γ^l)/(1 − γ): rewards beyond ~1/(1 − γ) tokens weigh little in a return whatever λ is,
    so that is the horizon a long sum of TD errors has to cover.

    `scope="response"`: each row's own l (VAPO's rule). `scope="batch"`: every row gets the λ of the mean l over the
    batch's non-empty rows. A row's own length is a future event its earlier tokens cannot see; where it correlates
    with the reward, λ by own length biases the critic's targets (returns with the true values then no longer
    average to them), λ by the batch's mean length does not (up to one row's 1/B share of the mean)."""
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if scope not in LENGTH_ADAPTIVE_SCOPES:
        raise ValueError(f"scope must be one of {', '.join(LENGTH_ADAPTIVE_SCOPES)}, got {scope!r}")
    lengths = response_mask.bool().sum(-1).to(dtype)
    nonempty = lengths > 0
    if gamma < 1.0:
        lengths = (1.0 - gamma**lengths) / (1.0 - gamma)
    if scope == "batch" and nonempty.any():
        lengths = lengths[nonempty].mean().expand_as(lengths)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)


# two polynomial hashes of a token sequence modulo primes below 2**31 (so hash·base stays inside int64): rows whose
# prefixes differ share both with a probability of about 2**-62
_PREFIX_HASHES = ((2_147_483_647, 1_000_003), (2_147_483_629, 998_244_353))


def _state_keys(input_ids: Tensor, attention_mask: Tensor, responses: int) -> Tensor:
    """[B, R, 2] a key of each response position's state: the row's attended tokens before that response token."""
    rows, width = input_ids.shape
    moduli = torch.tensor([m for m, _ in _PREFIX_HASHES], device=input_ids.device)
    bases = torch.tensor([b for _, b in _PREFIX_HASHES], device=input_ids.device)
    hashes = torch.zeros(rows, 2, dtype=torch.long, device=input_ids.device)
    attended = attention_mask.bool()
    keys = []
    for col in range(width):
        if col >= width - responses:
            keys.append(hashes)  # the state before this response token
        grown = (hashes * bases + input_ids[:, col].long()[:, None] + 1) % moduli
        hashes = torch.where(attended[:, col, None], grown, hashes)
    return torch.stack(keys, dim=1)


@torch.no_grad()
def shared_prefix_mean(targets: Tensor, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> Tensor:
    """[B, R] `targets` with each valid response position's replaced by the mean over every valid position of the
    batch in the same state (the same attended tokens before it: a group's prompt and common first tokens). A
    return is a noisy sample of its state's value, so the mean keeps the expectation and lowers the noise; 0 where
    masked. The rows' responses are the last `targets.shape[1]` columns of `input_ids`."""
    valid = response_mask.bool()
    keys = _state_keys(input_ids, attention_mask, targets.shape[1])[valid]
    _, state, count = torch.unique(keys, dim=0, return_inverse=True, return_counts=True)
    total = torch.zeros(len(count), dtype=targets.dtype, device=targets.device).index_add_(0, state, targets[valid])
    out = torch.zeros_like(targets)
    out[valid] = (total / count)[state]
    return out
