"""Ulysses sequence parallelism (torchrun, gloo): sp=2 and dp=2 × sp=2 give the single-process values and update,
with a packed row whose length is not a multiple of sp, and with fewer key/value heads than sp."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from conftest import make_batch, tiny_config
from ppo_critic import DataParallelPPOCritic, build_value_model
from test_layouts import torchrun

HERE = Path(__file__).resolve().parent
MODES = ("token-mean", "seq-mean-token-mean")


def reference(path: Path) -> None:
    batch = make_batch(8, 7, 6, seed=2)
    assert int(batch["attention_mask"][:2].sum()) % 2 == 1  # a micro-batch whose packed row is odd
    models = {}
    for name, kv_heads in (("gqa-kv2", 2), ("gqa-kv1", 1)):
        torch.manual_seed(0)
        base = build_value_model(tiny_config("qwen2", num_key_value_heads=kv_heads))
        updates = {}
        for mode in MODES:
            model = copy.deepcopy(base)
            before = {k: v.detach().clone() for k, v in model.state_dict().items()}
            cfg = {"ppo_mini_batch_size": 8, "grad_clip": None, "loss_agg_mode": mode}
            DataParallelPPOCritic(cfg, model, torch.optim.SGD(model.parameters(), lr=0.1)).update_critic(batch)
            delta = torch.cat([(model.state_dict()[k] - v).flatten() for k, v in before.items()])
            updates[mode] = {"before": before, "delta": delta}
        critic = DataParallelPPOCritic({"ppo_mini_batch_size": 8}, base, torch.optim.SGD(base.parameters(), lr=0.1))
        models[name] = {"model": base, "updates": updates, "values": critic.compute_values(batch)}
    torch.save({"batch": batch, "models": models}, path)


@pytest.mark.parametrize("nproc", [2, 4], ids=["sp2", "dp2xsp2"])
def test_ulysses_matches_the_single_process_reference(tmp_path, nproc):
    ref, out = tmp_path / "reference.pt", tmp_path / "out.json"
    reference(ref)
    result = torchrun(str(HERE / "ulysses_worker.py"), str(ref), str(out), "2", nproc=nproc, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert {"all_to_all_single", "all_gather", "all_reduce"} <= set(report["collectives_checked"])  # DESIGN §8
    rows = report["rows"]
    assert len(rows) == 2 * len(MODES) * (2 * 2 + 1) and any(r["checkpointing"] for r in rows)
    # DESIGN §6: heads split over ranks, the same sums in another order (conftest.FP32_REORDERED)
    bad = [r for r in rows if not (r["rel"] <= 1e-5 and r["values_max_abs"] <= 1e-5)]
    assert not bad, bad
    # issue 43 family 6: ranks of one sp group given other batches refuse alike (was: an abort in an all-to-all, or
    # values of a mixed sequence in silence), naming each rank's batch, before the update moves a weight
    for fewer, other, unchanged in report["refusals"]:
        assert "the ranks that compute one step together hold different batches (" in fewer
        assert "rows × " in fewer and "differing: rows" in fewer
        assert "differing: input_ids" in other and unchanged
