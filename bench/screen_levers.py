"""Screens of critic levers before any is built into the library (issue 33): each plugs a lever in through a public
seam (a value objective registered under `critic.vf_loss_type`, the targets the trainer regresses on) and runs a suite
configuration of `bench/ablation.py` on one task and seed.

    python bench/screen_levers.py hl_gauss --tasks counting                        # 51 bins over ±4σ, σ 0.75 bins
    python bench/screen_levers.py hl_gauss --bins 11 --low -3 --high 3 --sigma 1.0 --tasks counting
    python bench/screen_levers.py hl_gauss --base truth_default --tasks counting   # its exact-value ceiling
    python bench/screen_levers.py horizon --tasks counting lengths

`hl_gauss` (Farebrother et al. 2024, "Stop Regressing"): the value head gives `--bins` logits over a fixed support
[`--low`, `--high`] of the model's output space (normalised returns under `value_norm=running`); the loss is the cross
entropy against the target's histogram smoothed by a Gaussian of `--sigma` bin widths, the value is the expectation;
value clipping keeps a token's loss but stops its gradient where the clipped expectation's error is the larger, as
the max of the clipped mse loss does. It is registered as the objective `critic.vf_loss_type=hl_gauss`
(`ppo_critic.critics.objectives.register`). `horizon`: λ by state, λ_t = 1 − 1/(α·h_t) with h_t the mean remaining
length (discounted under γ < 1) at position t of the batch's *other* responses that reach t, so no response's own
future sets its λ: the targets the trainer regresses on (`ablation.targets_of`). Each run appends to
`bench/results/screens.jsonl`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from torch import Tensor

from ppo_critic.algos import agg_loss, compute_gae_advantage_return, masked_mean
from ppo_critic.critics.objectives import ValueObjective, register
from ppo_critic.run.files import write_file

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results" / "screens.jsonl"


def _ablation():
    spec = importlib.util.spec_from_file_location("ablation", BENCH / "ablation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ablation"] = module
    spec.loader.exec_module(module)
    return module


def hl_gauss_target(returns: Tensor, edges: Tensor, sigma: float) -> Tensor:
    """[..., K] the probability of each bin under N(return clamped to the support, σ²), renormalised to the support."""
    y = returns.clamp(float(edges[0]), float(edges[-1]))
    cdf = torch.special.ndtr((edges - y[..., None]) / sigma)
    return (cdf[..., 1:] - cdf[..., :-1]) / (cdf[..., -1:] - cdf[..., :1]).clamp(min=1e-12)


@dataclass(frozen=True)
class HLGauss(ValueObjective):
    """`bins` logits per token over [low, high]; the value their expectation over the bin centres; the loss the
    cross entropy against the Gaussian-smoothed (σ = `sigma_bins` bin widths) histogram of the return."""

    bins: int
    low: float
    high: float
    sigma_bins: float
    value_norms = ("off", "running")  # not PopArt: the value is not affine in the head's outputs
    identity = False

    @property
    def outputs(self) -> int:
        return self.bins

    def edges(self, device: torch.device) -> Tensor:
        return torch.linspace(self.low, self.high, self.bins + 1, device=device)

    def values(self, outputs: Tensor) -> Tensor:
        edges = self.edges(outputs.device)
        return (outputs.float().softmax(-1) * (edges[1:] + edges[:-1]) / 2).sum(-1)

    def loss(self, outputs, returns, old_values, response_mask, cliprange_value, loss_agg_mode="token-mean", **norm):
        """Cross entropy; where the clipped expectation's squared error is the larger, its gradient is stopped."""
        mask, edges = response_mask.bool(), self.edges(outputs.device)
        returns = torch.where(mask, returns, 0.0)
        sigma = self.sigma_bins * float(edges[1] - edges[0])
        ce = -(hl_gauss_target(returns, edges, sigma) * outputs.float().log_softmax(-1)).sum(-1)
        clipped = torch.zeros_like(mask)
        if cliprange_value is not None:
            value, old = self.values(outputs), torch.where(mask, old_values, 0.0)
            bounded = torch.clamp(value, old - cliprange_value, old + cliprange_value)
            clipped = ((bounded - returns) ** 2 > (value - returns) ** 2) & mask
            ce = torch.where(clipped, ce.detach(), ce)
        return agg_loss(ce, mask, loss_agg_mode, **norm), masked_mean(clipped.float(), mask)


def horizon_lambda(mask: Tensor, alpha: float, gamma: float) -> Tensor:
    """[B, R] λ_t = 1 − 1/(α·h_t), clamped to [0, 1]: h_t the mean (discounted) remaining length at t of the other
    rows that reach t (a row alone at t gets its own)."""
    lengths = mask.bool().sum(-1)
    t = torch.arange(mask.shape[1])
    left = (lengths[:, None] - t).clamp(min=0).float()
    if gamma < 1:
        left = (1 - gamma**left) / (1 - gamma)
    reach = (lengths[:, None] > t).float()
    others, count = (left * reach).sum(0) - left * reach, reach.sum(0) - reach
    horizon = torch.where(count > 0, others / count.clamp(min=1), left.clamp(min=1))
    return (1 - 1 / (alpha * horizon.clamp(min=1e-6))).clamp(0, 1)


def horizon_targets(batch: dict[str, Tensor], values: Tensor, t, step: int) -> Tensor:
    """GAE returns with λ by state (`horizon_lambda`): the trainer's `targets` for the horizon screen."""
    rewards, mask = batch["token_level_rewards"], batch["response_mask"]
    lam = horizon_lambda(mask, t.length_adaptive_alpha, t.gamma)
    return compute_gae_advantage_return(rewards, values, mask, t.gamma, lam)[1]


def record(row: dict) -> None:
    """Add a run to the results, rewritten whole (atomically) under a lock: screens running side by side keep each
    other's rows, and a full disk or an interrupt leaves the file as it was."""
    with open(RESULTS.parent / f".{RESULTS.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        before = RESULTS.read_text() if RESULTS.exists() else ""
        write_file(RESULTS, before + json.dumps(row) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("lever", choices=["hl_gauss", "horizon"])
    p.add_argument("--tasks", nargs="+", required=True)
    p.add_argument("--seeds", nargs="*", type=int, default=[0])
    p.add_argument("--base", default=None, help="the suite configuration (default: the default recipe)")
    p.add_argument("--bins", type=int, default=51)
    p.add_argument("--low", type=float, default=-4.0)
    p.add_argument("--high", type=float, default=4.0)
    p.add_argument("--sigma", type=float, default=0.75, help="the smoothing in bin widths")
    p.add_argument("--extra", nargs="*", default=[], help="overrides after the configuration's")
    args = p.parse_args()
    torch.set_num_threads(1)
    ablation = _ablation()
    base = args.base or ablation.DEFAULT
    label = f"{args.lever}({base}"
    if args.lever == "hl_gauss":
        label += f", {args.bins} bins over [{args.low:g}, {args.high:g}], σ {args.sigma:g} bins"
    label += "".join(f", {o}" for o in args.extra) + ")"
    overrides = []
    if args.lever == "hl_gauss":
        objective = HLGauss(args.bins, args.low, args.high, args.sigma)
        register("hl_gauss", lambda config: objective)
        overrides = ["critic.vf_loss_type=hl_gauss"]
    for seed in args.seeds:
        for task in args.tasks:
            s = ablation.SUITE[task]
            with contextlib.ExitStack() as stack:
                if args.lever == "horizon":  # the suite's targets: a public function of the bench script
                    stack.enter_context(mock.patch.object(ablation, "targets_of", lambda *_: horizon_targets))
                run = ablation.run_one(
                    base, [*ablation.overrides_of(base, task), *overrides, *args.extra], seed, s.steps, s.eval_every
                )
            row = {"lever": label, "task": task, "seed": seed, "to_0.95": ablation.first_reach(run["curve"], 0.95)}
            row |= {"best_ev": run["best_ev"], "curve": run["curve"]}
            record(row)
            print(f"{task} seed {seed} {label}: to 0.95 {row['to_0.95']}, best EV {run['best_ev']:.3f}", flush=True)


if __name__ == "__main__":
    main()
