"""Devices, process groups and collectives (`mesh`, `collectives`), and parallelism applied to a plain model:
FSDP / DDP wrapping (`fsdp`), Ulysses sequence parallelism (`ulysses`), megatron-core's parallel state (`megatron`)."""
