"""verl ≥ 0.9 with `critic.strategy=ppo_critic` and verl's LoRA keys (`critic.model.lora_rank`, `lora_alpha`,
`target_modules`): ppo-critic builds the adapters itself, the backbone frozen and the value head trained in full (verl's
own fsdp engine builds a CAUSAL_LM adapter, which peft cannot even put on a token-classification critic), and one
update through verl's `TrainingWorker` is ppo-critic's own LoRA critic's update from the same weights."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import SGD, engine_params, infer_values, train, training_worker

from ppo_critic import DataParallelPPOCritic, build_value_model
from ppo_critic.models.lora import apply_lora
from verl_shared import params, rel_change, rollout

LAYOUT = 1e-5  # DESIGN §6: the same update in another summation order (verl's nested rows, token budgets)
LORA = {"model.lora_rank": 4, "model.lora_alpha": 8}


def own_lora_update(model_dir, start: dict[str, torch.Tensor], targets, data) -> dict[str, torch.Tensor]:
    """ppo-critic's own LoRA critic from the engine's starting weights (adapters included), after one update."""
    model = apply_lora(build_value_model(str(model_dir)), rank=4, alpha=8, target_modules=targets)
    model.load_state_dict(start)
    trainable = [p for p in model.parameters() if p.requires_grad]
    critic = DataParallelPPOCritic(
        {"ppo_mini_batch_size": 4, "grad_clip": 1.0}, model, torch.optim.SGD(trainable, lr=SGD["optim.lr"])
    )
    critic.update_critic(data)
    return params(model)


BACKBONE_LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize(
    ("targets", "ours", "adapted"),
    [("all-linear", "all-linear", BACKBONE_LINEAR), ("[q_proj,v_proj]", ["q_proj", "v_proj"], {"q_proj", "v_proj"})],
    ids=["all-linear", "q-v"],
)
def test_verls_lora_keys_train_the_adapters_and_the_value_head(single_process, model_dir, targets, ours, adapted):
    data = rollout(8, seed=5)
    worker = training_worker(model_dir, **SGD, **LORA, **{"model.target_modules": targets})
    before, values = engine_params(worker), infer_values(worker, data)
    assert {k.split(".lora_A.")[0].rsplit(".", 1)[-1] for k in before if ".lora_A." in k} == adapted  # not the head
    train(worker, data, mini_batch_size=4)
    after = engine_params(worker)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert {k for k in before if ".score." in k} == {k for k in changed if ".score." in k} != set()
    assert all(".score." in k or ".lora_" in k for k in changed)  # the backbone's own weights stay frozen
    assert any(".lora_B." in k for k in changed) and not torch.equal(infer_values(worker, data), values)
    assert rel_change(after, own_lora_update(model_dir, before, ours, data), before) <= LAYOUT
