"""HF <-> megatron weight conversion (pure functions, no process group), model checks and megatron config checks.

The numerical equivalence of the running megatron critic is in tests/distributed/test_megatron.py.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from ppo_critic import CriticConfig, MegatronPPOCritic, build_value_model
from ppo_critic.backends.megatron.model import (
    Shapes,
    check_supported,
    from_te_names,
    hf_to_megatron,
    megatron_to_hf,
    rope_theta,
    to_te_names,
)
from ppo_critic.worker import worker_config


def hf_state(model_type: str, **overrides) -> tuple[dict[str, torch.Tensor], object]:
    torch.manual_seed(0)
    model = build_value_model(tiny_config(model_type, num_hidden_layers=4, **overrides), value_head_init="normal:1")
    with torch.no_grad():  # non-zero biases and norms, so a misplaced slice cannot hide
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return {k: v.clone() for k, v in model.state_dict().items()}, model.config


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("pp", [1, 2])
def test_hf_to_megatron_to_hf_is_exact(model_type, tp, pp):
    hf, config = hf_state(model_type, vocab_size=129)  # 129 rows: padded to 130 under TP=2
    shapes = Shapes.of(config)
    stages = [list(range(4))[i * 4 // pp : (i + 1) * 4 // pp] for i in range(pp)]
    back = {}
    for i, layers in enumerate(stages):
        shards = [hf_to_megatron(hf, shapes, r, tp, layers, pre=i == 0, post=i == pp - 1) for r in range(tp)]
        if i == 0:
            assert shards[0]["embedding.word_embeddings.weight"].shape == (shapes.padded_vocab(tp) // tp, 64)
        back |= megatron_to_hf(shards, shapes, layers)
    assert back.keys() == hf.keys()
    for k, v in hf.items():
        assert torch.equal(back[k], v), k
    assert ("model.layers.0.self_attn.q_proj.bias" in hf) == (model_type == "qwen2")


def test_qkv_is_fused_per_kv_group_and_split_over_tp():
    hf, config = hf_state("qwen2")
    s = Shapes.of(config)  # 4 query heads, 2 KV groups of 2 heads, head_dim 16
    d = s.head_dim
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    for rank in range(2):  # TP=2: rank r holds KV group r: its 2 query heads, its key, its value
        fused = hf_to_megatron(hf, s, rank, 2, [0], pre=False, post=False)[
            "decoder.layers.0.self_attention.linear_qkv.weight"
        ]
        expected = torch.cat(
            [q[2 * rank * d : (2 * rank + 2) * d], k[rank * d : (rank + 1) * d], v[rank * d : (rank + 1) * d]]
        )
        assert torch.equal(fused, expected)
    gate, up = (hf[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    fc1 = hf_to_megatron(hf, s, 1, 2, [0], pre=False, post=False)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate[64:], up[64:]]))  # each TP rank: its gate slice, then its up slice


def test_transformer_engine_names_round_trip():
    hf, config = hf_state("llama")
    local = hf_to_megatron(hf, Shapes.of(config), 0, 1, [0, 1], pre=True, post=True)
    te = to_te_names(local)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in te)
    assert from_te_names(te) == local


def test_rope_theta_is_read_from_the_config():
    _, config = hf_state("llama", rope_theta=123456.0)
    assert rope_theta(config) == 123456.0


@pytest.mark.parametrize(
    ("model_type", "overrides", "tp", "pp", "vpp", "message"),
    [
        ("qwen2", {}, 3, 1, None, "tensor_model_parallel_size=3 must divide num_attention_heads=4"),
        ("qwen2", {}, 4, 1, None, "must divide num_key_value_heads=2"),
        ("qwen2", {}, 1, 3, None, "must divide num_hidden_layers=4"),
        ("qwen2", {}, 1, 4, 2, "virtual_pipeline_model_parallel_size=2 must divide num_hidden_layers=4"),
        ("olmo2", {}, 1, 1, None, "model_type 'olmo2' is not supported"),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 1, 1, None, "rope_scaling type 'linear'"),
        ("llama", {"hidden_act": "gelu"}, 1, 1, None, "hidden_act='gelu' is not supported"),
    ],
)
def test_unsupported_models_and_layouts_are_named(model_type, overrides, tp, pp, vpp, message):
    _, config = hf_state(model_type, **overrides)
    with pytest.raises(ValueError, match="cannot build the megatron value model") as err:
        check_supported(config, tp, pp, vpp)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"megatron": {"context_parallel_size": 2}}, "megatron.context_parallel_size must be 1"),
        (
            {"megatron": {"tensor_model_parallel_size": 2, "sequence_parallel": True}},
            "megatron.sequence_parallel=true is not supported",
        ),
        (
            {"megatron": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}},
            "needs pipeline_model_parallel_size > 2",
        ),
        (
            {"megatron": {"tensor_model_parallel_size": 0}},
            "megatron.tensor_model_parallel_size=0 must be a positive integer",
        ),
        ({"megatron": {"optimizer_offload": True}}, "megatron.optimizer_offload=true is not supported"),
        (
            {"ulysses_sequence_parallel_size": 2, "model": {"use_remove_padding": True}},
            "ulysses_sequence_parallel_size must be 1 with strategy=megatron",
        ),
        ({"optim": {"optimizer": "sgd"}}, "optim.optimizer=sgd needs megatron.use_distributed_optimizer=false"),
        ({"shuffle": True}, "shuffle=true needs data_loader_seed"),
        ({"megatron": {"tensor_model_paralel_size": 2}}, "did you mean 'megatron.tensor_model_parallel_size'"),
    ],
)
def test_megatron_config_errors_name_the_key(section, message):
    with pytest.raises(ValueError) as err:
        worker_config({"strategy": "megatron", **section})
    assert message in str(err.value)


def test_megatron_section_is_ignored_by_other_strategies():
    config = CriticConfig.from_any({"megatron": {"context_parallel_size": 2}})
    assert config.strategy == "fsdp2"


def test_megatron_critic_needs_its_module_and_optimizer():
    pytest.importorskip("megatron.core")
    with pytest.raises(TypeError, match=r"critic_module .* and critic_optimizer"):
        MegatronPPOCritic({"strategy": "megatron"})
