"""The megatron-core value model: a `GPTModel` built from a transformers config (Qwen2, Llama) whose vocabulary
output layer is replaced by a `Linear(hidden, 1)` value head replicated over tensor parallel, plus the exact
HF <-> megatron weight conversion (QKV and gate/up fusion, tensor-parallel slices, pipeline layer offsets).

The HF side is always the state dict of `build_value_model` (`model.*` backbone, `score.*` head), so a critic
starts from, and is exported as, an ordinary HF checkpoint. Megatron's parallel state must be initialised first
(`ppo_critic.backends.megatron.parallel.initialize`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
_TE_NORM_NAMES = {  # local spec name -> transformer-engine spec name (norm fused into the next linear)
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


@dataclass(frozen=True)
class Shapes:
    """The sizes the conversion needs, read from a transformers config."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    vocab: int
    qkv_bias: bool

    @classmethod
    def of(cls, hf_config: Any) -> Shapes:
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        qkv_bias = hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
        return cls(
            hidden=hf_config.hidden_size,
            heads=heads,
            kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            ffn=hf_config.intermediate_size,
            layers=hf_config.num_hidden_layers,
            vocab=hf_config.vocab_size,
            qkv_bias=qkv_bias,
        )

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of TP (the embedding is split by rows); extra rows are zero."""
        return math.ceil(self.vocab / tp) * tp


def check_supported(hf_config: Any, tp: int, pp: int, vpp: int | None) -> None:
    """Raise one ValueError naming every setting the megatron value model cannot build from `hf_config`."""
    errors = []
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        errors.append(f"model_type {hf_config.model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}")
    else:
        s = Shapes.of(hf_config)
        for name, n in (("num_attention_heads", s.heads), ("num_key_value_heads", s.kv_heads)):
            if n % tp:
                errors.append(f"megatron.tensor_model_parallel_size={tp} must divide {name}={n}")
        stages = pp * (vpp or 1)
        if s.layers % stages:
            errors.append(
                f"megatron.pipeline_model_parallel_size={pp} x virtual_pipeline_model_parallel_size={vpp or 1} "
                f"must divide num_hidden_layers={s.layers}"
            )
        scaling = getattr(hf_config, "rope_scaling", None) or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default":
            errors.append(f"rope_scaling type {kind!r} is not supported by the megatron backend; use the default rope")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            errors.append(f"hidden_act={hf_config.hidden_act!r} is not supported; the megatron backend builds SwiGLU")
    if errors:
        raise ValueError("cannot build the megatron value model:\n  - " + "\n  - ".join(errors))


def rope_theta(hf_config: Any) -> float:
    """Rotary base of Qwen2/Llama configs across transformers versions (`rope_theta` or `rope_parameters`)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def transformer_config(hf_config: Any, megatron: Any, dtype: torch.dtype, use_cpu_initialization: bool):
    """The megatron `TransformerConfig` of `hf_config` (RMSNorm, SwiGLU, GQA, no dropout, per-token loss)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = Shapes.of(hf_config)
    vpp = megatron.virtual_pipeline_model_parallel_size
    return TransformerConfig(
        num_layers=s.layers,
        hidden_size=s.hidden,
        num_attention_heads=s.heads,
        num_query_groups=s.kv_heads,
        kv_channels=s.head_dim,
        ffn_hidden_size=s.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=s.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=megatron.tensor_model_parallel_size,
        pipeline_model_parallel_size=megatron.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        variable_seq_lengths=True,  # micro-batches have their own lengths; pipeline stages exchange shapes
        calculate_per_token_loss=True,  # the critic normalises the loss itself (DESIGN §3); no 1/num_micro
        moe_token_dispatcher_type="alltoall",  # the default (allgather) refuses variable_seq_lengths
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=False,  # weights always come from an HF state dict
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
    )


class SdpaAttention(nn.Module):
    """Causal core attention through `F.scaled_dot_product_attention` (native GQA, no [s, s] mask in memory).

    Stands in for megatron's `DotProductAttention` in the local layer spec: same constructor and call, tensors
    `[s, b, heads, head_dim]` in and `[s, b, heads * head_dim]` out.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_: Any):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None, **kw):
        if kw.get("packed_seq_params") is not None or attention_bias is not None:
            raise NotImplementedError("SdpaAttention runs padded causal batches only")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=True)
        return out.permute(2, 0, 1, 3).flatten(2)


class MegatronValueHead(nn.Linear):
    """`Linear(hidden, 1)` in place of GPTModel's output layer: same call, returns `(values, None)`.

    Replicated over tensor parallel (its inputs are identical on every TP rank, so are its gradients), and
    computed in fp32 so that small value differences survive bf16 training.
    """

    def forward(self, hidden: Tensor, weight: Tensor | None = None, runtime_gather_output: Any = None):
        with torch.autocast(hidden.device.type, enabled=False):
            return F.linear(hidden.to(self.weight.dtype), self.weight, self.bias), None


def layer_spec():
    """Transformer-engine layer spec when TE is importable, else the local spec with `SdpaAttention`."""
    from megatron.core.models.gpt import gpt_layer_specs

    try:
        import transformer_engine  # noqa: F401

        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    except ImportError:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = SdpaAttention
        return spec


def build_megatron_value_model(hf_config: Any, tf_config: Any, head_bias: bool = True) -> list[nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), with the value head on the last stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    s = Shapes.of(hf_config)
    tp = ps.get_tensor_model_parallel_world_size()
    vpp = tf_config.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vpp or 1):
        stage_arg = stage if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage_arg)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage_arg)
        model = GPTModel(
            config=tf_config,
            transformer_layer_spec=layer_spec(),
            vocab_size=s.padded_vocab(tp),
            max_sequence_length=getattr(hf_config, "max_position_embeddings", 4096),
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            rotary_base=rope_theta(hf_config),
            vp_stage=stage_arg,
        )
        if post:
            device = model.decoder.final_layernorm.weight.device
            model.output_layer = MegatronValueHead(s.hidden, 1, bias=head_bias, device=device, dtype=torch.float32)
        mark_tensor_parallel(model)
        chunks.append(model)
    return chunks


def mark_tensor_parallel(model: nn.Module) -> None:
    """Tag the TP-sliced weights as megatron's initialisers would (`perform_initialization=False` skips them):
    without the tag, gradient-norm clipping counts a slice only on TP rank 0."""
    from megatron.core import tensor_parallel as tp

    for module in model.modules():
        if isinstance(module, tp.ColumnParallelLinear | tp.VocabParallelEmbedding):
            dim = 0
        elif isinstance(module, tp.RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not hasattr(weight, "tensor_model_parallel"):
            tp.set_tensor_model_parallel_attributes(weight, True, dim, 1)


def global_layers(chunk: nn.Module) -> list[int]:
    """0-based global indices of the decoder layers held by a model chunk."""
    return [layer.layer_number - 1 for layer in chunk.decoder.layers]


def hf_to_megatron(
    hf: Mapping[str, Tensor], s: Shapes, tp_rank: int, tp_size: int, layers: list[int], pre: bool, post: bool
) -> dict[str, Tensor]:
    """This TP rank's slice of the weights of one chunk, in local-spec names (`decoder.layers.<local i>`)."""
    out: dict[str, Tensor] = {}
    if pre:
        emb = hf["model.embed_tokens.weight"]
        padded = torch.zeros(s.padded_vocab(tp_size), emb.shape[1], dtype=emb.dtype, device=emb.device)
        padded[: emb.shape[0]] = emb
        out["embedding.word_embeddings.weight"] = padded.chunk(tp_size)[tp_rank]
    for local, layer in enumerate(layers):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        qkv = [hf[src + f"self_attn.{p}_proj.weight"] for p in "qkv"]
        out[dst + "self_attention.linear_qkv.weight"] = _fuse_qkv(qkv, s, tp_rank, tp_size)
        if s.qkv_bias:
            bias = [hf[src + f"self_attn.{p}_proj.bias"].unsqueeze(-1) for p in "qkv"]
            out[dst + "self_attention.linear_qkv.bias"] = _fuse_qkv(bias, s, tp_rank, tp_size).squeeze(-1)
        out[dst + "self_attention.linear_proj.weight"] = hf[src + "self_attn.o_proj.weight"].chunk(tp_size, 1)[tp_rank]
        gate, up = (hf[src + f"mlp.{p}_proj.weight"].chunk(tp_size)[tp_rank] for p in ("gate", "up"))
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"].chunk(tp_size, 1)[tp_rank]
    if post:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        out["output_layer.weight"] = hf["score.weight"]
        if "score.bias" in hf:
            out["output_layer.bias"] = hf["score.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def megatron_to_hf(shards: list[Mapping[str, Tensor]], s: Shapes, layers: list[int]) -> dict[str, Tensor]:
    """Inverse of `hf_to_megatron`: the HF weights of one chunk from the state dicts of all its TP ranks."""
    first = shards[0]
    out: dict[str, Tensor] = {}
    if "embedding.word_embeddings.weight" in first:
        out["model.embed_tokens.weight"] = _cat(shards, "embedding.word_embeddings.weight", 0)[: s.vocab]
    for local, layer in enumerate(layers):
        src, dst = f"decoder.layers.{local}.", f"model.layers.{layer}."
        out[dst + "input_layernorm.weight"] = first[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = first[src + "pre_mlp_layernorm.weight"]
        weights = _split_qkv([sh[src + "self_attention.linear_qkv.weight"] for sh in shards], s)
        out |= {dst + f"self_attn.{p}_proj.weight": w for p, w in zip("qkv", weights, strict=True)}
        if src + "self_attention.linear_qkv.bias" in first:
            parts = [sh[src + "self_attention.linear_qkv.bias"].unsqueeze(-1) for sh in shards]
            biases = _split_qkv(parts, s)
            out |= {dst + f"self_attn.{p}_proj.bias": b.squeeze(-1) for p, b in zip("qkv", biases, strict=True)}
        out[dst + "self_attn.o_proj.weight"] = _cat(shards, src + "self_attention.linear_proj.weight", 1)
        halves = [sh[src + "mlp.linear_fc1.weight"].chunk(2) for sh in shards]
        out[dst + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves])
        out[dst + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves])
        out[dst + "mlp.down_proj.weight"] = _cat(shards, src + "mlp.linear_fc2.weight", 1)
    if "decoder.final_layernorm.weight" in first:
        out["model.norm.weight"] = first["decoder.final_layernorm.weight"]
        out["score.weight"] = first["output_layer.weight"]
        if "output_layer.bias" in first:
            out["score.bias"] = first["output_layer.bias"]
    return out


def to_te_names(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Local-spec names -> transformer-engine spec names (layer norms fused into the following linear)."""
    return _rename_suffixes(state, _TE_NORM_NAMES)


def from_te_names(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Inverse of `to_te_names`."""
    return _rename_suffixes(state, {te: local for local, te in _TE_NORM_NAMES.items()})


def _rename_suffixes(state: Mapping[str, Tensor], suffixes: Mapping[str, str]) -> dict[str, Tensor]:
    out = {}
    for key, value in state.items():
        old = next((suffix for suffix in suffixes if key.endswith(suffix)), None)
        out[key if old is None else key[: -len(old)] + suffixes[old]] = value
    return out


def _fuse_qkv(qkv: list[Tensor], s: Shapes, tp_rank: int, tp_size: int) -> Tensor:
    """Megatron's QKV layout: per KV group, its query heads then its key then its value; groups split over TP."""
    q, k, v = qkv
    cols = q.shape[-1]
    per_group = s.heads // s.kv_heads
    grouped = torch.cat(
        [
            q.reshape(s.kv_heads, per_group * s.head_dim, cols),
            k.reshape(s.kv_heads, s.head_dim, cols),
            v.reshape(s.kv_heads, s.head_dim, cols),
        ],
        dim=1,
    )
    return grouped.chunk(tp_size)[tp_rank].reshape(-1, cols)


def _split_qkv(parts: list[Tensor], s: Shapes) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `_fuse_qkv` over all TP ranks' parts."""
    cols = parts[0].shape[-1]
    per_group = s.heads // s.kv_heads
    grouped = torch.cat(parts).reshape(s.kv_heads, (per_group + 2) * s.head_dim, cols)
    q, k, v = grouped.split([per_group * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return q.reshape(-1, cols), k.reshape(-1, cols), v.reshape(-1, cols)


def _cat(shards: list[Mapping[str, Tensor]], key: str, dim: int) -> Tensor:
    return torch.cat([sh[key] for sh in shards], dim=dim)
