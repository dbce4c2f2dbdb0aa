"""Host syncs of the engine's entry points (`forward_backward_batch`, `optimizer_step`, ...) under verl's own
`TrainingWorker`, counted on the CPU with tests/critics/test_host_syncs.py's counter (its docstring says what counts
and why the counts are upper bounds).

verl's worker hands the engine one mini-batch at a time, on the host. The engine reads its lengths once where it
arrives and sizes every micro-batch from them (DESIGN §3 "Host syncs"), selects each micro-batch of verl's data on
the host and moves it to the device without blocking: none of its own reads is per micro-batch. Per mini-batch (one
engine call) it reads, in one process: the lengths and the token-id check (host data: no wait on CUDA), the loss's
denominators (host data; one collective's result under DP), the losses with the metrics (one read), and the decision
to step. verl's own reads inside its value loss (and its metric type) run per micro-batch, and its row selection
reads the index it is handed per row (a host tensor): each is named below, so a read of ours cannot hide among them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import pytest
from engine_helpers import SGD, infer_values, train, training_worker

from ppo_critic.integrations.verl_engine import PPOCriticEngine
from test_host_syncs import HostSyncs, counting
from verl_shared import rollout

ENTRY_POINTS = ("forward_backward_batch", "optimizer_zero_grad", "optimizer_step", "lr_scheduler_step")
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
# the engine's own reads per training mini-batch (one `train_batch` of verl's engine API), in one process
OURS_TRAIN = 5  # lengths, token-id check, denominators, losses with metrics, the decision to step
OURS_INFER = 2  # lengths, token-id check (no loss: nothing else to read)
MICRO = {  # verl's engine settings: 8 rows in one mini-batch, as 1, 4 or a budget's micro-batches
    "one micro-batch": {"+fsdp.use_dynamic_bsz": False, "+fsdp.micro_batch_size_per_gpu": 8},
    "four micro-batches": {"+fsdp.use_dynamic_bsz": False, "+fsdp.micro_batch_size_per_gpu": 2},
    "token budget": {"+fsdp.use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 22},
}


def _counted_inside(counter: HostSyncs, method: Callable) -> Callable:
    """`method`, with `counter` counting while it runs (it is paused elsewhere)."""

    @functools.wraps(method)
    def call(*args, **kwargs):
        counter.paused -= 1
        try:
            return method(*args, **kwargs)
        finally:
            counter.paused += 1

    return call


@contextlib.contextmanager
def engine_counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostSyncs]:
    """Syncs inside the engine's entry points only: verl's worker around them is verl's to answer for."""
    with counting(monkeypatch) as counter, counter.pause(), monkeypatch.context() as patch:
        for name in ENTRY_POINTS:
            patch.setattr(PPOCriticEngine, name, _counted_inside(counter, getattr(PPOCriticEngine, name)))
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


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_engine_reads_nothing_per_micro_batch(single_process, model_dir, monkeypatch, packed):
    """One, four or a token budget's micro-batches of one mini-batch: the engine's own reads stay the mini-batch's
    few; verl's value loss reads per micro-batch, each read at a site named in VERL_READS."""
    counts = {name: syncs(monkeypatch, model_dir, batching, packed) for name, batching in MICRO.items()}
    detail = {name: (dict(u.where), dict(v.where)) for name, (u, v) in counts.items()}
    for update, values in counts.values():
        assert (update.ours, values.ours) == (OURS_TRAIN, OURS_INFER), detail
        assert verls(update) <= set(VERL_READS) and not verls(values), detail
    one, four = counts["one micro-batch"][0], counts["four micro-batches"][0]
    assert four.total - four.ours > one.total - one.ours  # verl's loss: its reads per micro-batch, counted


def test_the_engine_reads_the_same_per_mini_batch(single_process, model_dir, monkeypatch):
    """Four mini-batches of two rows cost four times one mini-batch of eight: one engine call each."""
    update, _ = syncs(monkeypatch, model_dir, MICRO["four micro-batches"], packed=True, mini_batch=2)
    assert update.ours == 4 * OURS_TRAIN, dict(update.where)
