"""verl 0.7.1's FSDP `CriticWorker` building a LoRA critic itself, with ppo-critic's critic inside.

verl's worker wraps the token-classification critic in a peft `TOKEN_CLS` adapter: peft then trains the value head
in full as a copy (`score.modules_to_save.default`) beside a frozen `score.original_module`. ppo-critic's critic trains
that copy as verl's own critic does, and PopArt rescales that copy too (the frozen original never moves). A head verl's
worker left frozen (a head of another name) is refused; verl's own critic would train with the head at its random
start. verl's default `target_modules=all-linear` puts an adapter on the head as well, which peft then refuses in
verl's worker before any critic exists: a list of the backbone's modules is the fix.
"""

from __future__ import annotations

import pytest
import torch
from verl_helpers import OursInVerl, VerlCritic, make_worker, worker_update

from ppo_critic.config.env import OPTIONS_ENV
from verl_shared import params, rel_change, rollout

SAME = 1e-6  # as test_integrations_verl_worker.py: one fp32 update of the same graph, summed in another order
FIXED = {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 4, "forward_micro_batch_size_per_gpu": 2}
SGD = {"optim.optimizer": "SGD", "optim.weight_decay": 0.0, "optim.lr": 0.1}
LORA = {**FIXED, **SGD, "model.lora_rank": 4, "model.lora_alpha": 8, "model.target_modules": "[q_proj,v_proj]"}
COPY, ORIGINAL = ".score.modules_to_save.default.", ".score.original_module."


def lora_worker(model_dir, critic=OursInVerl, **settings):
    """verl's LoRA critic worker; the adapters' random start seeded, so that two workers start alike."""
    torch.manual_seed(0)
    return make_worker(model_dir, critic, **{**LORA, **settings})


def changed_by_an_update(worker) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The parameters after one `update_critic` of two mini-batches, and the names of those it changed."""
    before = params(worker.critic_module)
    worker_update(worker, rollout(8, seed=4))
    after = params(worker.critic_module)
    return after, {k for k in before if not torch.equal(before[k], after[k])}


@pytest.mark.parametrize("value_norm", ["off", "popart"])
def test_the_value_head_trains_as_the_copy_peft_keeps(single_process, model_dir, monkeypatch, value_norm):
    monkeypatch.setenv(OPTIONS_ENV, f"value_norm={value_norm}")
    worker = lora_worker(model_dir)
    assert type(worker.critic).__name__ == "DataParallelPPOCritic" and type(worker.critic) is OursInVerl
    _, changed = changed_by_an_update(worker)
    assert {k.rsplit(".", 1)[-1] for k in changed if COPY in k} == {"weight", "bias"}
    assert not any(ORIGINAL in k for k in changed)  # PopArt's rescaling went to the copy that computes
    assert all(COPY in k or ".lora_" in k for k in changed)  # the backbone's own weights stay frozen
    assert any(".lora_B." in k for k in changed)


def test_ours_trains_verls_lora_critic_as_verls_own_critic_does(single_process, model_dir, monkeypatch):
    monkeypatch.setenv(OPTIONS_ENV, "value_norm=off")
    ours, theirs = lora_worker(model_dir), lora_worker(model_dir, VerlCritic)
    before = params(ours.critic_module)
    assert all(torch.equal(v, params(theirs.critic_module)[k]) for k, v in before.items())
    (after, _), (verl_after, _) = changed_by_an_update(ours), changed_by_an_update(theirs)
    assert rel_change(after, verl_after, before) <= SAME  # one micro-batch per mini-batch: verl's normalisation


def test_a_value_head_left_frozen_is_refused(model_dir):
    """A head verl's TOKEN_CLS adapter does not keep a copy of (another name than score / classifier) stays frozen:
    here peft's plain adapter, which trains no head at all. verl's own critic takes it and never moves the head."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForTokenClassification
    from verl.workers.config import FSDPCriticConfig
    from verl.workers.config.critic import FSDPCriticModelCfg

    base = AutoModelForTokenClassification.from_pretrained(model_dir)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))
    lora = FSDPCriticModelCfg(path=str(model_dir), lora_rank=4)
    config = FSDPCriticConfig(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, model=lora)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as info:
        OursInVerl(config, model, optimizer)
    assert str(info.value) == (
        "critic.model.lora_rank=4: verl's worker left the value head 'score' frozen, so the critic could never fit "
        "values; use a critic whose head is named score or classifier (the heads verl's LoRA critic trains)"
    )
    assert type(VerlCritic(config, model, optimizer)) is VerlCritic


def test_verls_default_all_linear_lora_critic_fails_in_peft_before_any_critic(single_process, model_dir):
    with pytest.raises(TypeError, match=r"modules_to_save cannot be applied to modules of type .*lora"):
        make_worker(model_dir, **{**LORA, "model.target_modules": "all-linear"})
