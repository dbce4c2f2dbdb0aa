"""What every backend's critic shares: the compute_values / update_critic loops (`base`), the value objective
(`objectives`), return normalisation (`value_norm`), EMA weights (`ema`) and perf metrics (`perf`). The critic
classes live with their backends (`ppo_critic.backends`)."""
