"""What verl 0.9's trainer (`python -m verl.trainer.main_ppo`) needs on a CPU-only machine, for tests only. Named in
`VERL_USE_EXTERNAL_MODULES`, so `import verl` loads it in the driver and in every Ray worker.

- verl_cpu's CPU platform (Ray places workers on the fake GPUs the test's Ray cluster declares);
- verl's fsdp engines (the actor's, and the reference critic's), registered for CUDA and NPU only, picked on the CPU
  by verl's own `VERL_ENGINE_DEVICE`; the value model loaded with sdpa where verl's loader asks for flash-attn;
- gloo process groups: verl asks for `cpu:gloo,<device>:<backend>`, which on the CPU names the CPU twice;
- rollout `name=random`, the stand-in for vLLM / SGLang: a server that answers each prompt with seeded random tokens
  (the same prompt gets the same response in every run), and an in-process rollout that takes the actor's weights
  and drops them. Everything else (agent loop, TransferQueue, reward, advantages, metrics) is verl's own.
"""

from __future__ import annotations

import os
import random
import zlib
from typing import Any

import ray
import torch
import verl_cpu  # noqa: F401 - registers and selects the CPU platform
from transformers import AutoConfig, AutoModelForTokenClassification
from verl.workers.rollout import base
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

ROLLOUT = "random"
FIRST_TOKEN = 4  # ids below are the test tokenizer's special tokens


def _gloo_once(init_process_group):
    """`init_process_group` with a backend string that names the CPU device twice reduced to plain gloo."""

    def init(*args: Any, backend: str | None = None, **kwargs: Any):
        if backend and backend.count("cpu:") > 1:
            backend = "gloo"
        return init_process_group(*args, backend=backend, **kwargs)

    return init


def _sdpa_for_flash_attn(from_pretrained):
    """`from_pretrained` that loads with sdpa where verl asks for flash-attn (its value-model loader always does)."""

    def load(cls, *args: Any, **kwargs: Any):
        if kwargs.get("attn_implementation") == "flash_attention_2":
            kwargs["attn_implementation"] = "sdpa"
        return from_pretrained(*args, **kwargs)

    return classmethod(load)


os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
torch.distributed.init_process_group = _gloo_once(torch.distributed.init_process_group)
AutoModelForTokenClassification.from_pretrained = _sdpa_for_flash_attn(AutoModelForTokenClassification.from_pretrained)


@ray.remote(num_cpus=0)
class RandomServer:
    """The rollout server: a response of 1..max_tokens random tokens, seeded by the prompt's token ids, tagged with
    the step of the weights it last received (verl's staleness metrics read it)."""

    def __init__(self, vocab_size: int, response_length: int):
        self.vocab_size, self.response_length = vocab_size, response_length
        self.global_steps = None

    def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, **kwargs: Any):
        rng = random.Random(zlib.crc32(str(list(prompt_ids)).encode()))
        limit = sampling_params.get("max_tokens") or self.response_length
        tokens = [rng.randrange(FIRST_TOKEN, self.vocab_size) for _ in range(rng.randint(1, limit))]
        return TokenOutput(token_ids=tokens, stop_reason="completed", extra_fields={"global_steps": self.global_steps})

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    def sleep(self) -> None:
        """verl's trainers send the replicas to sleep (to free device memory) before each weight update."""


class RandomReplica(RolloutReplica):
    """One rollout replica: one `RandomServer`, whatever the replica's world size."""

    async def launch_servers(self) -> None:
        vocab = AutoConfig.from_pretrained(self.model_config.path).vocab_size
        server = RandomServer.options(name=server_name(self.replica_rank)).remote(vocab, self.config.response_length)
        self.servers = [server]
        self._server_handle, self._server_address = server, f"random-rollout-{self.replica_rank}"


def server_name(replica_rank: int) -> str:
    return f"random_rollout_{replica_rank}"


class RandomRollout(base.BaseRollout):
    """The actor-side half of the rollout: takes each weight update (the actor gathers its shards), drops the weights
    and tells its replica's server their step."""

    async def resume(self, tags: list[str]) -> None: ...

    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps=None, **kwargs: Any):
        for _ in weights:
            pass
        replica = self.device_mesh["dp"].get_local_rank()  # verl's rollout mesh: one "dp" index per replica
        await ray.get_actor(server_name(replica)).set_global_steps.remote(global_steps)

    async def release(self) -> None: ...


RolloutReplicaRegistry.register(ROLLOUT, lambda: RandomReplica)
base._ROLLOUT_REGISTRY[(ROLLOUT, "async")] = f"{__name__}.RandomRollout"
