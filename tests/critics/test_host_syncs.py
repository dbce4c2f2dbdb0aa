"""Host syncs of `DataParallelPPOCritic`, counted on the CPU (issue 39 item 7).

On CUDA, reading device data on the host waits for every kernel queued before it, so the Python loop stops feeding
the GPU. A CPU run shows no such wait; `HostSyncs` counts what causes one on CUDA when its operand lives there:
- aten ops, through a `TorchDispatchMode`: `_local_scalar_dense` (`.item()`, `int()`, `float()`, `bool()`, `if t:`),
  ops whose output size is read from the data (`nonzero`, `masked_select`, indexing with a bool mask,
  `repeat_interleave` of a repeats tensor without `output_size`, `unique*`, `bincount`), `equal` (a Python bool),
  copies across devices;
- Python calls that copy device data to the host without an aten op on the CPU: `.tolist()`, `.numpy()`, `.cpu()`;
  and blocking host-to-device copies, which CUDA runs as a copy then a stream sync: `.to(device)` without
  `non_blocking=True`, `torch.tensor` / `torch.as_tensor` of Python data with a `device` off the host. These are
  counted where the library (src/ppo_critic) calls them: torch's own `.to(device)` of tensors already there would be
  false alarms.
Limits: on the CPU every tensor is a host tensor, so a read of a tensor that stays on the host on CUDA (the shuffled
epoch's row order, an EMA's step counter, the FLOPs of host lengths) counts too: the counts are upper bounds. Syncs
inside kernels, libraries or the allocator that surface as none of these ops are not seen (a CUDA run's
`torch.cuda.set_sync_debug_mode` would see them). The packed attention of the CPU (and of float32 on CUDA),
`bucketed_sdpa`, is counted: it plans from the host copy of `cu_seqlens` that packing keeps; only its planning from
those host ints (`Buckets.build`, host tensors only) is not. Syncs inside transformers are counted and named
`via transformers`.

Measured here (tiny Qwen2, 8 rows, one epoch): before this change a mini-batch of k fixed micro-batches cost 10 + 8k
(each `Batch.index` copied its index tensor per key from pageable memory, `pack` read `nonzero` and the longest row,
the step read the loss and the norm separately, the micro-batch count was read even in one process) and
`compute_values` 6 per micro-batch; now a mini-batch costs 1 (the decision to step) whatever its micro-batches, fixed
or dynamic, packed or padded, `compute_values` none per micro-batch, plus a constant per call (checks of the input,
the lengths read where the batch arrives, one read of the metrics). Under DP (not run here) a mini-batch reads one
more: its micro-batch count, agreed over the ranks. transformers' sdpa mask adds 2 per padded micro-batch
(`masking_utils._ignore_causal_mask_sdpa` reads the padding mask): packed rows, the default where the model can run
them, avoid it.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import conftest  # its helpers are read on use: the verl suite, which imports the counter, has a conftest of its own
from ppo_critic import DataParallelPPOCritic, build_value_model
from ppo_critic.critics.ema import ParameterEMA
from ppo_critic.data.batch import Batch
from ppo_critic.data.packing import pack
from ppo_critic.models import attention

aten = torch.ops.aten
READS = {aten._local_scalar_dense, aten.equal, aten.nonzero, aten.masked_select, aten.bincount}
READS |= {aten._unique, aten._unique2, aten.unique_consecutive, aten.unique_dim}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
COPIES = {aten._to_copy, aten.copy_}
SRC = str(Path(__file__).resolve().parents[2] / "src")
THIRD_PARTY = ("transformers", "verl")  # libraries whose syncs are named beside the library frame that called them


class HostSyncs(TorchDispatchMode):
    """Counts the operations that sync the host with a CUDA device (module docstring), by where they are called."""

    def __init__(self):
        super().__init__()
        self.where: collections.Counter[str] = collections.Counter()
        self.paused = 0

    @property
    def total(self) -> int:
        return sum(self.where.values())

    @property
    def ours(self) -> int:
        """The syncs of the library's own code (those inside transformers or verl left out)."""
        return sum(n for site, n in self.where.items() if " via " not in site)

    def record(self, what: str, depth: int = 1) -> None:
        """Count one sync at the innermost library frame (the test's own if none), with its function, naming the
        innermost frame of transformers or verl on the way: `tolist at batch.py:12 in lengths via transformers
        modeling_utils.py:123`."""
        if self.paused:
            return
        frame, via = sys._getframe(depth), ""
        while frame.f_back is not None and not frame.f_code.co_filename.startswith(SRC):
            library = next((name for name in THIRD_PARTY if f"/{name}/" in frame.f_code.co_filename), None)
            if not via and library:
                via = f" via {library} {Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
            frame = frame.f_back
        code = frame.f_code
        self.where[f"{what} at {Path(code.co_filename).name}:{frame.f_lineno} in {code.co_name}{via}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if syncs(func, args, kwargs):
            self.record(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def syncs(func, args: tuple, kwargs: dict) -> bool:
    """Whether an aten op reads device data on the host (module docstring)."""
    packet = func.overloadpacket
    if packet in READS:
        return True
    if func is aten.repeat_interleave.Tensor:  # repeats given as a tensor: the output size is their sum
        return kwargs.get("output_size") is None
    if packet in INDEXING:
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if packet in COPIES:
        source = args[1] if packet is aten.copy_ else args[0]
        target = args[0].device if packet is aten.copy_ else kwargs.get("device") or source.device
        return source.device != torch.device(target)
    return False


@contextlib.contextmanager
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostSyncs]:
    """A `HostSyncs` over the block, with the Python-level reads and blocking copies counted too."""
    counter = HostSyncs()
    with monkeypatch.context() as patch:
        for name in ("tolist", "numpy", "cpu"):
            patch.setattr(torch.Tensor, name, _counted(counter, getattr(torch.Tensor, name), name))
        patch.setattr(torch.Tensor, "to", _blocking_to(counter, torch.Tensor.to))
        for name in ("tensor", "as_tensor"):
            patch.setattr(torch, name, _host_data(counter, getattr(torch, name), name))
        patch.setattr(attention.Buckets, "build", staticmethod(_uncounted(counter, attention.Buckets.build)))
        with counter:
            yield counter


def _from_library() -> bool:
    """Whether the caller of the patched call (two frames up) is library code."""
    return sys._getframe(2).f_code.co_filename.startswith(SRC)


def _counted(counter: HostSyncs, method: Callable, name: str) -> Callable:
    def call(self, *args, **kwargs):
        if _from_library():
            counter.record(name, depth=2)
        return method(self, *args, **kwargs)

    return call


def _blocking_to(counter: HostSyncs, method: Callable) -> Callable:
    def to(self, *args, **kwargs):
        device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and not non_blocking and _from_library():
            counter.record("to(device)", depth=2)
        return method(self, *args, **kwargs)

    return to


def _host_data(counter: HostSyncs, factory: Callable, name: str) -> Callable:
    def make(data, *args, **kwargs):
        device = kwargs.get("device")
        off_host = device is not None and torch.device(device).type != "cpu"
        if off_host and not isinstance(data, torch.Tensor) and _from_library():
            counter.record(f"{name}(device=)", depth=2)
        return factory(data, *args, **kwargs)

    return make


def _uncounted(counter: HostSyncs, fn: Callable) -> Callable:
    def call(*args, **kwargs):
        with counter.pause():
            return fn(*args, **kwargs)

    return call


def tiny_critic(**cfg) -> DataParallelPPOCritic:
    """A tiny float32 Qwen2 critic (hidden 64, 2 layers, no dropout) with SGD and clipping."""
    torch.manual_seed(0)
    model = build_value_model(conftest.tiny_config("qwen2", classifier_dropout=0.0, use_cache=False))
    config = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 8, "grad_clip": 1.0, **cfg}
    return DataParallelPPOCritic(config, model, torch.optim.SGD(model.parameters(), lr=0.1))


def syncs_of(monkeypatch, call: str, **cfg) -> HostSyncs:
    """The syncs of one `update_critic` or `compute_values` of 8 rows (6 prompt + 5 response tokens at most)."""
    critic = tiny_critic(**cfg)
    batch = conftest.make_batch(8, 6, 5)
    with counting(monkeypatch) as counter:
        getattr(critic, call)(batch)
    return counter


PADDING = {"padded": {"use_remove_padding": False}, "packed": {"use_remove_padding": True}}
# (mini-batches, micro-batches in each): fixed sizes, or dynamic token budgets (rows hold 2-11 tokens)
FIXED = {
    (1, 1): {"ppo_micro_batch_size_per_gpu": 8},
    (1, 4): {"ppo_micro_batch_size_per_gpu": 2},
    (4, 1): {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2},
}
DYNAMIC = {
    (1, 1): {"ppo_max_token_len_per_gpu": 88},
    (1, "several"): {"ppo_max_token_len_per_gpu": 11},
    (4, 1): {"ppo_mini_batch_size": 2, "ppo_max_token_len_per_gpu": 22},
}


def per_layout(monkeypatch, layouts: dict, call: str = "update_critic", **cfg) -> dict:
    """The syncs of each (mini-batches, micro-batches) shape of `layouts`."""
    return {shape: syncs_of(monkeypatch, call, **cfg, **layout) for shape, layout in layouts.items()}


def assert_one_per_mini_batch(counts: dict, several: object, ours: bool = False) -> None:
    """None per micro-batch, at most one per mini-batch (beyond the call's constant)."""
    n = {shape: (c.ours if ours else c.total) for shape, c in counts.items()}
    detail = {shape: dict(c.where) for shape, c in counts.items()}
    assert n[(1, several)] == n[(1, 1)], detail
    assert n[(4, 1)] - n[(1, 1)] <= 3, detail


@pytest.mark.parametrize("padding", PADDING)
def test_update_critic_syncs_at_most_once_per_mini_batch(monkeypatch, one_thread, padding):
    """Fixed micro-batches, packed or padded: the only sync per mini-batch is the decision to step; the padded path's
    transformers mask adds its own per micro-batch, which the packed rows avoid."""
    counts = per_layout(monkeypatch, FIXED, model={**PADDING[padding]})
    assert_one_per_mini_batch(counts, 4, ours=padding == "padded")
    if padding == "packed":
        assert all(c.total == c.ours for c in counts.values())
    else:  # transformers' reads of the padding mask, per micro-batch
        assert counts[(1, 4)].total - counts[(1, 4)].ours == 4 * (counts[(1, 1)].total - counts[(1, 1)].ours) > 0


def test_dynamic_batching_syncs_at_most_once_per_mini_batch(monkeypatch, one_thread):
    """Dynamic micro-batches are cut from the host lengths read once per call: nothing more per mini-batch."""
    counts = per_layout(monkeypatch, DYNAMIC, use_dynamic_bsz=True)
    assert_one_per_mini_batch(counts, "several")


@pytest.mark.parametrize("dynamic", [False, True])
def test_compute_values_syncs_no_more_with_more_micro_batches(monkeypatch, one_thread, dynamic):
    """`compute_values`: a constant per call (its checks, the lengths, the values back to the host)."""
    sizes = [{"forward_max_token_len_per_gpu": n} for n in (88, 11)] if dynamic else None
    sizes = sizes or [{"forward_micro_batch_size_per_gpu": n} for n in (8, 1)]
    counts = [syncs_of(monkeypatch, "compute_values", use_dynamic_bsz=dynamic, **s) for s in sizes]
    assert counts[0].total == counts[1].total, [dict(c.where) for c in counts]


def test_the_counter_sees_what_syncs_on_cuda(monkeypatch):
    """The bound above is not vacuous: each kind of sync counts once, host-sized work none."""
    x, mask = torch.arange(6.0), torch.tensor([True, False] * 3)
    with counting(monkeypatch) as counter:
        float(x.sum()), x.nonzero(), x[mask], x.repeat_interleave(torch.tensor([1, 2] * 3)), x.unique()
        x.repeat_interleave(torch.tensor([1, 2] * 3), output_size=9), x[torch.tensor([0, 2])], x.argsort()
        pack(x.long().view(2, 3), torch.ones(2, 3, dtype=torch.long), x.long().view(2, 3))  # reads the lengths
        Batch({"input_ids": torch.zeros(4, 2), "attention_mask": torch.ones(4, 2)}).lengths()
    assert counter.total == 7, dict(counter.where)


@pytest.mark.parametrize("ema", [False, True], ids=["plain", "moving-average"])
def test_the_step_reads_once_and_its_halves_read_nothing(monkeypatch, one_thread, ema):
    """`optimizer_step` reads one thing, the decision to step; its halves read nothing: `clip_gradients` (the
    loss's finiteness a device bool) and `step_or_skip` (the decision a host bool), so an engine can read the norm
    with its metrics, once (verl ≥ 0.9's `train_batch`)."""
    counts = {}
    for halves in (False, True):
        critic = tiny_critic(ema_decay=0.5 if ema else 0.0)
        batch = Batch.from_any(conftest.make_batch(8, 6, 5))
        critic.forward_backward(batch, [list(range(8))], lambda micro, rows, values: values.square().mean())
        finite = torch.ones((), dtype=torch.bool)
        with counting(monkeypatch) as counter, monkeypatch.context() as patch:
            # the average's update counter is a host tensor (module docstring): its read waits for nothing on CUDA
            patch.setattr(ParameterEMA, "current_decay", _uncounted(counter, ParameterEMA.current_decay))
            if halves:
                norm = critic.clip_gradients(finite)
                with counter.pause():  # the caller's read, with its metrics
                    step = bool(torch.isfinite(norm))
                critic.step_or_skip(step)
            else:
                critic.optimizer_step(finite)
        counts[halves] = counter
    assert (counts[False].total, counts[True].total) == (1, 0), {k: dict(c.where) for k, c in counts.items()}
    assert all(" in optimizer_step" in site for site in counts[False].where)
