"""ppo-critic as the value-model engine of verl ≥ 0.9 (`critic.strategy=ppo_critic`); registered with verl's
`EngineRegistry` by `ppo_critic.integrations.verl_plugin` when verl's engines load.

verl's `TrainingWorker` loops epochs and mini-batches and hands the engine one mini-batch (nested, padding-free
`TensorDict`) and verl's loss function at a time. The engine cuts micro-batches (fixed or token-budget, the same
count on every DP rank), runs ppo-critic's critic on each (packed attention without flash-attn, Ulysses, FSDP2 /
FSDP1 / DDP), calls verl's loss with the mini-batch's global denominators, and steps (clip, skip when not finite,
moving average). Model, optimizer, LR schedule, moving average and checkpoints are a ppo-critic `CriticWorker`'s.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.utils.py_functional import append_to_dict
from verl.utils.tensordict_utils import maybe_fix_3d_position_ids
from verl.workers.engine.base import BaseEngine, EngineRegistry

from ppo_critic.backends.build import model_source
from ppo_critic.backends.data_parallel.critic import MicroLoss, MicroResult
from ppo_critic.config.critic import CriticConfig, ModelConfig
from ppo_critic.config.env import OPTIONS_ENV, named_in_refusals, with_options
from ppo_critic.config.verl import engine_section, to_mapping
from ppo_critic.critics.targets import REWARDS, SCORES, own_returns
from ppo_critic.data.batch import MULTI_MODAL, Batch, to_device
from ppo_critic.data.batching import check_token_budget, restore_order
from ppo_critic.data.packing import valid_positions
from ppo_critic.models.attention import packed_blocker
from ppo_critic.models.hf import build_value_model, hf_config_for
from ppo_critic.parallel.layout import layout_of
from ppo_critic.parallel.mesh import select_device
from ppo_critic.parallel.offload import PhaseOffload
from ppo_critic.run.checkpoint import delete_checkpoint, latest_checkpoint
from ppo_critic.worker import CriticWorker, worker_config

BACKEND = "ppo_critic"
# ppo-critic options that verl decides under this engine (its worker cuts mini-batches, its loss is verl's), and what a
# user does instead: the first are keys of verl 0.9's critic config under the same names
VERL_OWNED = ("ppo_mini_batch_size", "ppo_epochs", "shuffle", "data_loader_seed", "cliprange_value", "loss_agg_mode")
VERL_DECIDES = {key: f"set critic.{key} in verl's critic config" for key in (*VERL_OWNED, "loss_scale_factor")} | (
    dict.fromkeys(("vf_loss_type", "huber_delta"), "remove it: verl's value_loss is the clipped squared error")
)
# verl's value_loss metrics that are means over a micro-batch's response tokens (`MiniBatchReport`)
VPRED_MEAN = "critic/vpred_mean"
TOKEN_MEANS = ("critic/vf_clipfrac", VPRED_MEAN)
LOSSES = "loss"  # the micro-batches' losses, read beside the metrics
GRAD_NORM = "grad_norm"  # the step's pre-clip norm, read with the losses and metrics (`train_batch`)
TARGETS = ("returns", "response_mask", "values")  # what `value_norm` maps (the mask says which returns count)
# the keys that set the engine's token budgets in verl 0.9's trainers (verl's yaml lacks the first: hydra needs `+`)
INFER_BUDGET = "+critic.ppo_infer_max_token_len_per_gpu=N (verl's compute-values budget)"
TRAIN_BUDGET = (
    "+critic.ppo_infer_max_token_len_per_gpu=N under verl's default trainer, which gives the engine that budget for "
    "training too; critic.ppo_max_token_len_per_gpu=N under trainer.use_v1=false"
)


def engine_critic_config(model_config: Any, engine_config: Any, optimizer_config: Any) -> CriticConfig:
    """ppo-critic's critic config from verl's model, engine and optimizer configs (+ `PPO_CRITIC_OPTIONS`).

    Each of verl's keys is taken over (sizes, budgets, Ulysses, dtype, offload, clipping, the model and optimizer
    settings), left to verl (what verl reads around the engine, its own engine's tuning knobs), or refused in one line
    naming it, why and what to use: `ppo_critic.config.verl.engine_keys`, the one home of that policy.
    """
    section = engine_section(to_mapping(model_config), to_mapping(engine_config), to_mapping(optimizer_config))
    base = CriticConfig.from_dict(section)
    config = with_options(base)
    check_verl_decides(base, config)
    return worker_config(config)


def check_verl_decides(base: CriticConfig, config: CriticConfig) -> None:
    """Refuse `PPO_CRITIC_OPTIONS` that would have no effect: under the engine, verl's worker cuts the mini-batches
    and verl's own value loss computes the loss, each from verl's critic config."""
    changed = [key for key in VERL_DECIDES if getattr(config, key) != getattr(base, key)]
    if changed:
        instead = "; ".join(f"{key}: {VERL_DECIDES[key]}" for key in changed)
        raise ValueError(
            f"{OPTIONS_ENV} sets {', '.join(changed)}, which verl decides under the {BACKEND} engine (its worker cuts "
            f"the mini-batches, its value_loss computes the loss); instead, {instead}"
        )


def check_packing(config: CriticConfig, device: torch.device) -> None:
    """verl's `critic.model.use_remove_padding=true` (its default) and Ulysses need packed rows: a model that cannot run
    them is refused before it is built, in verl's keys, with values verl's fields take (the critic names its own)."""
    sp, packing = config.ulysses_sequence_parallel_size, config.model.use_remove_padding
    if packing is not True and sp == 1:
        return
    blocker = packed_blocker(model_skeleton(config.model), config.model.attn_implementation, device)
    if blocker is None:
        return
    if sp > 1:
        raise ValueError(
            f"critic.fsdp.ulysses_sequence_parallel_size={sp} needs packed rows, which this model cannot run: "
            f"{blocker}; set critic.fsdp.ulysses_sequence_parallel_size=1"
        )
    raise ValueError(
        f"critic.model.use_remove_padding=true: this model cannot run packed rows: {blocker}; set "
        "critic.model.use_remove_padding=false"
    )


def model_skeleton(model: ModelConfig) -> torch.nn.Module:
    """The value model `model` describes, on the meta device: its config as the worker reads it, no weights."""
    config = hf_config_for(*model_source(model), model.trust_remote_code)
    with torch.device("meta"):
        return build_value_model(
            config, attn_implementation=model.attn_implementation, trust_remote_code=model.trust_remote_code
        )


@EngineRegistry.register(model_type="value_model", backend=BACKEND, device=["cuda", "cpu"])
class PPOCriticEngine(BaseEngine):
    """verl's engine interface over a ppo-critic `CriticWorker` (built in `initialize`)."""

    def __init__(self, model_config: Any, engine_config: Any, optimizer_config: Any, checkpoint_config: Any):
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.config = engine_critic_config(model_config, engine_config, optimizer_config)
        self.device = select_device("auto")
        self.phases = PhaseOffload.of(self.config.model.fsdp_config, self.device)
        # verl's worker asks for the data-parallel rank before `initialize`: the groups exist from here on; it cuts
        # the mini-batches, so the engine's sizes are this rank's already
        self.layout = layout_of(self.config).per_rank()
        self.worker: CriticWorker | None = None
        self.mode: str | None = None
        self._finite: list[Tensor] = []  # per micro-batch of this step, on the device: read once, at the step
        self._saved: list[Path] = []

    def initialize(self) -> None:
        """Model, optimizer, LR schedule and critic (once; verl's `reset` calls this again)."""
        if self.worker is None:
            total = getattr(self.optimizer_config, "total_training_steps", None)
            seed = getattr(self.engine_config, "seed", 0) or 0
            total = total if total and total > 0 else None
            with named_in_refusals():  # a refusal of an option PPO_CRITIC_OPTIONS set names the variable
                check_packing(self.config, self.device)
                self.worker = CriticWorker(self.config, total_steps=total, seed=seed, layout=self.layout)

    @property
    def is_param_offload_enabled(self) -> bool:
        """Whether parameters and gradients rest in host memory between modes (`PhaseOffload.of`)."""
        return self.phases.params

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        """Whether the optimizer state rests in host memory between training modes (`PhaseOffload.of`)."""
        return self.phases.optimizer

    @contextlib.contextmanager
    def train_mode(self, **kwargs: Any) -> Iterator[None]:
        """Parameters and optimizer state on the device inside, in host memory after, as offload is configured."""
        self.mode = "train"
        self._critic.set_training(True)
        try:
            with self._auto_offload(kwargs, optimizer=self.phases.optimizer):
                yield
        finally:
            self.mode = None

    @contextlib.contextmanager
    def eval_mode(self, **kwargs: Any) -> Iterator[None]:
        """Values come from the weights `compute_values` uses: under `ema_decay`, their moving average. The
        parameters are on the device inside, in host memory after, as offload is configured."""
        self.mode = "eval"
        self._critic.set_training(False)
        try:
            with self._auto_offload(kwargs, optimizer=False), self._critic.averaged_weights():
                yield
        finally:
            self.mode = None

    @contextlib.contextmanager
    def _auto_offload(self, kwargs: dict[str, Any], optimizer: bool) -> Iterator[None]:
        """verl's automatic offload around a mode: what rests in host memory is loaded on entry and offloaded on
        exit, unless `disable_auto_offload=True` (verl's worker passes it inside a mode it entered itself)."""
        auto = not kwargs.get("disable_auto_offload", False)
        parts = {"model": auto and self.phases.params, "optimizer": auto and optimizer}
        self._worker.offload.to_device(**parts)
        try:
            yield
        finally:
            self._worker.offload.to_host(**parts)

    def optimizer_zero_grad(self) -> None:
        self._critic.critic_optimizer.zero_grad(set_to_none=True)
        self._finite = []

    def optimizer_step(self) -> Tensor:
        """Clip, then step — or skip when the gradient norm or a micro-batch loss was not finite (NaN). The pre-clip
        norm comes back as a device scalar, which verl's worker reads. For verl's base `train_batch` flow, where the
        decision to step is a host sync of its own; the engine's `train_batch` reads it with the metrics."""
        return self._critic.optimizer_step(self._loss_is_finite())

    def _loss_is_finite(self) -> Tensor:
        """Whether every micro-batch loss of this step was finite on every DP rank: a device bool, not read here."""
        local = (
            torch.stack(self._finite).all() if self._finite else torch.ones((), dtype=torch.bool, device=self.device)
        )
        return self._critic.all_reduce(local.double(), "min") == 1

    def lr_scheduler_step(self) -> float:
        self.worker.scheduler.step()
        return self._critic.learning_rate()

    def train_batch(self, data: TensorDict, loss_function: Callable) -> dict[str, Any]:
        """verl's `BaseEngine.train_batch` (zero the gradients, forward and backward the mini-batch, step; the same
        outputs, `grad_norm` among the metrics of a rank that reports) with one read of device data: the decision to
        step, the gradient norm and the losses with all metrics, together, at the step (DESIGN §3 "Host syncs")."""
        maybe_fix_3d_position_ids(data)
        self.optimizer_zero_grad()
        outputs, report = self._forward_backward(data, loss_function, train=True)
        parts = self._report_parts(report, train=True)  # its collective first, as in verl's base flow
        grad_norm = self._critic.clip_gradients(self._loss_is_finite())
        read = read_once({GRAD_NORM: grad_norm.double().reshape(1)} | parts)
        (norm,) = read.pop(GRAD_NORM)
        self._critic.step_or_skip(math.isfinite(norm))
        losses, metrics = report.collected(read)
        if self.is_mp_src_rank_with_outputs():
            metrics[GRAD_NORM] = norm  # a float, as verl's own engines return it (its worker takes either)
        return outputs | {"loss": losses, "metrics": metrics}

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable | None, forward_only: bool = False):
        """Micro-batches of one mini-batch through the critic: per-token `values` (nested, like verl's own value
        engine), verl's `loss_function` over the global denominators, and (unless `forward_only`) the backward. The
        loss and metrics are the mini-batch's, whatever the micro-batches, DP or SP (`MiniBatchReport`), read to the
        host here, in one read (the engine's own `train_batch` reads them at the step instead)."""
        train = not forward_only
        outputs, report = self._forward_backward(data, loss_function, train)
        losses, metrics = report.collected(read_once(self._report_parts(report, train)))
        return outputs | {"loss": losses, "metrics": metrics}

    def _forward_backward(
        self, data: TensorDict, loss_function: Callable | None, train: bool
    ) -> tuple[dict[str, Any], MiniBatchReport]:
        """`forward_backward_batch` with its loss and metrics left on the device, in the report.

        verl's worker hands the mini-batch on the host. Its lengths are read once, as it arrives, and size every
        micro-batch on the host (DESIGN §3 "Host syncs"); each micro-batch of verl's data moves to the device without
        blocking. The mini-batch's own reads here are of host data: the input check and the denominators (under DP,
        the denominators and the micro-batch count are collectives' results)."""
        critic = self._critic
        batch = dense_inputs(data)
        critic.check_token_ids(batch)  # on the host, before any work
        batch = batch.to(self.device, non_blocking=True)
        groups = self._micro_batches(data, batch, train)
        report = MiniBatchReport(self.device)
        loss_fn = None
        if loss_function is not None:
            self._own_returns(data)
            self._assign_denominators(data)
            targets = self._target_maps(data, update=train)
            loss_fn = self._micro_loss(data, loss_function, report, targets)
        results = critic.forward_backward(batch, groups, loss_fn, backward=train)
        self._finite += [torch.isfinite(m.loss) for m in results if m.loss is not None]
        values = map_flat(values_in_order(results, batch), self._raw_values)
        if not train:  # values served (verl's infer_batch): PopArt's first move is behind them
            critic.value_norm.values_served()
        return {"model_output": {"values": values}}, report

    def _raw_values(self, outputs: Tensor) -> Tensor:
        """The head's outputs as raw values: the objective's values (mse's, the outputs: verl's own value_loss trains
        them, and vf_loss_type is refused), de-normalised under `value_norm`."""
        return self._critic.value_norm.denormalise(self._critic.objective.values(outputs))

    def _micro_batches(self, data: TensorDict, batch: Batch, train: bool) -> list[list[int]]:
        """The row groups of the mini-batch: verl's per-call `use_dynamic_bsz`, `micro_batch_size_per_gpu` and
        `max_token_len_per_gpu` where it sets them, else the engine's; a row over the budget names verl's keys."""
        critic, sizes = self._critic, self._critic.sizes
        dynamic = bool(tu.get_non_tensor_data(data, "use_dynamic_bsz", self.config.use_dynamic_bsz))
        micro = tu.get_non_tensor_data(data, "micro_batch_size_per_gpu", None) or (
            sizes.micro_batch if train else sizes.forward_micro_batch
        )
        default_budget = sizes.max_token_len if train else sizes.forward_max_token_len
        budget = (tu.get_non_tensor_data(data, "max_token_len_per_gpu", None) or default_budget) * critic.sp_size
        if dynamic:
            check_token_budget(batch.lengths(), budget, TRAIN_BUDGET if train else INFER_BUDGET)
        return critic.micro_batches(batch, dynamic, int(micro), int(budget))

    def _micro_loss(
        self, data: TensorDict, loss_function: Callable, report: MiniBatchReport, targets: TargetMaps
    ) -> MicroLoss:
        """verl's `loss_function` on a micro-batch's rows of `data` (selected on the host, moved without blocking),
        kept in `report`; the backward gets it times sp (`_assign_denominators`)."""
        sp_size = self._critic.sp_size

        def verl_loss(inputs: Batch, rows: list[int], token_values: Tensor) -> Tensor:
            values = as_jagged(token_values, inputs)
            micro_data = targets.apply(
                tu.index_select_tensor_dict(data, rows or [0]).to(self.device, non_blocking=True)
            )
            loss, metrics = loss_function(
                model_output={"values": values}, data=micro_data, dp_group=self.get_data_parallel_group()
            )
            if not rows:
                return loss * 0  # a stand-in group keeps the ranks in step with zero weight
            report.add(loss, metrics, flat(micro_data["response_mask"]))
            return loss * sp_size

        return verl_loss

    def _report_parts(self, report: MiniBatchReport, train: bool) -> dict[str, Tensor]:
        """verl's losses and the mini-batch's metrics, as device tensors to read (`MiniBatchReport.parts`); under
        `value_norm` the predictions' mean in raw space (as ppo-critic's own critic reports it) and, in training, the
        return statistics."""
        norm = self._critic.value_norm
        extras = {"critic/value_norm_mean": norm.mean, "critic/value_norm_std": norm.std}
        raw = {VPRED_MEAN: norm.denormalise}
        return report.parts(self._critic.all_reduce, self.layout.dp, raw, extras if norm.enabled and train else {})

    def _own_returns(self, data: TensorDict) -> None:
        """Under `critic.targets_lam`: the mini-batch's returns recomputed from its rewards and old values (its rows
        are whole), in verl's layout, before verl's loss reads them."""
        config = self._critic.config
        if config.targets_lam is None:
            return
        given = {key: data.get(key, None) for key in (REWARDS, SCORES, "values", "response_mask")}
        tensors = {key: dense_rows(value) for key, value in given.items() if value is not None}
        data["returns"] = jagged_like(own_returns(tensors, tensors["response_mask"], config), data["returns"])

    def _assign_denominators(self, data: TensorDict) -> None:
        """verl's loss normalises by `batch_num_tokens` (this mini-batch's loss-mask tokens on every DP rank) and
        `global_batch_size` (its sequences), times `dp_size`, the DP size, as verl's own engine sets it: so the loss
        and the metrics verl reads are the mini-batch's. Gradients are averaged over all dp × sp ranks, and under
        Ulysses each sp rank backpropagates its slice of the loss: the backward gets the loss times sp. Read once:
        from the host data in one process, after one collective under DP."""
        tokens = flat(data["loss_mask"]).sum().double()
        local = torch.stack([tokens, torch.full_like(tokens, float(len(data)))])
        if self.layout.dp > 1:
            local = self._critic.all_reduce(to_device(local, self.device))
        tokens, rows = local.tolist()
        assign = {"batch_num_tokens": tokens, "dp_size": self.layout.dp}
        if tu.get_non_tensor_data(data, "global_batch_size", None) is None:
            assign["global_batch_size"] = rows
        tu.assign_non_tensor(data, **assign)

    def _target_maps(self, data: TensorDict, update: bool) -> TargetMaps:
        """Under `value_norm` the model predicts normalised returns: verl's loss gets `returns` and old `values` in
        that space. Training first merges this mini-batch's returns into the statistics (over DP, before its step;
        ppo-critic's own `update_critic` merges the whole call's before its first step: the two agree when a call
        is one mini-batch, and the statistics agree after every call; each further epoch merges the same returns
        again, which leaves their mean and variance as they are and only weighs the call more against earlier ones;
        under `value_norm_decay` < 1 each merge also decays what the statistics held, so they forget faster there)."""
        if not self._critic.value_norm.enabled:
            return TargetMaps()
        returns, mask, values = (flat(data[key]).to(self.device, non_blocking=True) for key in TARGETS)
        return TargetMaps(*self._critic.target_maps(returns, mask, values, update))

    def get_data_parallel_size(self) -> int:
        return self.layout.dp

    def get_data_parallel_rank(self) -> int:
        return self.layout.dp_rank

    def get_data_parallel_group(self) -> Any:
        return self.layout.dp_group

    def is_mp_src_rank_with_outputs(self) -> bool:
        """One rank per sequence-parallel group reports (they all hold the same outputs)."""
        return self.layout.sp_rank == 0

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """verl's manual placement, whatever the offload settings: parameters (their gradients travel with them) and
        optimizer state onto the engine's device, or into host memory ("cpu"; on a CPU engine, its device)."""
        if grad and not model:
            raise ValueError(f"the {BACKEND} engine moves gradients with their parameters: grad=True needs model=True")
        kind, offload = torch.device(device).type, self._worker.offload
        if kind == self.device.type:
            offload.to_device(model=model, optimizer=optimizer)
        elif kind == "cpu":
            offload.to_host(model=model, optimizer=optimizer)
        else:
            raise ValueError(f"the {BACKEND} engine moves its state to {self.device} or the CPU, not to {device}")

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Model, optimizer, LR schedule, moving average and RNG (DCP, written atomically) under `local_path`; of
        the checkpoints this engine wrote, only the newest `max_ckpt_to_keep` are kept."""
        if hdfs_path is not None:
            raise ValueError(f"the {BACKEND} engine saves to a local (or mounted) path only; got hdfs_path={hdfs_path}")
        self.worker.step = int(global_step)
        self._saved.append(self.worker.save_checkpoint(local_path))
        if max_ckpt_to_keep and len(self._saved) > max_ckpt_to_keep:
            if torch.distributed.get_rank() == 0:
                for old in self._saved[:-max_ckpt_to_keep]:
                    delete_checkpoint(old)
            self._saved = self._saved[-max_ckpt_to_keep:]

    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True, **kwargs: Any
    ) -> None:
        """The newest complete checkpoint under `local_path` (files are never deleted after loading)."""
        path = latest_checkpoint(local_path)
        if path is None:
            raise FileNotFoundError(f"no complete {BACKEND} checkpoint under {local_path}")
        self.worker.load_checkpoint(path)

    def get_per_tensor_param(self, **kwargs: Any):
        raise NotImplementedError(f"the {BACKEND} engine is a critic: its weights are not synced to a rollout")

    @property
    def _worker(self) -> CriticWorker:
        if self.worker is None:
            raise RuntimeError(f"the {BACKEND} engine is not initialised; call initialize() (verl's reset) first")
        return self.worker

    @property
    def _critic(self):
        return self._worker.critic


@dataclass
class TargetMaps:
    """The maps of verl's `returns` and old `values` into the model's output space (`value_norm`; none when off)."""

    returns: Callable[[Tensor], Tensor] | None = None
    values: Callable[[Tensor], Tensor] | None = None

    def apply(self, data: TensorDict) -> TensorDict:
        """`data` (a micro-batch of verl's) with its returns and old values mapped, in place."""
        for key, fn in (("returns", self.returns), ("values", self.values)):
            if fn is not None:
                data[key] = map_flat(data[key], fn)
        return data


class MiniBatchReport:
    """verl's loss and metrics of one mini-batch, one value per metric over all DP ranks. verl's value_loss reports per
    micro-batch and verl's worker averages those unweighted, which would change with the micro-batches and DP: here a
    summed `Metric` (the loss over the global denominators) is summed over the micro-batches and read as verl reads
    it, and a mean over response tokens (`TOKEN_MEANS`) is weighted by each micro-batch's tokens; any other metric
    passes through as verl gave it. Kept on the device (verl's numbers, host floats, beside it) until read
    (`parts`, `read_once`, `collected`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._losses: list[Tensor] = []
        self._tokens: list[Tensor] = []
        self._weighted: dict[str, list[Tensor]] = {}  # token means × tokens, per micro-batch, on the device
        self._sums: dict[str, float] = {}  # summed Metrics over the micro-batches (verl gives host floats)
        self._summed: dict[str, AggregationType] = {}  # keys of summed Metrics -> their aggregation
        self._passed: dict[str, Any] = {}

    def add(self, loss: Tensor, metrics: dict[str, Any], response_mask: Tensor) -> None:
        """One real micro-batch: verl's loss and metrics of it, weighted by the valid tokens of `response_mask`."""
        self._losses.append(loss.detach())
        tokens = (response_mask != 0).sum().double()
        self._tokens.append(tokens)
        for key, value in metrics.items():
            if isinstance(value, Metric) and value.aggregation is AggregationType.SUM:
                self._summed[key] = value.aggregation
                self._sums[key] = self._sums.get(key, 0.0) + sum(value.values)
            elif key in TOKEN_MEANS and not isinstance(value, Metric):
                self._weighted.setdefault(key, []).append(tokens * value)
            else:
                append_to_dict(self._passed, {key: value})

    def parts(
        self,
        reduce: Callable[[Tensor], Tensor],
        dp_size: int,
        raw: dict[str, Callable[[Tensor], Tensor]],
        extras: dict[str, Tensor],
    ) -> dict[str, Tensor]:
        """What to read, as float64 device tensors: the micro-batches' losses, for verl's worker (which sums them
        and averages over DP), and each metric of the mini-batch on every DP rank, with `extras` (device scalars)
        beside them. `read_once` reads them (with more, in training), `collected` makes verl's numbers of that."""
        return self._device_parts(reduce, dp_size, raw) | {k: v.double().reshape(1) for k, v in extras.items()}

    def collected(self, read: dict[str, list[float]]) -> tuple[list[float], dict[str, Any]]:
        """The losses and the metrics as verl's worker collects them, from what `read_once` read of `parts`."""
        metrics = dict(self._passed)
        read = dict(read)
        losses = read.pop(LOSSES, [])
        for key, values in read.items():
            summed = self._summed.get(key)
            metrics[key] = values if summed is None else Metric(summed, values[0])
        return losses, metrics

    def _device_parts(
        self, reduce: Callable[[Tensor], Tensor], dp_size: int, raw: dict[str, Callable[[Tensor], Tensor]]
    ) -> dict[str, Tensor]:
        """float64 device tensors: the losses, and each metric over all DP ranks after one collective (`reduce`, the
        sum over DP): a summed Metric the mean over ranks of each rank's sum (what verl's worker makes of it), a token
        mean the global one (through `raw[key]` where given)."""
        if not self._tokens:
            return {}
        weighted, summed = list(self._weighted), list(self._sums)
        local = torch.stack(
            [torch.stack(self._tokens).sum(), *(torch.stack(self._weighted[k]).sum() for k in weighted)]
        )
        sums = to_device(torch.tensor([self._sums[k] for k in summed], dtype=torch.float64), self.device)
        total = reduce(torch.cat([local, sums]))
        means = total[1 : 1 + len(weighted)] / total[0].clamp(min=1.0)
        parts = {LOSSES: torch.stack(self._losses).double()}
        parts |= {key: raw.get(key, _unchanged)(means[i : i + 1]) for i, key in enumerate(weighted)}
        first = 1 + len(weighted)
        return parts | {key: total[first + i : first + i + 1] / dp_size for i, key in enumerate(summed)}


def _unchanged(x: Tensor) -> Tensor:
    return x


def read_once(parts: dict[str, Tensor]) -> dict[str, list[float]]:
    """1-D float64 device `parts` read to the host in one read (none when there are none), one list per part."""
    if not parts:
        return {}
    values, out, start = torch.cat(list(parts.values())).tolist(), {}, 0
    for key, part in parts.items():
        out[key], start = values[start : start + len(part)], start + len(part)
    return out


def dense_inputs(data: TensorDict) -> Batch:
    """Right-padded `input_ids`, `attention_mask` and `position_ids` of verl's nested (padding-free) mini-batch, with
    its per-sample `multi_modal_inputs` when it has them, where verl's data is (the host), its lengths read once."""
    ids = data["input_ids"]
    lengths = ids.offsets().diff().tolist()
    lengths_on_device = to_device(torch.tensor(lengths, device="cpu"), ids.device)
    mask = torch.arange(max(lengths, default=0), device=ids.device) < lengths_on_device[:, None]
    count = sum(lengths)
    tensors = {
        "attention_mask": mask.long(),
        "input_ids": padded(ids.values(), mask, count),
        "position_ids": dense_positions(data["position_ids"].values(), mask, count),
    }
    samples = data.get(MULTI_MODAL, None)
    non_tensors = {} if samples is None else {MULTI_MODAL: multi_modal_samples(samples)}
    return Batch(tensors, non_tensors, seq_lens=lengths)


def padded(values: Tensor, mask: Tensor, count: int) -> Tensor:
    """Packed per-token `values` [nnz, ...] at the `count` valid positions of `mask` [B, T] (row-major: the packing
    order), zeros elsewhere: [B, T, ...]."""
    dense = values.new_zeros(mask.numel(), *values.shape[1:])
    dense[valid_positions(mask.flatten(), count)] = values
    return dense.view(*mask.shape, *values.shape[1:])


def dense_positions(values: Tensor, mask: Tensor, count: int) -> Tensor:
    """Position ids [B, T] from verl's packed ones [nnz]; mrope ids [B, 3, T] from its [k, nnz] (Qwen2-VL's three
    rows; verl 0.9 puts the text positions first, as a fourth row, which the critic's packing does not need)."""
    if values.dim() == 1:
        return padded(values, mask, count)
    return padded(values[-3:].T, mask, count).transpose(1, 2).contiguous()


def multi_modal_samples(samples: Any) -> np.ndarray:
    """verl's per-sample `multi_modal_inputs` (a non-tensor stack of dicts, None for a text-only sample) as the
    object array ppo-critic's batch carries."""
    items = samples.tolist() if hasattr(samples, "tolist") else list(samples)
    return np.array([getattr(item, "data", item) or {} for item in items], dtype=object)


def values_in_order(results: list[MicroResult], batch: Batch) -> Tensor:
    """The per-token values of the real micro-batches, back in the mini-batch's row order, as one nested tensor."""
    real = [m for m in results if m.rows]
    dense = restore_order([m.values for m in real], [m.rows for m in real])
    return as_jagged(dense, batch)


def as_jagged(values: Tensor, batch: Batch) -> Tensor:
    """Per-token values [b, T] at the valid positions of a right-padded micro-batch `batch`, as verl's nested layout:
    sized by the lengths the batch carries, so nothing is read back."""
    lengths = batch.lengths()
    offsets = to_device(torch.tensor([0, *itertools.accumulate(lengths)], device="cpu"), values.device)
    flat_values = values.flatten(0, 1)[valid_positions(batch["attention_mask"].bool().flatten(), sum(lengths))]
    return torch.nested.nested_tensor_from_jagged(flat_values, offsets)


def dense_rows(tensor: Tensor) -> Tensor:
    """A nested (jagged) tensor of rows as a right-padded dense one; a dense tensor as it is."""
    return tensor.to_padded_tensor(0.0) if tensor.is_nested else tensor


def jagged_like(dense: Tensor, like: Tensor) -> Tensor:
    """Right-padded rows `dense` in the layout of `like`: nested with its row lengths when it is, else dense."""
    if not like.is_nested:
        return dense.to(like.dtype)
    lengths = like.offsets().diff().tolist()
    rows = torch.cat([row[:n] for row, n in zip(dense, lengths, strict=True)])
    return torch.nested.nested_tensor_from_jagged(rows.to(like.dtype), like.offsets())


def flat(tensor: Tensor) -> Tensor:
    """The elements of a nested (jagged) tensor in row-major order; a dense tensor as it is."""
    return tensor.values() if tensor.is_nested else tensor


def map_flat(tensor: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """`fn` applied elementwise to a dense or nested (jagged) tensor, keeping its layout."""
    if not tensor.is_nested:
        return fn(tensor)
    return torch.nested.nested_tensor_from_jagged(fn(tensor.values()), tensor.offsets())
