"""`critic.param_dtype`: parameters stored in bf16 on the device, float32 master copies stepped by the optimizer.

For strategies `none` and `ddp` (FSDP2 does the same by itself: float32 shards gathered in the compute dtype). The
forward and backward then read bf16 weights (embeddings, residual stream, norms in bf16 as under FSDP2), and
gradients are bf16. `MasterWeightOptimizer` wraps the torch optimizer: each step moves the gradients into float32
copies, where the norm is taken and clipping done (`backends/data_parallel/fsdp.py: clip_grad_norm`), steps
the float32 masters (an AdamW update far below bf16's resolution still accumulates) and rounds them back into the
parameters. So a parameter always equals its master rounded, and the masters are the weights: checkpoints and the HF
export hold them (`float32_weights`), the moving average follows them (`critics/ema.py`) and PopArt rescales them
(`backends/data_parallel/critic.py`).

Parameters that are float32 anyway (a value head of `value_head_dtype=float32`) have no copy: they are stepped as
they are. Buffers (RoPE's frequencies) keep their dtype.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch import Tensor, nn

# an optimizer built over the groups given (the master copies in place of the parameters)
Build = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


@torch.no_grad()
def store_in(model: nn.Module, dtype: torch.dtype, keep: Collection[nn.Parameter] = ()) -> dict[Tensor, Tensor]:
    """Store `model`'s floating-point parameters in `dtype` (those in `keep` as they are); returns the float32
    master copy of each trainable one that is not float32 then. A float32 parameter's own storage becomes its
    master, so the masters start at the float32 weights exactly. Call it before DDP wraps the model (its buckets
    take the parameters' dtype)."""
    kept = {id(p) for p in keep}
    masters = {}
    for param in model.parameters():
        if not param.is_floating_point():
            continue
        source = param.data
        if id(param) not in kept:
            param.data = source.to(dtype)
        if param.requires_grad and param.dtype != torch.float32:
            masters[param] = source.float()
    return masters


class MasterWeightOptimizer(torch.optim.Optimizer):
    """A torch optimizer over low-precision parameters that steps their float32 `masters` instead.

    Its parameter groups hold the model's parameters (LR schedules set their rates here; checkpoints name the state
    by them), its state is the inner optimizer's, and each step syncs the rates into the inner optimizer (`build`
    over the masters), steps it and rounds the masters back into the parameters."""

    def __init__(self, groups: list[dict[str, Any]], masters: dict[Tensor, Tensor], build: Build):
        self.masters = masters
        self.inner = build([{**group, "params": self._stepped(group["params"])} for group in groups])
        super().__init__(groups, self.inner.defaults)
        self._masters_in_place = False

    def _stepped(self, params: list[Tensor]) -> list[Tensor]:
        """What the inner optimizer steps for `params`: each one's master, or the parameter itself."""
        return [self.masters.get(p, p) for p in params]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Gradients into the masters, one inner step with this optimizer's rates and state, masters into the
        parameters (a closure would recompute low-precision gradients after the move: refused)."""
        if closure is not None:
            raise TypeError("MasterWeightOptimizer.step takes no closure")
        self.stepped_parameters()
        for group, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update({key: value for key, value in group.items() if key != "params"})
        self.inner.state = defaultdict(dict, {self.masters.get(p, p): s for p, s in self.state.items()})
        self.inner.step()
        self.state.update({p: self.inner.state[t] for p, t in self._pairs() if t in self.inner.state})
        self._round_into_parameters()

    def stepped_parameters(self) -> list[Tensor]:
        """The float32 tensors a step updates, with the gradients moved into them (float32) from the parameters:
        the norm and the clipping of `clip_grad_norm` are computed on these."""
        for param, master in self.masters.items():
            if param.grad is not None:
                grad = param.grad.float()
                master.grad = grad if master.grad is None else master.grad.add_(grad)
                param.grad = None
        return [t for group in self.inner.param_groups for t in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, with the masters in the parameters' place: the state is cast to their dtype, float32."""
        with self.float32_weights():
            super().load_state_dict(state_dict)

    @contextlib.contextmanager
    def float32_weights(self, module: nn.Module | None = None) -> Iterator[None]:
        """Inside, each parameter (of `module`, or all) with a master holds it as its data: float32, the very tensor
        the optimizer steps, so a checkpoint saves and loads the masters, an export writes them and an in-place edit
        (PopArt) changes them; on exit the parameters hold their own data again, re-rounded from the masters."""
        if self._masters_in_place:  # nested: the outer context restores
            yield
            return
        wanted = None if module is None else {id(p) for p in module.parameters()}
        pairs = [(p, m) for p, m in self.masters.items() if wanted is None or id(p) in wanted]
        held = [p.data for p, _ in pairs]
        for param, master in pairs:
            param.data = master
        self._masters_in_place = True
        try:
            yield
        finally:
            self._masters_in_place = False
            for (param, master), data in zip(pairs, held, strict=True):
                param.data = data.copy_(master)

    def _pairs(self) -> list[tuple[Tensor, Tensor]]:
        """(parameter, what the inner optimizer steps for it) for every parameter of the groups."""
        return [(p, self.masters.get(p, p)) for group in self.param_groups for p in group["params"]]

    def _round_into_parameters(self) -> None:
        """Each parameter set to its master rounded to the parameter's dtype (nothing to do while they are one)."""
        if self.masters and not self._masters_in_place:
            torch._foreach_copy_(list(self.masters), list(self.masters.values()))


def masters_of(optimizer: torch.optim.Optimizer | None) -> dict[Tensor, Tensor]:
    """The float32 master copy of each low-precision parameter `optimizer` steps; none for a plain optimizer."""
    return optimizer.masters if isinstance(optimizer, MasterWeightOptimizer) else {}


def float32_weights(
    optimizer: torch.optim.Optimizer | None, module: nn.Module | None = None
) -> contextlib.AbstractContextManager:
    """`MasterWeightOptimizer.float32_weights` of `optimizer`, or nothing to do for a plain optimizer."""
    if isinstance(optimizer, MasterWeightOptimizer):
        return optimizer.float32_weights(module)
    return contextlib.nullcontext()
