"""Adapters that put ppo-critic's critics inside other RL frameworks (`verl`: verl 0.7.x's own workers)."""
