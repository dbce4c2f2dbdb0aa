"""What every critic backend shares: the `compute_values` / `update_critic` loops of DESIGN §3, input checks,
loss denominators, micro-batch agreement over data-parallel ranks, metric accumulation and naming."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ppo_critic.config.critic import CriticConfig, RankSizes
from ppo_critic.critics.ema import ParameterEMA
from ppo_critic.critics.objectives import ValueObjective, objective_of
from ppo_critic.critics.perf import ModelShape, PhaseTimer, perf_metrics
from ppo_critic.critics.targets import own_returns
from ppo_critic.critics.value_norm import ValueNormalizer
from ppo_critic.data.batch import DIGESTED, MODEL_KEYS, MULTI_MODAL, TARGET_KEYS, Batch
from ppo_critic.data.batching import check_token_budget, dynamic_micro_batches, fixed_micro_batches, mini_batch_rows
from ppo_critic.parallel import collectives
from ppo_critic.parallel.layout import ParallelLayout

UPDATE_KEYS = (*MODEL_KEYS, "response_mask", *TARGET_KEYS, MULTI_MODAL)


def meta_setting(meta: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    """A bool or int setting from verl's `meta_info`; `default` when absent or None; another type is a TypeError."""
    value = meta.get(key)
    if value is None:
        return default
    if kind is bool:
        if not isinstance(value, bool | np.bool_):
            raise TypeError(
                f"meta_info[{key!r}]={value!r} ({type(value).__name__}) must be True, False or None (a Python bool, "
                "as verl sets it)"
            )
        return bool(value)
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(f"meta_info[{key!r}]={value!r} ({type(value).__name__}) must be an integer or None")
    return int(value)  # its range is checked where it is used (batching.py), naming the config keys too


ToOutputs = Callable[[Tensor], Tensor]  # raw returns or old values -> the model's output space


def empty_mini_batch(batch: Batch) -> Batch:
    """A stand-in mini-batch with no valid tokens (row 0, its response mask zeroed): it contributes nothing to the
    loss, the gradient or the counts, but runs the forward/backward and collectives of a real one."""
    row = batch.index([0])
    return dataclasses.replace(row, tensors=row.tensors | {"response_mask": torch.zeros_like(row.response_mask)})


def local_loss_denominators(response_mask: Tensor) -> dict[str, Tensor]:
    """Valid tokens and non-empty sequences of a mini-batch (to be summed over DP ranks)."""
    mask = response_mask.bool()
    return {"batch_num_tokens": mask.sum().double(), "global_batch_size": (mask.sum(-1) > 0).sum().double()}


class UpdateMetrics:
    """Accumulates `update_critic` metrics on the device; one host transfer in `result()` (DESIGN §3)."""

    def __init__(self, device: torch.device):
        self.timer = PhaseTimer(device)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.tokens, self.clipped, self.vpred_sum = zero.clone(), zero.clone(), zero.clone()
        self.step_losses: list[Tensor] = []
        self.grad_norms: list[Tensor] = []

    def add_micro_batch(self, vpreds: Tensor, clipfrac: Tensor, response_mask: Tensor) -> None:
        n = response_mask.bool().sum().double()
        self.tokens += n
        self.clipped += clipfrac.detach().double() * n
        self.vpred_sum += torch.where(response_mask.bool(), vpreds.detach(), 0.0).sum().double()

    def add_step(self, loss: Tensor, grad_norm: Tensor) -> None:
        self.step_losses.append(loss.detach().double())
        self.grad_norms.append(grad_norm.detach().double())

    def result(
        self,
        batch: Batch,
        lr: float,
        elapsed_s: float,
        epochs: int,
        reduce: Callable[[Tensor, str], Tensor],
        perf: Perf,
    ) -> dict[str, float]:
        """The metrics of DESIGN §3, identical on every rank: sums and extrema go through `reduce` (over DP); one
        host sync reads them all."""
        norms = torch.stack(self.grad_norms)  # global norms: the same on every rank
        finite = torch.isfinite(norms)
        mask = batch.response_mask.bool()
        values, returns = batch["values"].double(), batch["returns"].double()
        err = returns - values
        big, device = torch.finfo(torch.float64).max, values.device
        sums = reduce(
            torch.stack(
                [
                    torch.stack(self.step_losses).sum(),
                    self.tokens,
                    self.clipped,
                    self.vpred_sum,
                    *(torch.where(mask, x, 0.0).sum() for x in (values, returns, returns**2, err, err**2)),
                    mask.sum().double(),
                    batch["attention_mask"].sum().double() * epochs,
                    torch.full((), 3 * perf.forward_flops(batch) * epochs, dtype=torch.float64, device=device),
                ]
            ),
            "sum",
        )
        least = [torch.where(mask, values, big).min(), -torch.where(mask, values, -big).max()]
        least = reduce(torch.stack([*least, torch.full((), -elapsed_s, dtype=torch.float64, device=device)]), "min")
        mean_norm = torch.where(finite, norms, 0.0).sum() / finite.sum().clamp(min=1)
        read = torch.cat([sums, least, torch.stack([mean_norm, (~finite).sum().double()])]).tolist()
        step_loss, tokens, clipped, vpred, v_sum, r_sum, r_sq, e_sum, e_sq, count, seen, flops = read[:12]
        v_min, minus_v_max, minus_slowest, grad_norm, skipped = read[12:]
        n, t = max(count, 1.0), max(tokens, 1.0)
        var_returns = r_sq / n - (r_sum / n) ** 2
        var_err = e_sq / n - (e_sum / n) ** 2
        defined = var_returns > 1e-12 * (r_sq / n)
        empty = count == 0
        metrics = {
            "critic/vf_loss": step_loss / len(self.step_losses),
            "critic/vf_clipfrac": clipped / t,
            "critic/vpred_mean": vpred / t,
            "critic/grad_norm": grad_norm,
            "critic/skipped_steps": skipped,
            "critic/vf_explained_var": 1 - var_err / var_returns if defined else 0.0,
            "critic/values_mean": v_sum / n,
            "critic/values_min": 0.0 if empty else v_min,
            "critic/values_max": 0.0 if empty else -minus_v_max,
            "critic/lr": float(lr),
        }
        return metrics | perf.metrics("", self.timer.seconds(), -minus_slowest, seen, flops)


@dataclass
class Perf:
    """What `perf/*` metrics need to know about a critic: its model's shape (for FLOPs; None when unknown), the
    devices that serve one data-parallel replica's work and the whole world, the device and compute dtype."""

    shape: ModelShape | None
    world_size: int
    device: torch.device
    dtype: torch.dtype

    def forward_flops(self, batch: Batch) -> float:
        return 0.0 if self.shape is None else self.shape.forward_flops(torch.tensor(batch.lengths()))  # on the host

    def metrics(self, prefix: str, seconds: dict, elapsed_s: float, tokens: float, flops: float) -> dict[str, float]:
        flops_or_none = None if self.shape is None else flops
        return perf_metrics(prefix, seconds, elapsed_s, tokens, flops_or_none, self.world_size, self.device, self.dtype)


class PPOCriticBase:
    """The backend-independent critic: epochs → mini-batches → micro-batches → one step (DESIGN §3).

    A backend sets `config`, `sizes` (this rank's), `device`, `layout` (its groups and sizes) and `perf`, calls
    `_use_objective` (the loss, and how head outputs become values), and implements `_values` (the head's outputs
    from the forward of all micro-batches), `_train_mini_batch`, `set_training` and `learning_rate`. The public
    step-level calls (`check_token_ids`, `micro_batches`, `all_reduce`, `set_training`, `learning_rate`, and the
    data-parallel critic's `forward_backward` / `optimizer_step`, or its halves `clip_gradients` / `step_or_skip`)
    are what an engine driving its own loop uses
    (`ppo_critic.integrations.verl_engine`). After `compute_values`, `last_compute_metrics` holds its
    `perf/compute_values_*` metrics (this rank's).
    """

    config: CriticConfig
    sizes: RankSizes
    device: torch.device
    layout: ParallelLayout = ParallelLayout()  # the backend's: dp, sp, tp, pp sizes, this rank's place, groups
    micro_batch_multiple: int = 1  # the micro-batch count is rounded up to a multiple of this (megatron VPP)
    perf: Perf
    vocab_size: int | None = None  # the embedding's rows, when the backend knows them
    last_compute_metrics: dict[str, float] | None = None
    value_norm: ValueNormalizer = ValueNormalizer("off")  # a backend supporting `critic.value_norm` sets its own
    ema: ParameterEMA | None = None  # a backend supporting `critic.ema_decay` sets its own
    serving_live: bool = False  # inside `live_weights`: compute_values runs the live weights, not the average
    objective: ValueObjective  # `critic.vf_loss_type`'s, set by `_use_objective`

    @property
    def dp_group(self) -> Any:
        """The data-parallel process group (`layout.dp_group`; None in a single process)."""
        return self.layout.dp_group

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks (`layout.dp`): the ranks that see different rows."""
        return self.layout.dp

    @property
    def sp_size(self) -> int:
        """The Ulysses ranks one sequence is split over (`layout.sp`)."""
        return self.layout.sp

    @torch.no_grad()
    def compute_values(self, data: Any) -> Tensor:
        """Values [B, R] (float32, CPU) of each response token; exactly 0 at masked positions.

        verl's `meta_info` keys `micro_batch_size`, `use_dynamic_bsz` and `max_token_len` override the
        forward settings of the config for this call (a key holding None is not set, as in verl's workers).
        """
        batch = self._checked_batch(data)
        use_dynamic = meta_setting(batch.meta_info, "use_dynamic_bsz", self.config.use_dynamic_bsz, bool)
        micro_batch_size = meta_setting(batch.meta_info, "micro_batch_size", self.sizes.forward_micro_batch, int)
        max_token_len = meta_setting(batch.meta_info, "max_token_len", self.sizes.forward_max_token_len, int)
        max_token_len *= self.sp_size
        start = time.perf_counter()
        batch = batch.select((*MODEL_KEYS, "response_mask", MULTI_MODAL)).with_lengths()  # read where it arrives
        batch = batch.to(self.device, non_blocking=True)
        groups = self.micro_batches(batch, use_dynamic, micro_batch_size, max_token_len)
        self.set_training(False)
        with self.averaged_weights():
            values = self.value_norm.denormalise(self.objective.values(self._values(batch, groups)))
        self.value_norm.values_served()
        values = torch.where(batch.response_mask.bool(), values, 0.0).float().cpu()
        replica = self.perf.world_size // self.dp_size  # this rank's share of the devices: the replica's
        tokens, flops = float(sum(batch.lengths())), self.perf.forward_flops(batch)
        local = Perf(self.perf.shape, replica, self.perf.device, self.perf.dtype)
        self.last_compute_metrics = local.metrics("compute_values_", {}, time.perf_counter() - start, tokens, flops)
        return values

    def update_critic(self, data: Any) -> dict[str, float]:
        """PPO epochs × mini-batches of the clipped value loss; one optimizer step per mini-batch.

        All checks run before the first step, so a bad batch changes neither parameters nor optimizer state.
        """
        cfg = self.config
        batch = self._checked_batch(data, require_targets=True)
        self._check_trainable()
        max_token_len = self.sizes.max_token_len * self.sp_size
        batch = batch.select(UPDATE_KEYS).with_lengths()  # read where it arrives, then carried to its mini-batches
        if cfg.use_dynamic_bsz:
            check_token_budget(batch.lengths(), max_token_len)
        batch = batch.to(self.device, non_blocking=True)
        targets = self._normalised_targets(batch)
        # every DP rank takes the same number of steps: a rank whose share ran out of rows (a short last
        # mini-batch) steps with an empty mini-batch, so the collectives of the others are matched
        steps = self.most_over_ranks(math.ceil(len(batch) / self.sizes.mini_batch))
        metrics = UpdateMetrics(self.device)
        self.set_training(True)
        start = time.perf_counter()
        for epoch in range(cfg.ppo_epochs):
            minis = mini_batch_rows(
                len(batch), self.sizes.mini_batch, shuffle=cfg.shuffle, seed=cfg.data_loader_seed, epoch=epoch
            )
            for rows in minis:
                self._train_mini_batch(targets.index(rows), metrics, max_token_len)
            for _ in range(steps - len(minis)):
                self._train_mini_batch(empty_mini_batch(targets), metrics, max_token_len)
        return self._metrics(metrics, batch, time.perf_counter() - start)

    def _normalised_targets(self, batch: Batch) -> Batch:
        """With `value_norm`: update the return statistics from this call's returns, then `batch` with the returns
        and the old values in the model's output space (`ValueNormalizer.normalise_old_values`)."""
        if not self.value_norm.enabled:
            return batch
        to_returns, to_values = self.target_maps(batch["returns"], batch.response_mask, batch["values"])
        targets = {"returns": to_returns(batch["returns"]), "values": to_values(batch["values"])}
        return dataclasses.replace(batch, tensors=batch.tensors | targets)

    def target_maps(
        self, returns: Tensor, mask: Tensor, values: Tensor | None = None, update: bool = True
    ) -> tuple[ToOutputs, ToOutputs]:
        """Under `value_norm`, the maps of returns and of old values into the model's output space, after merging
        the valid `returns` into the statistics (`update`; the old raw `values` set PopArt's first move); the old
        values map by the statistics that served them (`ValueNormalizer.normalise_old_values`). Shared by
        `update_critic` and verl's engine."""
        norm = self.value_norm
        served = norm.snapshot()
        if update:
            self.update_value_norm(returns, mask, values)
        return norm.normalise, lambda values: norm.normalise_old_values(values, served)

    def _metrics(self, metrics: UpdateMetrics, batch: Batch, elapsed_s: float) -> dict[str, float]:
        """`critic/*` in raw return space (the loss excepted: it is in normalised space under `value_norm`)."""
        result = metrics.result(
            batch, self.learning_rate(), elapsed_s, self.config.ppo_epochs, self.all_reduce, self.perf
        )
        if self.value_norm.enabled:
            mean, std = self.value_norm.mean.item(), self.value_norm.std.item()
            result["critic/vpred_mean"] = mean + std * result["critic/vpred_mean"]
            result |= {"critic/value_norm_mean": mean, "critic/value_norm_std": std}
        return result

    def update_value_norm(self, returns: Tensor, mask: Tensor, values: Tensor | None = None) -> None:
        """Merge the valid `returns` into `value_norm`'s statistics, summed over the DP ranks; under PopArt the
        value head is rescaled so that the critic's raw values do not move — the live head and, under `ema_decay`,
        the average's (the rescale is affine in the head's weights, so it commutes with averaging them); the first
        merge moves them to the returns' mean from the old `values`' (`ValueNormalizer.update`). A no-op when off."""
        norm = self.value_norm
        if norm.mode != "popart":
            norm.update(returns, mask, self.all_reduce)
            return
        before = norm.snapshot()
        with self._value_head() as head:
            merged = norm.update(returns, mask, self.all_reduce, head, values)
        if merged and self.ema is not None:
            with self._average_applied(), self._value_head() as head:
                norm.carry(head, before)

    @contextlib.contextmanager
    def averaged_weights(self) -> Iterator[None]:
        """The weights `compute_values` runs with: the live ones (no `ema_decay`, or inside `live_weights`), else
        their moving average swapped into the parameters for the context."""
        if self.ema is None or self.serving_live:
            yield
            return
        with self._average_applied():
            yield

    @contextlib.contextmanager
    def _average_applied(self) -> Iterator[None]:
        """The moving average in the parameters, the live weights back after (`_reshard` on both sides)."""
        self._reshard()
        with self.ema.applied():
            try:
                yield
            finally:
                self._reshard()

    @contextlib.contextmanager
    def live_weights(self) -> Iterator[None]:
        """`compute_values` on the live weights inside the context, not their average: what `ema_decay` buys, and
        the critic the average would be a target network for. The average itself is kept: an update inside still
        moves it, and PopArt still rescales its head."""
        was, self.serving_live = self.serving_live, True
        try:
            yield
        finally:
            self.serving_live = was  # a nested context leaves the outer one serving the live weights

    def _reshard(self) -> None:
        """Make the parameters `ParameterEMA` edits the ones in use (nothing to do unless a wrapper caches them)."""

    def _value_head(self) -> contextlib.AbstractContextManager[torch.nn.Linear | None]:
        """The model's `Linear(hidden, 1)` value head, editable in place inside the context (for PopArt); None on a
        rank that holds none (a pipeline stage before the last)."""
        raise NotImplementedError(f"{type(self).__name__} does not support value_norm=popart")

    def check_token_ids(self, batch: Batch) -> None:
        """Token ids must index the model's vocabulary (checked before any step, not in a later mini-batch)."""
        largest = int(batch["input_ids"].max()) if batch["input_ids"].numel() else -1
        if self.vocab_size is not None and largest >= self.vocab_size:
            raise ValueError(
                f"input_ids holds token id {largest}, but the model's vocabulary has {self.vocab_size} entries "
                f"(ids 0..{self.vocab_size - 1}); tokenize with the critic's tokenizer, or build the model with a "
                "larger vocab_size (critic.model.override_config.vocab_size)"
            )

    def _checked_batch(self, data: Any, require_targets: bool = False) -> Batch:
        """`data` as a Batch, with every input check a call makes before any state changes."""
        batch = Batch.from_any(data)
        batch.validate(require_targets=require_targets)
        if require_targets and self.config.targets_lam is not None:  # checked as the trainer's returns were
            returns = own_returns(batch.tensors, batch.response_mask, self.config)
            batch = Batch({**batch.tensors, "returns": returns}, batch.non_tensors, batch.meta_info)
            batch.validate(require_targets=True)
        self.check_token_ids(batch)
        if require_targets:  # returns the objective cannot model (bce: outside [0, 1])
            self.objective.check_returns(batch["returns"], batch.response_mask)
        self._check_batch(batch)
        self._check_same_batch(batch)
        return batch

    def _check_batch(self, batch: Batch) -> None:
        """Backend-specific input checks (after `Batch.validate`, before any state changes)."""

    def _check_trainable(self) -> None:
        """Backend-specific checks that an update can train the model (before any state changes)."""

    def _check_same_batch(self, batch: Batch) -> None:
        """The ranks that compute one step together (`layout.replica_group`: Ulysses' pieces of a sequence, megatron's
        TP × PP) must each hold the same batch: other rows abort in a collective, other tokens give wrong values in
        silence. One small gather per call; every rank of the group raises alike, before any state changes."""
        group = self.layout.replica_group
        if group is None:
            return
        every = collectives.all_gather(batch.digest(), group)
        if bool(torch.stack(every).eq(every[0]).all()):  # one host sync
            return
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(group)
        held = ", ".join(f"rank {r}: {int(d[0])} rows × {int(d[1])} tokens" for r, d in zip(ranks, every, strict=True))
        names = ("rows", "tokens per row", *DIGESTED)
        differ = [n for i, n in enumerate(names) if any(d[i] != every[0][i] for d in every)]
        raise ValueError(
            f"the ranks that compute one step together hold different batches ({held}; differing: "
            f"{', '.join(differ)}); give every rank of a sequence-parallel (Ulysses) or tensor/pipeline-parallel group "
            "the same batch, and split rows over data-parallel ranks only (as verl dispatches)"
        )

    def _values(self, batch: Batch, groups: list[list[int]]) -> Tensor:
        raise NotImplementedError

    def _train_mini_batch(self, mini_batch: Batch, metrics: UpdateMetrics, max_token_len: int) -> None:
        raise NotImplementedError

    def set_training(self, mode: bool) -> None:
        raise NotImplementedError

    def learning_rate(self) -> float:
        raise NotImplementedError

    def _use_objective(self) -> None:
        """Build `critic.vf_loss_type`'s objective; a `value_norm` it does not work with is refused (PopArt rescales
        the head's one output, so it needs that output to be the value)."""
        objective, cfg = objective_of(self.config), self.config
        if cfg.value_norm == "popart" and not objective.identity:
            raise ValueError(
                f"vf_loss_type={cfg.vf_loss_type} works with value_norm off or running, not popart (PopArt rescales "
                "a head whose one output is the value)"
            )
        if cfg.value_norm not in objective.value_norms:
            raise ValueError(
                f"vf_loss_type={cfg.vf_loss_type} works with value_norm {' or '.join(objective.value_norms)}, "
                f"not {cfg.value_norm}"
            )
        self.objective = objective

    def _micro_batch_loss(
        self, micro: Batch, real: bool, outputs: Tensor, norm: dict[str, Any], metrics: UpdateMetrics
    ) -> Tensor:
        """The objective's loss of one micro-batch's head outputs [b, R(, outputs)] over the global denominators
        `norm` (zero weight when it only keeps the ranks in step), recorded in `metrics`."""
        cfg = self.config
        mask = micro.response_mask if real else torch.zeros_like(micro.response_mask)
        loss, clipfrac = self.objective.loss(
            outputs, micro["returns"], micro["values"], mask, cfg.cliprange_value, cfg.loss_agg_mode, **norm
        )
        metrics.add_micro_batch(self.objective.values(outputs), clipfrac, mask)
        return loss

    def _loss_is_finite(self, step_loss: Tensor) -> bool:
        """Whether the step's loss is finite on every data-parallel rank (all ranks then skip together)."""
        return bool(self._loss_finite_everywhere(step_loss))

    def _loss_finite_everywhere(self, step_loss: Tensor) -> Tensor:
        """`_loss_is_finite` as a device bool, for a caller that reads it with the gradient norm (one host sync)."""
        return torch.isfinite(self.all_reduce(step_loss.detach().double())).all()

    def _loss_denominators(self, mini_batch: Batch) -> dict[str, Tensor]:
        """The global denominators of DESIGN §3: this mini-batch's counts summed over the DP ranks."""
        return {k: self.all_reduce(v) for k, v in local_loss_denominators(mini_batch.response_mask).items()}

    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        """`op` (sum, max or min) of `x` over the data-parallel ranks; `x` itself in a single process."""
        return x if self.dp_size == 1 else collectives.all_reduce(x, op, self.dp_group)

    def micro_batches(self, batch: Batch, dynamic: bool, size: int, max_token_len: int) -> list[list[int]]:
        """Row groups of the micro-batches; every DP rank gets the same number (empty groups pad the count)."""
        lens = batch.lengths() if dynamic else []
        groups = dynamic_micro_batches(lens, max_token_len) if dynamic else fixed_micro_batches(len(batch), size)
        count = self.most_over_ranks(len(groups))
        count = -(-count // self.micro_batch_multiple) * self.micro_batch_multiple
        if count > len(groups) and dynamic:
            groups = dynamic_micro_batches(lens, max_token_len, min_num_micro_batches=count)
        return groups + [[] for _ in range(count - len(groups))]

    def most_over_ranks(self, n: int) -> int:
        """The largest `n` of any data-parallel rank: one host sync under DP, none in a single process."""
        if self.dp_size == 1:
            return n
        return int(self.all_reduce(torch.full((), n, device=self.device), "max"))
