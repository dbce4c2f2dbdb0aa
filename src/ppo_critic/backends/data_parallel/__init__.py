"""The data-parallel backend: `fsdp` (parallelize: none, ddp, fsdp, fsdp2 over the layout's mesh), `critic`
(DataParallelPPOCritic) and `backend` (DataParallelBackend, the CriticWorker's). Its models are `models/hf.py`'s."""
