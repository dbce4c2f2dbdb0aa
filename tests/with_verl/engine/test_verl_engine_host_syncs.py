"""Host syncs of the engine's entry points (`train_batch`, `forward_backward_batch`, ...) under verl's own
`TrainingWorker`, counted on the CPU with tests/critics/test_host_syncs.py's counter (its docstring says what counts
and why the counts are upper bounds).

verl's worker hands the engine one mini-batch at a time, on the host. The engine reads its lengths once where it
arrives and sizes every micro-batch from them (DESIGN §3 "Host syncs"), selects each micro-batch of verl's data on
the host and moves it to the device without blocking: none of its own reads is per micro-batch. Per training
mini-batch (one `train_batch`) it reads, in one process, three times from the host data verl handed over (no wait on
CUDA) and once from the device, at the step: `OURS_TRAIN`, each read named by its site. verl's own reads inside its
value loss (and its metric type) run per micro-batch, and its row selection reads the index it is handed per row (a
host tensor): each is named in `VERL_READS`, so a read of ours cannot hide among them.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator

import pytest
from engine_helpers import SGD, infer_values, train, training_worker
from verl.workers.engine.base import BaseEngine

from ppo_critic.integrations.verl_engine import PPOCriticEngine
from test_host_syncs import HostSyncs, counting
from verl_shared import rollout

ENTRY_POINTS = ("train_batch", "forward_backward_batch", "optimizer_zero_grad", "optimizer_step", "lr_scheduler_step")
# verl 0.9.1's reads inside what the engine calls of it, by site
VERL_READS = {
    "tensordict_utils.py:496": "index_select_tensor_dict: each row's index, read from the host index tensor",
    "losses.py:201": "value_loss: vf_clipfrac.item()",
    "losses.py:202": "value_loss: masked_mean(vpreds).item()",
    "padding.py:129": "no_padding_2_padding: response_lens.max().item()",
    "padding.py:130": "no_padding_2_padding: assert sequence_offsets[-1].item() == ...",
    "padding.py:138": "no_padding_2_padding: each row's response slice, sized from device lengths",
    "utils.py:110": "Metric(value=vf_loss): value.item()",
}
HOST, DEVICE = "host data", "waits on the device"
# the engine's own reads per training mini-batch (one `train_batch` of verl's engine API), in one process, by site
# (what reads, in which function of ppo-critic); each is read once. verl hands the mini-batch on the host: the first
# three read host data, which costs no wait on CUDA; the last is the one read that waits for the device's work
OURS_TRAIN = {
    "tolist in dense_inputs": (HOST, "the lengths, from the offsets of verl's nested input_ids"),
    "_local_scalar_dense in check_token_ids": (HOST, "the token-id check, before any work"),
    "tolist in _assign_denominators": (HOST, "the loss's denominators (under DP, one collective's result)"),
    "tolist in read_once": (DEVICE, "at the step: the decision to step, the grad norm, the losses with all metrics"),
}
OURS_INFER = {site: OURS_TRAIN[site] for site in ("tolist in dense_inputs", "_local_scalar_dense in check_token_ids")}
# verl's base `train_batch` (forward_backward_batch, then optimizer_step): the metrics read apart from the step
OURS_BASE_FLOW = {
    **OURS_TRAIN,
    "tolist in read_once": (DEVICE, "at the end of forward_backward_batch: the losses with all metrics"),
    "_local_scalar_dense in optimizer_step": (DEVICE, "DataParallelPPOCritic.optimizer_step: the decision to step"),
}
MICRO = {  # verl's engine settings: 8 rows in one mini-batch, as 1, 4 or a budget's micro-batches
    "one micro-batch": {"+fsdp.use_dynamic_bsz": False, "+fsdp.micro_batch_size_per_gpu": 8},
    "four micro-batches": {"+fsdp.use_dynamic_bsz": False, "+fsdp.micro_batch_size_per_gpu": 2},
    "token budget": {"+fsdp.use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 22},
}


def _counted_inside(counter: HostSyncs, method: Callable, inside: list[int]) -> Callable:
    """`method`, with `counter` counting while it runs (it is paused elsewhere); `inside`: how many entry points
    are running (one calls another: `train_batch` calls `optimizer_zero_grad`)."""

    @functools.wraps(method)
    def call(*args, **kwargs):
        outermost = inside[0] == 0
        inside[0] += 1
        if outermost:
            counter.paused -= 1
        try:
            return method(*args, **kwargs)
        finally:
            inside[0] -= 1
            if outermost:
                counter.paused += 1

    return call


@contextlib.contextmanager
def engine_counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostSyncs]:
    """Syncs inside the engine's entry points only: verl's worker around them is verl's to answer for."""
    inside = [0]
    with counting(monkeypatch) as counter, counter.pause(), monkeypatch.context() as patch:
        for name in ENTRY_POINTS:
            patch.setattr(PPOCriticEngine, name, _counted_inside(counter, getattr(PPOCriticEngine, name), inside))
        yield counter


def syncs(monkeypatch, model_dir, batching: dict, packed: bool, mini_batch: int = 8) -> tuple[HostSyncs, HostSyncs]:
    """The syncs of one update of 8 rows (mini-batches of `mini_batch` rows) and of one compute-values call."""
    worker = training_worker(model_dir, **SGD, **batching, **{"model.use_remove_padding": packed})
    data = rollout(8, seed=1)
    with engine_counting(monkeypatch) as update:
        train(worker, data, mini_batch_size=mini_batch)
    with engine_counting(monkeypatch) as values:
        infer_values(worker, data)
    return update, values


def verls(counter: HostSyncs) -> set[str]:
    """The sites inside verl that read, as `file:line`."""
    return {site.split(" via verl ")[1] for site in counter.where if " via verl " in site}


def ours(counter: HostSyncs) -> dict[str, int]:
    """The engine's own reads (ppo-critic's code, not inside verl or transformers) by site: what reads, and in which
    function (`tolist in dense_inputs`; line numbers left out)."""
    sites = collections.Counter()
    for site, n in counter.where.items():
        if " via " not in site:
            what, rest = site.split(" at ", 1)
            sites[f"{what} in {rest.split(' in ', 1)[1]}"] += n
    return dict(sites)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_engine_reads_nothing_per_micro_batch(single_process, model_dir, monkeypatch, packed):
    """One, four or a token budget's micro-batches of one mini-batch: the engine's own reads stay the mini-batch's
    few, each at a site of `OURS_TRAIN`, one of them on the device; verl's value loss reads per micro-batch, each
    read at a site named in VERL_READS."""
    counts = {name: syncs(monkeypatch, model_dir, batching, packed) for name, batching in MICRO.items()}
    detail = {name: (dict(u.where), dict(v.where)) for name, (u, v) in counts.items()}
    for update, values in counts.values():
        assert ours(update) == dict.fromkeys(OURS_TRAIN, 1), detail
        assert ours(values) == dict.fromkeys(OURS_INFER, 1), detail
        assert verls(update) <= set(VERL_READS) and not verls(values), detail
    one, four = counts["one micro-batch"][0], counts["four micro-batches"][0]
    assert four.total - four.ours > one.total - one.ours  # verl's loss: its reads per micro-batch, counted
    assert [kind for kind, _ in OURS_TRAIN.values()].count(DEVICE) == 1


def test_the_engine_reads_the_same_per_mini_batch(single_process, model_dir, monkeypatch):
    """Four mini-batches of two rows cost four times one mini-batch of eight: one engine call each."""
    update, _ = syncs(monkeypatch, model_dir, MICRO["four micro-batches"], packed=True, mini_batch=2)
    assert ours(update) == dict.fromkeys(OURS_TRAIN, 4), dict(update.where)


def test_verls_base_flow_reads_the_metrics_apart_from_the_step(single_process, model_dir, monkeypatch):
    """verl's base `train_batch` (`forward_backward_batch`, then `optimizer_step`) still trains through the engine,
    reading the metrics and the decision to step apart: one device read more than the engine's own `train_batch`."""
    monkeypatch.setattr(PPOCriticEngine, "train_batch", BaseEngine.train_batch)
    update, _ = syncs(monkeypatch, model_dir, MICRO["four micro-batches"], packed=True)
    assert ours(update) == dict.fromkeys(OURS_BASE_FLOW, 1), dict(update.where)
    assert [kind for kind, _ in OURS_BASE_FLOW.values()].count(DEVICE) == 2
