"""Rollout data for the critic: the batch and its checks (`batch`), which samples go together (`batching`), padding
removed into packed rows (`packing`), and recorded rollout files in and per-token values out (`rollouts`)."""
