"""Value models: transformers backbones with a value head (`hf`), LoRA (`lora`), megatron-core GPT models
(`megatron`), per-layer compilation (`compile`), and the varlen attention packed rows use (`attention`)."""

from ppo_critic.models.hf import ValueHead, ValueModel, build_value_model, token_values

__all__ = ["ValueHead", "ValueModel", "build_value_model", "token_values"]
