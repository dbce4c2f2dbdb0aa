"""build_value_model: token-classification, generic backbone + head, TRL-style v_head; head init and dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import make_batch, tiny_config
from ppo_critic import DataParallelPPOCritic, build_value_model
from ppo_critic.models.hf import ValueHead, ValueModel, find_value_head


class TrlValueHead(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.summary = nn.Linear(hidden, 1)

    def forward(self, hidden):
        return self.summary(self.dropout(hidden))


class TrlStyleCritic(nn.Module):
    """The surface of TRL's AutoModelForCausalLMWithValueHead: returns (lm_logits, loss, values)."""

    def __init__(self):
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        fields = tiny_config("llama")
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        self.pretrained_model = AutoModelForCausalLM.from_config(config)
        self.v_head = TrlValueHead(config.hidden_size)

    def forward(self, input_ids, attention_mask, position_ids, use_cache, **kwargs):
        out = self.pretrained_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            output_hidden_states=True,
            **kwargs,
        )
        return out.logits, None, self.v_head(out.hidden_states[-1]).squeeze(-1)


def train_twenty_steps(model):
    batch = make_batch(8, 6, 5, seed=21)
    critic = DataParallelPPOCritic(
        {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4, "cliprange_value": None},
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
    )
    values = critic.compute_values(batch)
    losses = [critic.update_critic(batch)["critic/vf_loss"] for _ in range(20)]
    return values, losses


@pytest.mark.parametrize(
    ("source", "expected_type"),
    [
        (lambda: build_value_model(tiny_config("qwen2")), "Qwen2ForTokenClassification"),
        (lambda: build_value_model(tiny_config("llama")), "LlamaForTokenClassification"),
        (lambda: build_value_model(tiny_config("olmo2")), "ValueModel"),  # no Olmo2ForTokenClassification
        (lambda: build_value_model(TrlStyleCritic()), "TrlStyleCritic"),
    ],
    ids=["qwen2", "llama", "olmo2-generic", "trl-v_head"],
)
def test_every_kind_of_value_model_gives_values_and_trains(source, expected_type):
    torch.manual_seed(0)
    model = source()
    assert type(model).__name__ == expected_type
    values, losses = train_twenty_steps(model)
    assert values.shape == (8, 5)
    assert losses[-1] < 0.5 * losses[0], losses


def test_generic_head_is_available_for_every_architecture():
    model = build_value_model(tiny_config("qwen2"), head="generic")
    assert isinstance(model, ValueModel) and isinstance(model.score, ValueHead)
    with pytest.raises(ValueError, match=r"olmo2.*ForTokenClassification"):
        build_value_model(tiny_config("olmo2"), head="token_classification")


@pytest.mark.parametrize("head", ["auto", "generic"])
def test_value_head_init(head):
    torch.manual_seed(0)
    zero = build_value_model(tiny_config("qwen2"), head=head, value_head_init="zero")
    parent, name = find_value_head(zero)
    assert getattr(parent, name).weight.abs().sum() == 0
    critic = DataParallelPPOCritic({"ppo_mini_batch_size": 8}, zero, torch.optim.SGD(zero.parameters(), lr=0.1))
    assert critic.compute_values(make_batch()).abs().sum() == 0
    normal = build_value_model(tiny_config("qwen2", hidden_size=256), head=head, value_head_init="normal:0.5")
    parent, name = find_value_head(normal)
    weight = getattr(parent, name).weight
    assert 0.4 < weight.std().item() < 0.6
    assert getattr(parent, name).bias is None or getattr(parent, name).bias.abs().sum() == 0


def test_head_dropout_is_zero_and_cache_is_off():
    for model in (build_value_model(tiny_config("qwen2")), build_value_model(TrlStyleCritic())):
        parent, _ = find_value_head(model)
        dropouts = [m for m in (*model.children(), *parent.children()) if isinstance(m, nn.Dropout)]
        assert dropouts and all(m.p == 0 for m in dropouts)
    config = build_value_model(tiny_config("qwen2")).config
    assert config.num_labels == 1 and config.classifier_dropout == 0 and config.use_cache is False


@pytest.mark.parametrize("head", ["auto", "generic"])
def test_fp32_value_head_under_bf16(head):
    model = build_value_model(tiny_config("qwen2"), head=head, dtype="bfloat16", value_head_dtype="float32")
    parent, name = find_value_head(model)
    linear = getattr(parent, name)
    assert isinstance(linear, ValueHead) and linear.weight.dtype == torch.float32
    assert next(model.parameters()).dtype == torch.bfloat16
    batch = make_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    assert out.logits.dtype == torch.float32
    assert set(model.state_dict()) >= {f"{name}.weight"} or head == "generic"


def test_local_path_loads_weights_and_keeps_a_trained_head(tmp_path):
    torch.manual_seed(0)
    original = build_value_model(tiny_config("qwen2"), value_head_init="normal:0.3")
    original.save_pretrained(tmp_path / "critic")
    loaded = build_value_model(tmp_path / "critic", value_head_init="zero")  # the saved head wins
    batch = make_batch()
    opt = torch.optim.SGD(original.parameters(), lr=0.1)
    a = DataParallelPPOCritic({"ppo_mini_batch_size": 8}, original, opt).compute_values(batch)
    b = DataParallelPPOCritic({"ppo_mini_batch_size": 8}, loaded, opt).compute_values(batch)
    torch.testing.assert_close(a, b)
    assert a.abs().sum() > 0


def test_local_causal_lm_checkpoint_gets_a_fresh_head(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_config("qwen2")
    lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    lm.save_pretrained(tmp_path / "lm")
    model = build_value_model(str(tmp_path / "lm"), value_head_init="zero")
    torch.testing.assert_close(
        model.model.embed_tokens.weight, lm.model.embed_tokens.weight
    )  # the backbone was loaded, not re-initialised
    assert model.score.weight.abs().sum() == 0


def test_bad_sources_are_named():
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        build_value_model("/tmp/does-not-exist/critic")
    with pytest.raises(ValueError, match="model_type"):
        build_value_model({"hidden_size": 64})
    with pytest.raises(TypeError, match="v_head"):
        build_value_model(nn.Linear(4, 1))
    with pytest.raises(ValueError, match="value_head_init"):
        build_value_model(tiny_config("qwen2"), value_head_init="uniform")
    with pytest.raises(ValueError, match="value_head_dtype"):
        build_value_model(tiny_config("qwen2"), value_head_dtype="float8")
