"""`MegatronPPOCritic`: the same critic (DESIGN §3) on megatron-core model chunks — TP, PP, VPP and DP.

Micro-batches run through megatron's `get_forward_backward_func` (any pipeline schedule). The loss is normalised
by the critic itself: each rank backpropagates its numerator over the global denominator — the data-parallel
critic's gradient, exactly. With `calculate_per_token_loss=True` (ppo-critic's own transformer config) megatron
neither divides by the micro-batch count nor averages over DP; with a config built without it (verl's megatron
worker builds one) megatron does both, and the critic multiplies them back. Values come from the last pipeline
stage and are broadcast over the pipeline group.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppo_critic.config.critic import CriticConfig, RankSizes
from ppo_critic.critics.base import Perf, PPOCriticBase, UpdateMetrics
from ppo_critic.critics.ema import ParameterEMA
from ppo_critic.critics.perf import ModelShape
from ppo_critic.critics.value_norm import ValueNormalizer
from ppo_critic.data.batch import MULTI_MODAL, Batch
from ppo_critic.data.batching import restore_order
from ppo_critic.data.packing import CompactBatch, compact
from ppo_critic.models.hf import unwrap
from ppo_critic.parallel.collectives import broadcast_
from ppo_critic.parallel.layout import ParallelLayout

# (micro-batch, whether it holds real rows, its values [b, R]) -> the loss to backpropagate
MicroBatchFn = Callable[[Batch, bool, Tensor], Tensor]


class MegatronPPOCritic(PPOCriticBase):
    """PPO value-model trainer over megatron model chunks, with verl's constructor and DESIGN §2's calls.

    `critic_module`: this rank's model chunks (a list, or an `nn.ModuleList`, one per virtual pipeline stage),
    wrapped in megatron DDP; `critic_optimizer`: a megatron optimizer over them (e.g. the distributed
    optimizer). `model_config`, `hf_config` and `critic_optimizer_config` are accepted for verl compatibility.
    """

    # verl's megatron critic empties the CUDA cache after every compute_values / update_critic, so that a rollout
    # colocated in another process gets the memory back; this one does too unless this is False. The next call in
    # the process then pays fresh cudaMallocs: `ppo-critic bench` turns it off for its measured calls.
    release_cache: bool = True

    def __init__(
        self,
        config: Any,
        model_config: Any = None,
        hf_config: Any = None,
        tf_config: Any = None,
        critic_module: nn.Module | list[nn.Module] | None = None,
        critic_optimizer: Any = None,
        critic_optimizer_config: Any = None,
    ):

        config = CriticConfig.from_any(config)
        self._build(config, None, critic_module, critic_optimizer, tf_config)

    @classmethod
    def of(
        cls,
        config: CriticConfig,
        sizes: RankSizes,
        module: list[nn.Module],
        optimizer: Any,
        layout: ParallelLayout | None = None,
    ) -> MegatronPPOCritic:
        """For a caller that checked `config` and derived the layout and sizes (`CriticWorker`): nothing
        re-derived."""
        critic = cls.__new__(cls)
        critic._build(config, sizes, module, optimizer, None, layout)
        return critic

    def _build(
        self,
        config: CriticConfig,
        sizes: RankSizes | None,
        critic_module: Any,
        critic_optimizer: Any,
        tf_config: Any,
        layout: ParallelLayout | None = None,
    ) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.utils import get_model_config

        from ppo_critic.backends.megatron import parallel as mp

        self.config = config
        if critic_module is None or critic_optimizer is None:
            raise TypeError(
                "MegatronPPOCritic needs critic_module (this rank's model chunks) and critic_optimizer; "
                "ppo_critic.worker.CriticWorker builds both from a config with strategy=megatron"
            )
        if self.config.ulysses_sequence_parallel_size != 1:
            raise ValueError("ulysses_sequence_parallel_size must be 1 for MegatronPPOCritic; use megatron TP")
        self._use_objective()
        if self.objective.outputs != 1:
            raise ValueError(
                f"vf_loss_type={self.config.vf_loss_type}: strategy=megatron builds a value head of one output per "
                f"token, this objective needs {self.objective.outputs}; use a data-parallel strategy"
            )
        chunks = list(critic_module) if isinstance(critic_module, list | tuple | nn.ModuleList) else [critic_module]
        self.critic_module = chunks
        self.critic_optimizer = critic_optimizer
        self.tf_config = tf_config or get_model_config(chunks[0])
        self.tf_config.finalize_model_grads_func = _finalize_model_grads
        self.tf_config.grad_scale_func = critic_optimizer.scale_loss
        self.device = next(chunks[0].parameters()).device
        self.layout = layout or mp.layout()  # megatron's groups, wrapped
        self.sizes = sizes or self.layout.per_rank().rank_sizes(config)  # verl's workers hand this rank's sizes
        self.pp_group, self.pp_size = ps.get_pipeline_model_parallel_group(), self.layout.pp
        self.last_stage_rank = ps.get_pipeline_model_parallel_last_rank()
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        # The interleaved (VPP) schedule needs a multiple of PP micro-batches, and one tensor shape for all of
        # them: its exchange of per-micro-batch shapes deadlocks, so micro-batches are padded to a common shape.
        self.interleaved = len(chunks) > 1
        self.micro_batch_multiple = self.pp_size if self.interleaved else 1
        self.tf_config.variable_seq_lengths = not self.interleaved
        self.vocab_size = getattr(unwrap(chunks[0]), "vocab_size", None)
        shape, world = ModelShape.from_megatron(self.tf_config), torch.distributed.get_world_size()
        self.perf = Perf(shape, world, self.device, self.tf_config.params_dtype)
        self.value_norm = ValueNormalizer.of(self.config, self.device)
        # averaged per rank over its TP/PP slice: the model parameters, not the optimizer's main copies (which
        # rewrite the model parameters at its next step anyway, so swapping the average in and out is safe)
        decay = self.config.ema_decay
        self.ema = ParameterEMA(nn.ModuleList(chunks), decay, self.config.ema_warmup) if decay else None

    @contextlib.contextmanager
    def _value_head(self) -> Iterator[nn.Linear | None]:
        """The fp32 value head on the last pipeline stage (None on the others): PopArt edits it in place, which the
        optimizer keeps, since megatron's optimizers step fp32 parameters in place (the distributed one through
        views of them); it is replicated over TP and DP, and every rank applies the same edit."""
        yield unwrap(self.critic_module[-1]).output_layer if self.is_last_stage else None

    def make_minibatch_iterator(self, data: Any) -> list[Any]:
        """verl's megatron worker asks for this and hands it to `update_critic(dataloader=...)`: the whole batch, which
        `update_critic` cuts into mini-batches itself (epochs, `shuffle`, global normalisation)."""
        return [data]

    def update_critic(self, data: Any = None, *, dataloader: Any = None) -> dict[str, float]:
        """`update_critic(batch)`, or as verl's megatron worker calls it:
        `update_critic(dataloader=make_minibatch_iterator(batch))`."""
        if dataloader is not None:
            batches = list(dataloader) if data is None else []
            if len(batches) != 1:
                raise TypeError(
                    "update_critic takes a batch, or dataloader=critic.make_minibatch_iterator(batch) (one whole "
                    "batch, cut into mini-batches by the critic)"
                )
            data = batches[0]
        return super().update_critic(data)

    def _check_batch(self, batch: Batch) -> None:
        positions = batch["position_ids"]
        if positions.dim() != 2 or MULTI_MODAL in batch.non_tensors:
            raise ValueError(
                "MegatronPPOCritic runs text-only models: position_ids must be [B, T] and multi_modal_inputs "
                "absent; use DataParallelPPOCritic for multimodal (mrope) critics"
            )
        # megatron's rotary embedding numbers the tokens of each (compacted) row 0, 1, 2, ...: Batch.validate
        # has checked that position_ids do the same

    def _values(self, batch: Batch, groups: list[list[int]]) -> Tensor:
        outputs = self._run(batch, groups, forward_only=True, fn=lambda micro, keep, values: values.sum() * 0)
        values = torch.empty(len(batch), batch.response_length, device=self.device)
        if self.is_last_stage:
            kept = [(o["values"], g) for o, g in zip(outputs, groups, strict=True) if g]
            values = restore_order([o for o, _ in kept], [g for _, g in kept])
        if self.pp_size > 1:
            broadcast_(values, self.last_stage_rank, group=self.pp_group)
        self._release_cache()
        return values

    def _train_mini_batch(self, mini_batch: Batch, metrics: UpdateMetrics, max_token_len: int) -> None:
        """Accumulate one mini-batch over its micro-batches through the pipeline schedule, clip, step or skip."""
        cfg = self.config
        # megatron sums gradients over DP (calculate_per_token_loss), so each rank's share is numerator / global
        with metrics.timer("collective"):
            norm = self._loss_denominators(mini_batch) | {"dp_size": 1, "loss_scale_factor": cfg.loss_scale_factor}
        for chunk in self.critic_module:
            chunk.zero_grad_buffer()
        self.critic_optimizer.zero_grad()
        groups = self.micro_batches(mini_batch, cfg.use_dynamic_bsz, self.sizes.micro_batch, max_token_len)

        def loss_fn(micro: Batch, keep: bool, vpreds: Tensor) -> Tensor:
            return self._micro_batch_loss(micro, keep, vpreds, norm, metrics)

        with metrics.timer("forward_backward"):  # the pipeline schedule, with its p2p and DP gradient reduction
            outputs = self._run(mini_batch, groups, forward_only=False, fn=loss_fn)
        step_loss = torch.stack([o["loss"] for o in outputs]).sum() if outputs else torch.zeros((), device=self.device)
        with metrics.timer("optimizer"):
            grad_norm = self._clip_and_step(self._loss_is_finite(step_loss))
        metrics.add_step(step_loss, grad_norm)

    def _loss_is_finite(self, step_loss: Tensor) -> bool:
        """As for every critic, but the loss exists on the last pipeline stage only."""
        step_loss = step_loss.detach().double().reshape(1)
        if self.pp_size > 1:
            broadcast_(step_loss, self.last_stage_rank, group=self.pp_group)
        return super()._loss_is_finite(step_loss)

    def _clip_and_step(self, loss_is_finite: bool) -> Tensor:
        """Global gradient norm (over DP, TP and PP); the step is taken only when it and the loss are finite
        (a non-finite loss reports a NaN norm, so the skip is counted)."""
        optimizer = self.critic_optimizer
        found_inf = optimizer.prepare_grads()  # main (fp32) grads from the DDP buffers; fp16 overflow check
        clip = self.config.grad_clip
        norm = optimizer.clip_grad_norm(clip) if clip else optimizer.get_grad_norm()
        norm = float("inf") if found_inf else float(norm) if loss_is_finite else float("nan")
        if math.isfinite(norm):  # a Python float already (megatron reduces the norm): no device round trip
            optimizer.step_with_ready_grads()
            if self.ema is not None:
                self.ema.update()
        optimizer.zero_grad()
        return torch.tensor(norm, dtype=torch.float64, device=self.device)

    def _run(
        self, batch: Batch, groups: list[list[int]], forward_only: bool, fn: MicroBatchFn
    ) -> list[dict[str, Tensor]]:
        """Every micro-batch through the pipeline schedule; on the last stage, `fn`'s loss is backpropagated and
        each micro-batch's `values` [b, R] and `loss` are returned (in `groups` order). Other stages return []."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micros = [(batch.index(g or [0]), bool(g)) for g in groups]  # an empty group runs with zero weight
        r = batch.response_length
        # without calculate_per_token_loss megatron divides each loss by the micro-batch count and its DDP averages
        # the gradients over DP: multiply both back (the loss is already over the global denominator)
        undo = 1 if self.tf_config.calculate_per_token_loss else len(micros) * self.dp_size

        rows = max(len(m) for m, _ in micros)
        lengths = batch["attention_mask"].sum(-1).tolist()  # one device sync for all micro-batches
        longest = max(lengths[i] for g in groups for i in g or [0])

        def loss_func(micro: Batch, keep: bool, c: CompactBatch, output: Tensor):
            output = output[: len(micro), : c.input_ids.shape[1]]  # drop the padding to the common shape
            values = c.expand(output.squeeze(-1))[:, -r - 1 : -1].float()
            loss = fn(micro, keep, values)
            ones = torch.ones((), dtype=torch.int, device=self.device)
            return loss * undo, ones, {"values": values.detach(), "loss": loss}

        def forward_step(data_iterator, model):
            micro, keep = next(data_iterator)
            c = compact(micro["input_ids"], micro["attention_mask"], micro["position_ids"])
            ids, positions = c.input_ids, c.position_ids
            if self.interleaved:  # trailing padding: under causal attention it changes no earlier output
                ids, positions = (F.pad(x, (0, longest - x.shape[1], 0, rows - x.shape[0])) for x in (ids, positions))
            output = model(input_ids=ids, position_ids=positions, attention_mask=None)
            return output, functools.partial(loss_func, micro, keep, c)

        stored = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(micros) for _ in self.critic_module],
            model=self.critic_module,
            num_microbatches=len(micros),
            seq_length=longest,
            micro_batch_size=rows,
            forward_only=forward_only,
        )
        return stored if self.is_last_stage else []

    def _metrics(self, metrics: UpdateMetrics, batch: Batch, elapsed_s: float) -> dict[str, float]:
        """Loss statistics exist on the last pipeline stage; every stage returns its metrics."""
        result = [super()._metrics(metrics, batch, elapsed_s)]
        if self.pp_size > 1:
            torch.distributed.broadcast_object_list(result, self.last_stage_rank, group=self.pp_group)
        self._release_cache()
        return result[0]

    def set_training(self, mode: bool) -> None:
        for chunk in self.critic_module:
            chunk.train(mode)

    def learning_rate(self) -> float:
        return self.critic_optimizer.param_groups[0]["lr"]

    def _release_cache(self) -> None:
        """Empty the CUDA caching allocator after a call, as verl's critic does (a no-op where CUDA never started)."""
        if self.release_cache:
            torch.cuda.empty_cache()


def _finalize_model_grads(model: list[nn.Module], num_tokens: Tensor | None = None, **kwargs: Any) -> None:
    """Megatron's gradient finalisation (DP reduction, shared-weight sync) without its 1/num_tokens scaling:
    the critic's loss is already divided by the global denominator."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)
