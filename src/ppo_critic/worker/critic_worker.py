"""`CriticWorker`: what a PPO trainer needs around a critic — the value model built from the config, the
optimizer, the LR schedule, checkpoints and HF export — on a data-parallel or a Megatron backend, chosen by
`strategy` (`backends.data_parallel.backend`, `backends.megatron.backend`).

The worker takes *global* batch sizes (verl's trainer convention) and hands the critic per-rank sizes. Under verl's
`param_offload` / `optimizer_offload` what they name rests in host memory between calls (`parallel/offload.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ppo_critic.backends.build import lr_schedule, worker_config
from ppo_critic.backends.data_parallel.backend import DataParallelBackend
from ppo_critic.backends.megatron.backend import MegatronBackend
from ppo_critic.config.modes import EXPORTED_OBJECTIVE
from ppo_critic.data.batch import Batch
from ppo_critic.parallel.collectives import all_gather_rows
from ppo_critic.parallel.layout import ParallelLayout
from ppo_critic.parallel.offload import PhaseOffload
from ppo_critic.run.checkpoint import CheckpointDamaged, checkpoint_step


class CriticWorker:
    """Owns the backend (model, optimizer, critic, checkpoint layout) and the schedule; one `update_critic` call =
    one schedule step."""

    def __init__(
        self,
        config: Any,
        *,
        total_steps: int | None = None,
        device: str = "auto",
        seed: int = 0,
        dist_timeout_s: float = 600.0,
        layout: ParallelLayout | None = None,
    ):
        self.config = worker_config(config)
        optim = self.config.optim
        factor = lr_schedule(optim, optim.total_training_steps if optim.total_training_steps > 0 else total_steps)
        backend = MegatronBackend if self.config.strategy == "megatron" else DataParallelBackend
        self.backend = backend(self.config, device, seed, dist_timeout_s, layout)
        self.model, self.optimizer, self.critic = self.backend.model, self.backend.optimizer, self.backend.critic
        self.device, self.layout, self.hf_config = self.backend.device, self.backend.layout, self.backend.hf_config
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.backend.scheduled, factor)
        self.step = 0
        self.offload, self.phases = self.backend.offload, PhaseOffload.of(self.config.model.fsdp_config, self.device)
        self.offload.to_host(model=self.phases.params, optimizer=self.phases.optimizer)  # at rest until a call

    @property
    def dp_group(self) -> Any:
        """The data-parallel process group (`layout.dp_group`)."""
        return self.layout.dp_group

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks global batches are sharded over (`layout.dp`)."""
        return self.layout.dp

    def compute_values(self, batch: Any) -> Tensor:
        """Values of the whole (global) batch, in input order, on every rank; each rank computes a 1/DP share."""
        with self.offload.resident(model=True):
            if self.dp_size == 1:
                return self.critic.compute_values(batch)
            batch = Batch.from_any(batch)
            local = self.critic.compute_values(batch.index(self._shard(len(batch), len(batch))))
        counts = [len(rows) for rows in torch.arange(len(batch)).tensor_split(self.dp_size)]
        return all_gather_rows(local, counts, self.dp_group)

    def compute_live_values(self, batch: Any) -> Tensor | None:
        """Under `ema_decay`, `compute_values` on the live weights instead of their average; None without one."""
        if self.critic.ema is None:
            return None
        with self.critic.live_weights():
            return self.compute_values(batch)

    def update_critic(self, batch: Any, lr_scale: float = 1.0) -> dict[str, float]:
        """One critic update on the global batch; `critic/lr` is the rate it used (the schedule's, times `lr_scale`
        for this update alone), then the schedule advances and sets the next rate.
        The metrics include `perf/compute_values_*` of the latest `compute_values` (e.g. of this batch's values).

        Under DP each rank trains on its share of every global mini-batch, so a mini-batch holds the same rows
        as in a single process (without `shuffle`) and the update is the same.
        """
        if self.dp_size > 1:
            batch = Batch.from_any(batch)
            batch = batch.index(self._shard(len(batch), self.config.ppo_mini_batch_size * self.config.rollout_n))
        with self._scaled_rates(lr_scale), self.offload.resident(model=True, optimizer=True):
            metrics = self.critic.update_critic(batch)
        self.scheduler.step()
        self.step += 1
        return metrics | (self.critic.last_compute_metrics or {})  # + the perf of the latest compute_values

    @contextlib.contextmanager
    def _scaled_rates(self, scale: float) -> Iterator[None]:
        """Every param group's rate times `scale` inside the context, the scheduled rates again after it (also when
        the update fails)."""
        groups = self.backend.scheduled.param_groups
        rates = [group["lr"] for group in groups]
        for group, rate in zip(groups, rates, strict=True):
            group["lr"] = rate * scale
        try:
            yield
        finally:
            for group, rate in zip(groups, rates, strict=True):
                group["lr"] = rate

    def restart_average(self) -> bool:
        """Under `ema_decay`, start the moving average over from the live weights; False without one."""
        if self.critic.ema is None:
            return False
        self.critic.ema.restart()
        return True

    def save_checkpoint(
        self,
        root: str | Path,
        tensors: dict[str, Tensor] | None = None,
        state: dict[str, Any] | None = None,
        keep_last_n: int | None = None,
    ) -> Path:
        """Model, optimizer, schedule, torch RNG, step, value-normalisation statistics and the moving average,
        plus the caller's `tensors` and JSON `state`."""
        tensors = {"rng/torch": torch.get_rng_state(), **self._value_norm_state(), **(tensors or {})}
        state = {"worker_step": self.step, "scheduler": self.scheduler.state_dict(), **(state or {})}
        with self.offload.resident(model=True, optimizer=True):
            return self.backend.save(root, self.step, tensors, state, keep_last_n)

    def load_checkpoint(
        self,
        path: str | Path,
        tensors: dict[str, Tensor] | None = None,
        check_state: Callable[[dict[str, Any]], None] | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Restore what `save_checkpoint` wrote; `tensors` are templates (shape/dtype) for the caller's tensors.
        Nothing changes unless the checkpoint verifies and its JSON state holds what the worker and the caller's
        `check_state` need."""
        norm = self._value_norm_state()
        templates = {"rng/torch": torch.get_rng_state(), **norm, **(tensors or {})}
        with self.offload.resident(model=True, optimizer=True):
            loaded, state = self.backend.load(path, templates, _checks(path, check_state))
        self.scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr  # the rate of the saved step (megatron's param groups are not in its checkpoint)
        self.step = int(state["worker_step"])
        torch.set_rng_state(loaded.pop("rng/torch"))
        if norm:
            self.critic.value_norm.load_state_dict({k: loaded.pop(k) for k in norm})
        return loaded, state

    def set_learning_rate(self, lr: float) -> None:
        """A new base rate (an option changed on resume): the schedule goes on from its current step at this rate."""
        scheduler = self.scheduler
        scheduler.base_lrs = [lr * group.get("lr_ratio", 1.0) for group in self.optimizer.param_groups]
        for group, factor, base in zip(
            self.optimizer.param_groups, scheduler.lr_lambdas, scheduler.base_lrs, strict=True
        ):
            group["initial_lr"] = base
            group["lr"] = base * factor(scheduler.last_epoch)

    def export_hf(self, out_dir: str | Path, replace: bool | Callable[[Path], object] = False) -> Path:
        """The critic as an HF checkpoint that predicts raw values: a LoRA critic is exported merged (adapters folded
        into the base weights, so it loads without peft), and under `value_norm` the return statistics are folded
        into the value head (`w·σ`, `b·σ + μ`); under `ema_decay` the weights are the moving average. Either way the
        export gives the values `compute_values` gives. `out_dir` must not exist or be empty, unless `replace`: True
        for an export this worker's run wrote before, a callable told where a user's was moved aside
        (`checkpoint.export_hf`); either way the old one makes way only once the new one is whole."""
        self.check_exportable()
        setattr(self.hf_config, EXPORTED_OBJECTIVE, self.config.vf_loss_type)  # how its outputs become values
        with self.offload.resident(model=True), self.critic.averaged_weights():  # ema_decay: the values' average
            return self.backend.export_hf(out_dir, replace)

    def check_exportable(self) -> None:
        """Refuse, before anything is written (a trainer: before it trains), an export whose fold of `value_norm`'s
        statistics into the head would be wrong: the fold rescales the head's one output, which must be the value."""
        cfg = self.config
        if self.critic.value_norm.enabled and not self.critic.objective.identity:
            raise ValueError(
                f"vf_loss_type={cfg.vf_loss_type}: an HF export folds value_norm={cfg.value_norm}'s statistics into "
                "the value head, which needs a head whose one output is the value; set value_norm=off (or "
                "trainer.export_hf=false)"
            )

    def _value_norm_state(self) -> dict[str, Tensor]:
        """The return statistics of `critic.value_norm` (CPU copies; nothing when it is off)."""
        norm = self.critic.value_norm
        return {k: v.detach().cpu().clone() for k, v in norm.state_dict().items()} if norm.enabled else {}

    def _shard(self, batch_size: int, block: int) -> Tensor:
        """This rank's rows: inside every block of `block` rows, the rank's contiguous 1/DP slice. A last, shorter
        block (verl's short last mini-batch) is split as evenly as it goes: its slices differ by at most one row."""
        if batch_size < self.dp_size:
            raise ValueError(
                f"a batch of {batch_size} rows cannot be split over {self.dp_size} data-parallel ranks; send at "
                f"least {self.dp_size} rows"
            )
        blocks = torch.arange(batch_size).split(block)
        return torch.cat([rows.tensor_split(self.dp_size)[self.layout.dp_rank] for rows in blocks])


def _checks(path: str | Path, caller: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None]:
    """What a worker needs of a checkpoint's JSON state (its step and LR schedule), then the caller's checks."""

    def check(state: dict[str, Any]) -> None:
        step, schedule = state.get("worker_step"), state.get("scheduler")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0 or not isinstance(schedule, dict):
            raise ValueError(
                f"checkpoint {path} is damaged: its trainer_state.json lacks a valid worker_step or scheduler"
            )
        named = checkpoint_step(path)
        if named is not None and named != step:  # a checkpoint copied over another: which step is it?
            raise CheckpointDamaged(
                f"checkpoint {path} holds step {step} but its name says step {named} (copied over another?); "
                f"rename it step_{step:08d} or remove it"
            )
        if caller is not None:
            caller(state)

    return check
