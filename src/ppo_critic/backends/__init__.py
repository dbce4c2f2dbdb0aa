"""One folder per backend, each holding all of it: `data_parallel` (plain, DDP, FSDP1/2 over transformers models)
and `megatron` (megatron-core TP × PP chunks): its model, how it is parallelised, its critic and the worker's backend.
`build` is what both build alike."""
