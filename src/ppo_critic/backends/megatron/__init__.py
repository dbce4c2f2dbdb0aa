"""The megatron-core backend: `model` (GPTModel value model, HF ↔ megatron weight mapping), `parallel` (megatron's
parallel state, DDP and optimizer, TP × PP shards), `critic` (MegatronPPOCritic) and `backend` (MegatronBackend).
megatron-core itself is imported only inside the functions of a `strategy=megatron` run."""
