"""Every option of ppo-critic, as dataclasses with verl's field names, and their checks; torch-free.

`critic`: the critic (`CriticConfig` and its parts), built from a dict, an OmegaConf node or verl's config (`verl`).
`train` and `bench`: what the two commands read; `reference`: what each option means (`--help`, `--print-config`);
`modes`: the names of the loss and normalisation modes; `env`: options from `PPO_CRITIC_OPTIONS`.
"""

from ppo_critic.config.critic import CriticConfig, MegatronConfig, ModelConfig, OptimConfig

__all__ = ["CriticConfig", "MegatronConfig", "ModelConfig", "OptimConfig"]
