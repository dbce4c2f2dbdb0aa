"""`DataParallelPPOCritic`: verl's critic API on a plain (or later DDP/FSDP-wrapped) module.

`update_critic` reads like the PPO paper: epochs → mini-batches → micro-batches → one optimizer step per
mini-batch. How a micro-batch is run (padded, or packed and optionally Ulysses-sharded) lives in `token_values`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ppo_critic.backends.data_parallel.fsdp import average_plain_gradients, clip_grad_norm
from ppo_critic.config.critic import CriticConfig, RankSizes
from ppo_critic.config.modes import EXPORTED_OBJECTIVE
from ppo_critic.config.ranks import check_ranks_agree
from ppo_critic.critics.base import Perf, PPOCriticBase, UpdateMetrics
from ppo_critic.critics.ema import ParameterEMA
from ppo_critic.critics.objectives import check_saved
from ppo_critic.critics.perf import ModelShape, PhaseTimer
from ppo_critic.critics.value_norm import ValueNormalizer
from ppo_critic.data.batch import MULTI_MODAL, Batch
from ppo_critic.data.batching import restore_order
from ppo_critic.data.packing import pack
from ppo_critic.models.attention import packed_blocker, use_packed_attention
from ppo_critic.models.hf import find_value_head, token_values, unwrap
from ppo_critic.parallel.layout import ParallelLayout, layout_of
from ppo_critic.parallel.master_weights import float32_weights, masters_of
from ppo_critic.parallel.mesh import compute_dtype
from ppo_critic.parallel.ulysses import check_heads_of, gather_sequence, sequence_parallel

log = logging.getLogger(__name__)

# (micro-batch, its rows in the batch ([] for a stand-in that keeps the ranks in step), per-token values [b, T] with
# their graph) -> the loss to backpropagate, over the mini-batch's global denominators
MicroLoss = Callable[[Batch, list[int], Tensor], Tensor]


@dataclass
class MicroResult:
    """What one micro-batch of `forward_backward` gave: its rows, its per-token values [b, T] and its loss."""

    rows: list[int]
    values: Tensor
    loss: Tensor | None


def _untimed(_phase: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def nan_unless(ok: bool | Tensor, norm: Tensor) -> Tensor:
    """`norm`, or NaN where `ok` (a bool, or a device bool read later with the norm) is false: a step skipped for
    its loss is counted like one with a bad gradient."""
    nan = torch.full_like(norm, float("nan"))
    if isinstance(ok, Tensor):
        return torch.where(ok, norm, nan)
    return norm if ok else nan


class DataParallelPPOCritic(PPOCriticBase):
    """PPO value-model trainer: `compute_values(batch)` and `update_critic(batch)` (DESIGN §2–3)."""

    _optimizer_checked = False  # `_check_trainable` ran (at the first update)

    def __init__(self, config: Any, critic_module: nn.Module, critic_optimizer: torch.optim.Optimizer):
        """verl's constructor: `config` in any form (checked here) with this rank's sizes, as verl's workers hand it
        over; the layout from torch.distributed's default group."""
        config = CriticConfig.from_any(config)
        layout = layout_of(config).per_rank()
        self._build(config, layout.rank_sizes(config), layout, critic_module, critic_optimizer)

    @classmethod
    def of(
        cls,
        config: CriticConfig,
        sizes: RankSizes,
        layout: ParallelLayout,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> DataParallelPPOCritic:
        """For a caller that checked `config` and built the layout and its sizes (`CriticWorker`): nothing
        re-derived."""
        critic = cls.__new__(cls)
        critic._build(config, sizes, layout, module, optimizer)
        return critic

    def _build(
        self,
        config: CriticConfig,
        sizes: RankSizes,
        layout: ParallelLayout,
        critic_module: nn.Module,
        critic_optimizer: Any,
    ) -> None:
        if layout.sp != config.ulysses_sequence_parallel_size:
            raise ValueError(
                f"ulysses_sequence_parallel_size={config.ulysses_sequence_parallel_size} but the layout has "
                f"sp={layout.sp}; build the layout with ppo_critic.parallel.layout.layout_of(config)"
            )
        self.config, self.sizes, self.layout = config, sizes, layout
        check_ranks_agree(
            {"critic": config.to_dict(), "model": model_signature(critic_module)},
            "the critic's ranks hold different settings",
            "build every rank's critic from the same config and model",
        )
        self.critic_module = critic_module
        self.critic_optimizer = critic_optimizer
        self.device = next(critic_module.parameters()).device
        self.compute_dtype = compute_dtype(self.config.torch_dtype_name, self.device)
        self.use_remove_padding = self._packs()
        if self.sp_size > 1:
            check_heads_of(critic_module, self.sp_size)
        self.value_norm = ValueNormalizer.of(self.config, self.device)
        self.ema = None
        if self.config.ema_decay:
            from torch.distributed.fsdp import FullyShardedDataParallel

            if isinstance(critic_module, FullyShardedDataParallel):  # flat shards DCP cannot tell apart
                raise ValueError("critic.ema_decay > 0 is not supported with FSDP1; use FSDP2 (fully_shard) or DDP")
            masters = masters_of(critic_optimizer)  # critic.param_dtype: the average follows the float32 masters
            self.ema = ParameterEMA(critic_module, self.config.ema_decay, self.config.ema_warmup, masters)
        self._use_objective()
        self._check_head()
        check_takes_tokens(critic_module)  # after the config's checks: they name the option to fix first
        inner = unwrap(critic_module)  # DDP / FSDP1 / peft
        hf_config = getattr(inner, "config", None)
        shape = ModelShape.from_hf(hf_config) if hf_config is not None else None
        self.perf = Perf(shape, self.layout.data_ranks, self.device, self.compute_dtype)
        if hasattr(inner, "get_input_embeddings"):
            self.vocab_size = inner.get_input_embeddings().num_embeddings
        if self.use_remove_padding:  # last: a rejected config leaves the model as it was
            use_packed_attention(critic_module, self.config.model.attn_implementation)

    def _check_head(self) -> None:
        """The value head gives the objective's outputs per token and, under PopArt, has a bias (a model that names
        no head is taken as it is, but PopArt needs one). An objective whose values are not the head's output is
        named in the model's HF config (`ppo_critic_vf_loss_type`, any objective), so an HF save says how to read its
        head."""
        popart = self.value_norm.mode == "popart"
        try:
            head = getattr(*find_value_head(self.critic_module))
        except ValueError:
            if popart:
                raise
            return
        if head.out_features != self.objective.outputs:
            raise ValueError(
                f"vf_loss_type={self.config.vf_loss_type} needs a value head of {self.objective.outputs} outputs per "
                f"token; the model's has {head.out_features} (build_value_model(..., head_outputs=...))"
            )
        if popart and head.bias is None:
            raise ValueError("value_norm=popart needs a value head with a bias (the mean shift goes there)")
        hf_config = getattr(unwrap(self.critic_module), "config", None)
        if hf_config is not None:  # an HF save holds the head as it is: say how to read it (a saved one says already)
            check_saved(getattr(hf_config, EXPORTED_OBJECTIVE, None), self.config, "the model")
            setattr(hf_config, EXPORTED_OBJECTIVE, self.config.vf_loss_type)

    def _check_trainable(self) -> None:
        """The optimizer steps this model (checked at the first update: a critic that only computes values may hold
        any optimizer)."""
        if not self._optimizer_checked:
            check_optimizer_of(self.critic_module, self.critic_optimizer)
            self._optimizer_checked = True

    def _packs(self) -> bool:
        """`model.use_remove_padding` resolved: auto packs unless the model cannot run packed rows (attention that
        cannot be switched, eager, sliding windows, CUDA without a varlen kernel); always under Ulysses, which needs
        them."""
        setting = self.config.model.use_remove_padding
        if setting is False and self.sp_size == 1:
            return False
        name = self.config.model.attn_implementation
        blocker = packed_blocker(self.critic_module, name, self.device)
        if setting == "auto" and self.sp_size == 1:
            if blocker:
                log.debug("model.use_remove_padding=auto: padded batches, since %s", blocker)
            return blocker is None
        if blocker:
            if self.sp_size > 1:
                raise ValueError(
                    f"ulysses_sequence_parallel_size={self.sp_size} needs packed rows, which this model cannot run: "
                    f"{blocker}; fix that, or set ulysses_sequence_parallel_size=1"
                )
            raise ValueError(
                f"model.use_remove_padding: cannot run packed rows (it is set to true): {blocker}; fix that, or set "
                "model.use_remove_padding=auto (packs where it can)"
            )
        return True

    def _values(self, batch: Batch, groups: list[list[int]]) -> Tensor:
        outputs = [self._forward_micro_batch(batch.index(g or [0])) for g in groups]  # [] keeps ranks in step
        kept = [(o, g) for o, g in zip(outputs, groups, strict=True) if g]
        return restore_order([o for o, _ in kept], [g for _, g in kept])

    def set_training(self, mode: bool) -> None:
        self.critic_module.train(mode)

    @contextlib.contextmanager
    def _value_head(self) -> Iterator[nn.Linear]:
        """The value head, editable in place however the model is sharded: FSDP1's full parameters are summoned and
        written back; FSDP2's root is resharded first (it keeps its parameters unsharded after a forward, and an
        edit of those would be lost at the next reshard), then its sharded parameters are edited shard-wise."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        parent, name = find_value_head(self.critic_module)
        if isinstance(self.critic_module, FullyShardedDataParallel):
            with FullyShardedDataParallel.summon_full_params(self.critic_module, writeback=True):
                yield getattr(parent, name)
            return
        self._reshard()
        head = getattr(parent, name)
        with float32_weights(self.critic_optimizer, head):  # critic.param_dtype: edit the masters, then round
            yield head

    def _reshard(self) -> None:
        """FSDP2 keeps the root's parameters unsharded after a forward: reshard, so the sharded ones are in use (and
        neither an EMA swap nor a PopArt edit is hidden behind the unsharded copy)."""
        if hasattr(self.critic_module, "reshard"):  # FSDP2's FSDPModule
            self.critic_module.reshard()

    def learning_rate(self) -> float:
        return self.critic_optimizer.param_groups[0]["lr"]

    def _train_mini_batch(self, mini_batch: Batch, metrics: UpdateMetrics, max_token_len: int) -> None:
        """Accumulate the gradient of one mini-batch over its micro-batches, clip, and step (or skip)."""
        cfg = self.config
        with metrics.timer("collective"):
            norm = self._loss_denominators(mini_batch)
        # gradients are averaged over all dp × sp ranks; each sp rank holds part of the same loss
        norm |= {"dp_size": self.layout.data_ranks, "loss_scale_factor": cfg.loss_scale_factor}

        def value_loss(micro: Batch, rows: list[int], token_values: Tensor) -> Tensor:
            vpreds = token_values[:, -micro.response_length - 1 : -1]
            return self._micro_batch_loss(micro, bool(rows), vpreds, norm, metrics)

        self.critic_optimizer.zero_grad(set_to_none=True)
        groups = self.micro_batches(mini_batch, cfg.use_dynamic_bsz, self.sizes.micro_batch, max_token_len)
        results = self.forward_backward(mini_batch, groups, value_loss, timer=metrics.timer)
        step_loss = sum((m.loss for m in results), torch.zeros((), device=self.device))
        grad_norm = self.optimizer_step(self._loss_finite_everywhere(step_loss), metrics.timer)
        metrics.add_step(step_loss / self.layout.data_ranks, grad_norm)

    def forward_backward(
        self,
        batch: Batch,
        groups: list[list[int]],
        loss_fn: MicroLoss | None,
        backward: bool = True,
        timer: PhaseTimer | None = None,
    ) -> list[MicroResult]:
        """Each micro-batch (a row group of `batch`) forward, `loss_fn(micro, rows, token_values)`, and unless not
        `backward` the backward of that loss. An empty group runs row 0 (its loss must carry zero weight), so every
        rank runs as many micro-batches and collectives. Gradients accumulate; the caller zeroes and steps."""
        timed = timer or _untimed
        if self.use_remove_padding:
            batch = batch.with_lengths()  # packed rows are sized on the host: one read for all micro-batches
        results = []
        for rows in groups:
            micro = batch.index(rows or [0])
            with timed("forward"):
                token_values = self.token_values(micro)
                loss = None if loss_fn is None else loss_fn(micro, rows, token_values)
            if loss is not None and backward:
                with timed("backward"), self.sequence_parallel():  # + DDP's / FSDP's gradient reduction
                    loss.backward()
            results.append(MicroResult(rows, token_values.detach(), None if loss is None else loss.detach()))
        return results

    def optimizer_step(self, loss_is_finite: bool | Tensor, timer: PhaseTimer | None = None) -> Tensor:
        """One optimizer step from the accumulated gradients: average them (strategy none under DP), clip, step and
        update the moving average, or skip when the norm or the loss (`loss_is_finite`, agreed over ranks, a bool
        or a device bool; e.g. saturated clipping: finite gradient, infinite loss) is not finite. Returns the
        pre-clip norm (NaN when skipped for the loss); the gradients are zeroed either way. One host sync: the
        decision to step. `clip_gradients` then `step_or_skip`, for a caller that reads the decision with more."""
        grad_norm = self.clip_gradients(loss_is_finite, timer)
        with (timer or _untimed)("optimizer"):
            self.step_or_skip(bool(torch.isfinite(grad_norm)))
        return grad_norm

    def clip_gradients(self, loss_is_finite: bool | Tensor, timer: PhaseTimer | None = None) -> Tensor:
        """The first half of `optimizer_step`, without a host read: average the accumulated gradients (strategy none
        under DP) and clip them. Returns the pre-clip norm, NaN when `loss_is_finite` (a bool, or a device bool
        agreed over ranks) is false: the step is to be taken exactly when the result is finite (`step_or_skip`)."""
        timed = timer or _untimed
        with timed("collective"):
            average_plain_gradients(self.critic_module, self.layout.data_ranks)
        with timed("optimizer"):
            norm = clip_grad_norm(self.critic_module, self.config.grad_clip, self.critic_optimizer)  # param_dtype: fp32
            return nan_unless(loss_is_finite, norm)

    def step_or_skip(self, step: bool) -> None:
        """The second half of `optimizer_step`, given the decision on the host (the norm `clip_gradients` returned is
        finite): step and update the moving average, or skip; the gradients are zeroed either way."""
        if step:
            self.critic_optimizer.step()
            if self.ema is not None:
                self.ema.update()
        self.critic_optimizer.zero_grad(set_to_none=True)

    def _forward_micro_batch(self, micro: Batch) -> Tensor:
        """Head outputs [b, R(, outputs)] in float32 at the position before each response token (the objective
        makes them values)."""
        r = micro.response_length
        return self.token_values(micro)[:, -r - 1 : -1]

    def token_values(self, micro: Batch) -> Tensor:
        """The head's outputs [b, T(, outputs)] (float32; `objective.values` makes them values) at every position of
        a micro-batch of input_ids / attention_mask / position_ids; padding positions are meaningless. Packed or
        padded, with Ulysses, as configured."""
        with self._autocast():
            values = self._packed_token_values(micro) if self.use_remove_padding else self._token_values(micro)
        return values.float()

    def _token_values(self, micro: Batch) -> Tensor:
        """Per-token values [b, T] of the padded micro-batch."""
        position_ids = micro["position_ids"]
        if position_ids.dim() == 3:  # [B, 3, T] mrope → the [3, B, T] that Qwen2-VL expects
            position_ids = position_ids.transpose(0, 1)
        output = self.critic_module(
            input_ids=micro["input_ids"],
            attention_mask=micro["attention_mask"],
            position_ids=position_ids,
            use_cache=False,
            **self._multi_modal_kwargs(micro),
        )
        return token_values(self.critic_module, output)

    def _packed_token_values(self, micro: Batch) -> Tensor:
        """Per-token values [b, T] computed on one packed row of the valid tokens (zeros at padding).

        With Ulysses (sp > 1) each rank of the sp group runs its slice of the row and the values are gathered.
        """
        packed = pack(micro["input_ids"], micro["attention_mask"], micro["position_ids"], micro.lengths())
        multi_modal = self._multi_modal_kwargs(micro)
        if self.sp_size == 1:
            output = self.critic_module(**packed.model_kwargs(), use_cache=False, **multi_modal)
            return packed.unpack(token_values(self.critic_module, output))
        if multi_modal:
            raise ValueError("multi_modal_inputs with ulysses_sequence_parallel_size > 1 are not supported; use sp=1")
        sp_rank = self.layout.sp_rank
        with self.sequence_parallel():
            output = self.critic_module(**packed.model_kwargs(self.sp_size, sp_rank), use_cache=False)
            values = gather_sequence(token_values(self.critic_module, output), self.layout.sp_group)
        return packed.unpack(values[:, : packed.input_ids.shape[1]])

    def sequence_parallel(self) -> contextlib.AbstractContextManager:
        """The Ulysses group for the packed attention, around the forward and around the backward too: gradient
        checkpointing recomputes the forward of each layer during the backward, all-to-alls included."""
        return sequence_parallel(self.layout.sp_group) if self.sp_size > 1 else contextlib.nullcontext()

    def _multi_modal_kwargs(self, micro: Batch) -> dict[str, Tensor]:
        """Per-sample `multi_modal_inputs` (e.g. pixel_values, image_grid_thw) concatenated in row order."""
        samples = micro.non_tensors.get(MULTI_MODAL)
        if samples is None:
            return {}
        keys = dict.fromkeys(k for sample in samples for k in sample)
        return {
            k: torch.cat([torch.as_tensor(s[k]) for s in samples if k in s]).to(self.device, non_blocking=True)
            for k in keys
        }

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)


def check_optimizer_of(module: nn.Module, optimizer: Any) -> None:
    """The optimizer steps the module's parameters (or their float32 masters): one built over another model (or
    before the model was wrapped into new parameters) would train nothing while every metric looks normal."""
    if optimizer is None or not hasattr(optimizer, "param_groups"):
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    stepped |= {id(p) for p in masters_of(optimizer)}
    if not stepped & {id(p) for p in module.parameters()}:
        raise ValueError(
            "critic_optimizer holds none of critic_module's parameters (built over another model, or before the "
            "model was wrapped?); build it from critic_module.parameters() after wrapping"
        )


def model_signature(module: nn.Module) -> dict[str, Any]:
    """What must match across data-parallel ranks of one model, whatever wraps it (FSDP shards differ per rank): a
    digest of its transformers config (its architecture and sizes); nothing for a module without one."""
    import hashlib
    import json

    config = getattr(unwrap(module), "config", None)
    if not hasattr(config, "to_dict"):
        return {}
    return {
        "config": hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]
    }


def check_takes_tokens(module: nn.Module) -> None:
    """The critic's module reads token ids (a transformers model, a `build_value_model` critic, or a TRL-style
    `v_head` module): anything else (an `nn.Linear`) is refused here rather than failing inside its forward."""
    import inspect

    inner = unwrap(module)
    parameters = inspect.signature(inner.forward).parameters
    takes = "input_ids" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    if not takes:
        raise TypeError(
            f"critic_module is a {type(inner).__name__}, whose forward takes no input_ids; give a value model "
            "(ppo_critic.build_value_model), a transformers model with a value head, or a module with a TRL v_head"
        )
