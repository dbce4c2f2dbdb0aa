"""Value models: transformers-based (`hf`)."""

from ppo_critic.models.hf import ValueHead, ValueModel, build_value_model, token_values

__all__ = ["ValueHead", "ValueModel", "build_value_model", "token_values"]
