"""verl's own `DataParallelPPOCritic` against ppo-critic's on the same DataProto, weights and config, in fp32.

One micro-batch per mini-batch: verl's numbers in every loss mode (values exactly; updates and metrics to float
rounding). Smaller micro-batches: ppo-critic's update stays its one-micro-batch update (the loss is normalised over
the whole mini-batch); verl's changes under `token-mean`, which it normalises per micro-batch. SGD keeps the update
linear in the gradient, so a difference in the gradient is not hidden by Adam's normalisation.
"""

from __future__ import annotations

import copy

import pytest
import torch
from verl.workers.config import FSDPCriticConfig
from verl.workers.config.critic import FSDPCriticModelCfg
from verl_helpers import VerlCritic, verl_critic_in_fp32

from ppo_critic import DataParallelPPOCritic
from verl_shared import MODES, params, rel_change, rollout

# fp32 gradients of the same graph summed in another order: rounding <= a few ulp per term over a few hundred
# terms, far below 1e-6 relative; a wrong normalisation shows up at 1e-2 and above
SAME = 1e-6


@pytest.fixture(scope="module")
def base_model(model_dir):
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(model_dir, attn_implementation="sdpa").float()


def critics(base_model, model_dir, micro: int, **config):
    """verl's critic and ours, each on its own copy of the same weights, from one verl config dataclass."""
    cfg = FSDPCriticConfig(
        strategy="fsdp",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=micro,
        forward_micro_batch_size_per_gpu=micro,
        cliprange_value=0.2,
        grad_clip=1.0,
        model=FSDPCriticModelCfg(path=str(model_dir)),
        **config,
    )
    out = []
    for cls in (VerlCritic, DataParallelPPOCritic):
        model = copy.deepcopy(base_model)
        out.append(cls(cfg, model, torch.optim.SGD(model.parameters(), lr=0.1)))
    return out


def updated(critic, data) -> tuple[dict[str, torch.Tensor], dict]:
    with verl_critic_in_fp32():
        metrics = critic.update_critic(copy.deepcopy(data))
    return params(critic.critic_module), metrics


def test_values_are_verls_exactly(base_model, model_dir):
    for micro, dynamic in ((2, False), (4, False), (None, True)):
        verl, ours = critics(base_model, model_dir, micro or 4, use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=40)
        data = rollout(8, meta={"micro_batch_size": micro, "use_dynamic_bsz": dynamic, "max_token_len": 40})
        with verl_critic_in_fp32():
            theirs = verl.compute_values(copy.deepcopy(data))
        assert torch.equal(ours.compute_values(data), theirs)


@pytest.mark.parametrize("mode", MODES)
def test_one_micro_batch_per_mini_batch_gives_verls_update_and_metrics(base_model, model_dir, mode):
    verl, ours = critics(base_model, model_dir, micro=4, loss_agg_mode=mode)
    before = params(base_model)
    data = rollout(10, seed=1)  # mini-batches of 4, 4 and 2 rows: verl's short last mini-batch, one step too
    (theirs, verl_metrics), (mine, our_metrics) = updated(verl, data), updated(ours, data)
    assert rel_change(mine, theirs, before) <= SAME
    assert len(verl_metrics["critic/grad_norm"]) == 3
    mean_norm = sum(verl_metrics["critic/grad_norm"]) / 3
    assert our_metrics["critic/grad_norm"] == pytest.approx(mean_norm, rel=SAME)
    # verl's vf_loss is the sum of the steps' losses; ours is their mean (docs/verl.md: "Use it inside verl 0.7")
    assert our_metrics["critic/vf_loss"] * 3 == pytest.approx(verl_metrics["critic/vf_loss"], rel=SAME)


@pytest.mark.parametrize("mode", MODES)
def test_smaller_micro_batches_leave_our_update_unchanged(base_model, model_dir, mode):
    before = params(base_model)
    data = rollout(8, seed=2)
    verl_whole, ours_whole = (updated(c, data)[0] for c in critics(base_model, model_dir, micro=4, loss_agg_mode=mode))
    verl_split, ours_split = (updated(c, data)[0] for c in critics(base_model, model_dir, micro=1, loss_agg_mode=mode))
    assert rel_change(ours_split, ours_whole, before) <= SAME
    verl_drift = rel_change(verl_split, verl_whole, before)
    if mode == "token-mean":
        # verl averages tokens per micro-batch: rows with fewer tokens weigh more
        assert verl_drift > 1e-2
    else:
        # per-sequence modes: verl's 1/gradient_accumulation scaling is exact when micro-batches hold equal rows
        assert verl_drift <= SAME


def test_dynamic_batching_with_one_micro_batch_per_mini_batch_is_verls(base_model, model_dir):
    before = params(base_model)
    data = rollout(8, seed=3)
    verl, ours = critics(base_model, model_dir, micro=4, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=4096)
    assert rel_change(updated(ours, data)[0], updated(verl, data)[0], before) <= SAME
