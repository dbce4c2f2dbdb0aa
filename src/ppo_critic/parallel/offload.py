"""verl's offload: a critic's parameters (with their gradients and moving average) and its optimizer state moved
between the compute device and host memory, so that the GPU holds them only while the critic computes.

`PhaseOffload` is what the config asks for (`param_offload`, `optimizer_offload`); `Offloader` moves. Every object
that others refer to stays the same object across a round trip, so the optimizer, DDP's gradient hooks and FSDP2's
shards keep referring to the right tensors:

- a parameter of a plain or DDP module keeps its device and dtype and swaps its data for an empty tensor while its
  values (and gradient) wait in host memory. A device change would give it a new gradient accumulator, and DDP's
  hooks on the old one would stop firing: its gradients would silently no longer be averaged;
- an FSDP2 module moves with `module.to`, which FSDP2 supports (it re-registers its shards);
- optimizer state and the moving average: the entries of their containers are replaced by copies.

FSDP2's `CPUOffloadPolicy` (`offload_policy`: parameters and the optimizer step always on the CPU) is another thing,
applied when the model is wrapped (`backends/data_parallel/fsdp.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

HOST = torch.device("cpu")
PARTS = ("model", "optimizer")  # verl's names for what `to` moves


def frees_device_memory(device: torch.device) -> bool:
    """Whether moving state off `device` frees memory anywhere: not when `device` is the host (a CPU run)."""
    return device.type != HOST.type


@dataclass(frozen=True)
class PhaseOffload:
    """What rests in host memory between calls: parameters and gradients (`params`), optimizer state (`optimizer`)."""

    params: bool = False
    optimizer: bool = False

    @classmethod
    def of(cls, fsdp_config: Mapping, device: torch.device) -> PhaseOffload:
        """verl's `param_offload` / `optimizer_offload`, in effect where they free something: not on a CPU compute
        device, nor under FSDP2's `offload_policy` (the state lives on the CPU already; verl reads it so too)."""
        if not frees_device_memory(device) or fsdp_config.get("offload_policy"):
            return cls()
        return cls(bool(fsdp_config.get("param_offload")), bool(fsdp_config.get("optimizer_offload")))


class Offloader:
    """Moves `model`'s parameters and gradients, with `companions` (lists of tensors that live beside the parameters:
    the moving average), and `optimizer`'s state between `device` and host memory, each part on request."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        companions: Sequence[list[Tensor]] = (),
    ):
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        self.model, self.optimizer, self.device = model, optimizer, device
        self.companions = list(companions)
        self.fsdp1, self.fsdp2 = isinstance(model, FullyShardedDataParallel), isinstance(model, FSDPModule)
        self.on_host = dict.fromkeys(PARTS, False)
        self._parked: dict[nn.Parameter, tuple[Tensor, Tensor | None]] = {}
        self._moved: list[tuple[dict, str]] = []  # the optimizer state entries moved to the host

    def to_host(self, model: bool = True, optimizer: bool = True) -> None:
        """The named parts into host memory (a part there already stays), then the device's freed memory released."""
        if self._place(True, model, optimizer) and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # host copies complete before anything reads them
            torch.cuda.empty_cache()  # for whatever else shares the GPU (verl's colocated rollout)

    def to_device(self, model: bool = True, optimizer: bool = True) -> None:
        """The named parts back on the compute device (a part there already stays)."""
        self._place(False, model, optimizer)

    @contextlib.contextmanager
    def resident(self, model: bool = True, optimizer: bool = False) -> Iterator[None]:
        """The named parts on the compute device inside; those that were in host memory go back there after."""
        parked = {part: wanted and self.on_host[part] for part, wanted in zip(PARTS, (model, optimizer), strict=True)}
        self.to_device(**parked)
        try:
            yield
        finally:
            self.to_host(**parked)

    def _place(self, host: bool, model: bool, optimizer: bool) -> bool:
        """Move each named part not yet where `host` says; whether any moved."""
        wanted = dict(zip(PARTS, (model, optimizer), strict=True))
        moving = [part for part in PARTS if wanted[part] and self.on_host[part] != host]
        for part in moving:
            if part == "model":
                self._move_params(host)
            else:
                self._move_state(host)
            self.on_host[part] = host
        return bool(moving)

    def _move_params(self, host: bool) -> None:
        """Parameters, gradients and companions to the host or back to the compute device."""
        if self.fsdp1:  # flat parameters: moving them means reaching into FSDP1's internals
            raise ValueError(
                "moving the parameters of an FSDP1 model (strategy=fsdp) is not supported; use strategy fsdp2, ddp or "
                "none for param_offload"
            )
        target = HOST if host else self.device
        if self.fsdp2:
            # sharded parameters and gradients, the same objects; to the host synchronously: FSDP2 re-pads an uneven
            # shard from the moved tensor at once, which must not read a host copy still in flight
            self.model.to(target, non_blocking=not host)
        elif host:
            self._park()
        else:
            self._unpark()
        for tensors in self.companions:
            tensors[:] = [_copy(t, target) for t in tensors]

    def _park(self) -> None:
        """Each parameter's values and gradient into host memory; the parameter keeps its device and dtype with no
        elements, so its gradient accumulator, and DDP's hooks on it, stay as they are."""
        for param in self.model.parameters():
            grad = None if param.grad is None else _copy(param.grad, HOST)
            self._parked[param] = (_copy(param.data, HOST), grad)
            param.grad = None
            param.data = param.data.new_empty(0)

    def _unpark(self) -> None:
        """Each parameter's values and gradient back on the compute device, into the same parameter object."""
        for param, (data, grad) in self._parked.items():
            param.data = data.to(self.device, non_blocking=True)
            param.grad = None if grad is None else grad.to(self.device, non_blocking=True)
        self._parked.clear()

    def _move_state(self, host: bool) -> None:
        """Optimizer state on the compute device to the host, or what was moved back. Entries the optimizer keeps on
        the CPU anyway (AdamW's `step` unless fused) are left alone, so they come back where they were."""
        if host:
            self._moved = [(s, key) for s in self._states() for key, v in s.items() if _on(v, self.device)]
        for state, key in self._moved:
            state[key] = _copy(state[key], HOST if host else self.device)
        if not host:
            self._moved = []

    def _states(self) -> Iterable[dict]:
        """The optimizer's per-parameter state dicts (none without an optimizer)."""
        return () if self.optimizer is None else self.optimizer.state.values()


def _on(value: object, device: torch.device) -> bool:
    """Whether `value` is a tensor on a device of `device`'s kind (a process computes on one GPU)."""
    return isinstance(value, Tensor) and value.device.type == device.type


def _copy(tensor: Tensor, device: torch.device) -> Tensor:
    """A copy of `tensor` on `device` (a new tensor even on the same device: the original may be freed); from a GPU
    into pinned host memory, so that the way back is asynchronous too."""
    return tensor.detach().to(device, non_blocking=True, copy=True)
