"""Screens of critic levers before any is built into the library (issue 33): each patches the trainer or the
data-parallel critic in-process and runs a suite configuration of `bench/ablation.py` on one task and seed.

    python bench/screen_levers.py hl_gauss --tasks counting                        # 51 bins over ±4σ, σ 0.75 bins
    python bench/screen_levers.py hl_gauss --bins 11 --low -3 --high 3 --sigma 1.0 --tasks counting
    python bench/screen_levers.py hl_gauss --base truth_default --tasks counting   # its exact-value ceiling
    python bench/screen_levers.py horizon --tasks counting lengths

`hl_gauss` (Farebrother et al. 2024, "Stop Regressing"): the value head gives `--bins` logits over a fixed support
[`--low`, `--high`] of the model's output space (normalised returns under `value_norm=running`); the loss is the cross
entropy against the target's histogram smoothed by a Gaussian of `--sigma` bin widths, the value is the expectation;
value clipping keeps a token's loss but stops its gradient where the clipped expectation's error is the larger, as
the max of the clipped mse loss does. `horizon`: λ by state, λ_t = 1 − 1/(α·h_t) with h_t the mean remaining length
(discounted under γ < 1) at position t of the batch's *other* responses that reach t, so no response's own future
sets its λ. Each run appends to `bench/results/screens.jsonl`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import sys
from pathlib import Path
from unittest import mock

import torch
from torch import Tensor

from ppo_critic import train as train_module
from ppo_critic.algos import agg_loss, compute_gae_advantage_return, masked_mean
from ppo_critic.critics import dp
from ppo_critic.critics.base import PPOCriticBase
from ppo_critic.models import hf
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


def hl_gauss_patches(bins: int, low: float, high: float, sigma_bins: float) -> list:
    """The patches that turn the scalar head into `bins` logits, `compute_values` into their expectation and the
    value loss into HL-Gauss cross entropy."""
    edges = torch.linspace(low, high, bins + 1)
    centers, sigma = (edges[1:] + edges[:-1]) / 2, sigma_bins * float(edges[1] - edges[0])
    auto_class = hf._auto_class

    def with_bins(config, head):
        config.num_labels = bins
        return auto_class(config, head)

    def expectation(self, micro):
        logits = self.token_values(micro)[:, -micro.response_length - 1 : -1]
        return (logits.softmax(-1) * centers).sum(-1)

    def loss(self, micro, real, logits, norm, metrics):
        cfg = self.config
        mask = (micro.response_mask if real else torch.zeros_like(micro.response_mask)).bool()
        log_p = logits.float().log_softmax(-1)
        returns = torch.where(mask, micro["returns"], 0.0)
        ce = -(hl_gauss_target(returns, edges, sigma) * log_p).sum(-1)
        value = (log_p.exp() * centers).sum(-1)
        clipped = torch.zeros_like(mask)
        if cfg.cliprange_value is not None:
            old = micro["values"]
            bounded = torch.clamp(value, old - cfg.cliprange_value, old + cfg.cliprange_value)
            clipped = ((bounded - returns) ** 2 > (value - returns) ** 2) & mask
            ce = torch.where(clipped, ce.detach(), ce)
        metrics.add_micro_batch(value, masked_mean(clipped.float(), mask), mask)
        return agg_loss(ce, mask, cfg.loss_agg_mode, **norm)

    return [
        mock.patch.object(hf, "_auto_class", with_bins),
        mock.patch.object(hf, "_finish_head", lambda *_: None),  # no scalar head to initialise
        mock.patch.object(dp, "token_values", lambda module, output: output.logits.float()),
        mock.patch.object(dp.DataParallelPPOCritic, "_forward_micro_batch", expectation),
        mock.patch.object(PPOCriticBase, "_micro_batch_loss", loss),
    ]


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


def horizon_patches() -> list:
    def iteration(worker, source, t):
        batch = source.next_batch()
        batch["values"] = worker.compute_values(batch)
        rewards, mask = batch["token_level_rewards"], batch["response_mask"]
        lam = horizon_lambda(mask, t.length_adaptive_alpha, t.gamma)
        _, batch["returns"] = compute_gae_advantage_return(rewards, batch["values"], mask, t.gamma, lam)
        return worker.update_critic(batch)

    return [mock.patch.object(train_module, "_iteration", iteration)]


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
    p.add_argument("--base", default=None, help="the suite configuration to patch (default: the default recipe)")
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
    for seed in args.seeds:
        for task in args.tasks:
            s = ablation.SUITE[task]
            patches = hl_gauss_patches(args.bins, args.low, args.high, args.sigma) if args.lever == "hl_gauss" else []
            with contextlib.ExitStack() as stack:
                for patch in patches or horizon_patches():
                    stack.enter_context(patch)
                run = ablation.run_one(
                    base, [*ablation.overrides_of(base, task), *args.extra], seed, s.steps, s.eval_every
                )
            row = {"lever": label, "task": task, "seed": seed, "to_0.95": ablation.first_reach(run["curve"], 0.95)}
            row |= {"best_ev": run["best_ev"], "curve": run["curve"]}
            record(row)
            print(f"{task} seed {seed} {label}: to 0.95 {row['to_0.95']}, best EV {run['best_ev']:.3f}", flush=True)


if __name__ == "__main__":
    main()
