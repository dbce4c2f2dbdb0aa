"""ppo-critic inside other RL frameworks: verl 0.7's own workers (`verl`), verl ≥ 0.9's engine registry
(`verl_engine`, registered by the `verl.plugins` entry point `verl_plugin`), and verl's critic as a bench path."""
