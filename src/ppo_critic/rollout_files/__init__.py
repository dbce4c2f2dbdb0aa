"""Recorded rollout files: JSON Lines or Parquet rows in, text tokenised on the way (`read`), per-token values out
(`write`)."""
