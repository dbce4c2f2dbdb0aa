"""Shared pieces of the verl 0.7.x suite: a tiny critic on disk, verl's own config composed by hydra, verl's worker
in one CPU process, and the few patches for what verl 0.7.1 hard-codes for CUDA (each says what and why).

Importing this module installs `ppo_critic.integrations.verl` (as `VERL_USE_EXTERNAL_MODULES` would); a test that
wants verl's own critic inside verl's worker says so with `critic_class(VerlCritic)`.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
import verl  # the suite runs against the real verl: a missing one is an error, never a skip
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from tensordict import TensorDict
from verl import DataProto
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.critic import dp_critic

import ppo_critic.integrations.verl as integration

VerlCritic = integration.REPLACED[dp_critic.__name__]  # verl's own critic, which the integration replaced
VERL_CONFIG_DIR = Path(verl.__file__).resolve().parent / "trainer" / "config"
OursInVerl = integration.DataParallelPPOCritic
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
VOCAB = 128
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "verl_ppo.py"


def save_tiny_critic(path: Path) -> Path:
    """The example's tiny random critic (Qwen2 token classification + a word-level tokenizer) in `path`."""
    spec = importlib.util.spec_from_file_location("verl_ppo_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.tiny_critic_dir(path, VOCAB)


def composed(overrides: list[str], config_name: str = "ppo_trainer") -> DictConfig:
    """verl's own trainer config, composed by hydra from the yaml files verl ships, with `overrides`."""
    with initialize_config_dir(config_dir=str(VERL_CONFIG_DIR), version_base=None):
        return compose(config_name=config_name, overrides=overrides)


def cpu_overrides(model_dir: Path, **critic: object) -> list[str]:
    """What a user sets to run verl's critic worker on a CPU with the tiny model (all ordinary verl options):
    the model path, sdpa attention, fp32 FSDP parameters (verl's default is bf16), plus `critic.<key>=<value>`."""
    fp32 = "{param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}"
    base = [
        "critic.strategy=fsdp2",
        f"actor_rollout_ref.model.path={model_dir}",
        f"critic.model.path={model_dir}",
        "+critic.model.override_config.attn_implementation=sdpa",
        f"+critic.model.fsdp_config.mixed_precision={fp32}",
    ]
    return base + [f"critic.{key}={_hydra(value)}" for key, value in critic.items()]


def _hydra(value: object) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def critic_dataclass(cfg: DictConfig):
    """The critic section as verl's trainer hands it to `CriticWorker`: its config dataclass."""
    return omega_conf_to_dataclass(cfg.critic)


def init_single_process() -> None:
    """torch.distributed with one gloo rank, and the environment verl's `Worker` reads."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")


def _sdpa_valuehead_loader(local_path, torch_dtype, model_config, trust_remote_code):
    """verl 0.7.1's `load_valuehead_model` with the config's attention instead of a hard-coded flash_attention_2."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        local_path,
        torch_dtype=torch_dtype,
        config=model_config,
        attn_implementation=model_config._attn_implementation,
        trust_remote_code=trust_remote_code,
    )


@contextlib.contextmanager
def verl_on_cpu() -> Iterator[None]:
    """What verl 0.7.1 hard-codes for CUDA, redirected for a CPU run: its value-model loader forces
    flash_attention_2 (here: the configured sdpa), and its FLOPs counter asks CUDA for the device name (verl's own
    critic-worker test patches the same call)."""
    device = mock.MagicMock()
    device.get_device_name.return_value = "CPU"
    with (
        mock.patch("verl.utils.model.load_valuehead_model", _sdpa_valuehead_loader),
        mock.patch("verl.utils.flops_counter.get_torch_device", return_value=device),
    ):
        yield


class _TorchWithoutAutocast:
    """`torch` as verl's critic module sees it, with `autocast` a no-op (everything else is torch's)."""

    @staticmethod
    def autocast(*args, **kwargs):
        return contextlib.nullcontext()

    def __getattr__(self, name: str):
        return getattr(torch, name)


@contextlib.contextmanager
def verl_critic_in_fp32() -> Iterator[None]:
    """verl's critic hard-codes `torch.autocast(dtype=torch.bfloat16)` around its forward (on CPU too); the fp32
    comparisons switch that off, in verl's critic module only."""
    with mock.patch("verl.workers.critic.dp_critic.torch", _TorchWithoutAutocast()):
        yield


@contextlib.contextmanager
def critic_class(cls: type) -> Iterator[None]:
    """Make verl's `CriticWorker.init_model` construct `cls` (it imports the name from `verl.workers.critic`)."""
    with mock.patch("verl.workers.critic.DataParallelPPOCritic", cls):
        yield


def make_worker(model_dir: Path, critic: type = OursInVerl, **settings: object):
    """verl's FSDP `CriticWorker`, from verl's composed config (`cpu_overrides` + `critic.<key>=<value>` settings) as
    verl's trainer hands it over, after `init_model`, with `critic` inside."""
    from verl.workers.fsdp_workers import CriticWorker

    config = critic_dataclass(composed(cpu_overrides(Path(model_dir), **settings)))
    with verl_on_cpu(), critic_class(critic):
        worker = CriticWorker(config)
        worker.init_model()
    return worker


def worker_values(worker, data: DataProto) -> torch.Tensor:
    """`CriticWorker.compute_values` (verl's critic in fp32), on a copy: verl's worker writes into `meta_info`."""
    with verl_critic_in_fp32():
        return worker.compute_values(copy.deepcopy(data)).batch["values"]


def worker_update(worker, data: DataProto) -> dict:
    """`CriticWorker.update_critic`'s metrics (verl's critic in fp32)."""
    with verl_on_cpu(), verl_critic_in_fp32():
        return worker.update_critic(copy.deepcopy(data)).meta_info["metrics"]


def rollout(batch_size: int, prompt_len: int = 6, response_len: int = 5, seed: int = 0, meta=None) -> DataProto:
    """A rollout batch as verl's trainer builds it: left-padded prompts, right-padded responses (every row has at
    least one prompt and one response token), position ids, response mask, old values and returns."""
    g = torch.Generator().manual_seed(seed)
    t = prompt_len + response_len
    input_ids = torch.randint(3, VOCAB, (batch_size, t), generator=g)
    attention_mask = torch.ones(batch_size, t, dtype=torch.long)
    for i in range(batch_size):
        attention_mask[i, : int(torch.randint(0, prompt_len, (1,), generator=g))] = 0
        attention_mask[i, prompt_len + int(torch.randint(1, response_len + 1, (1,), generator=g)) :] = 0
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, -response_len:],
        "response_mask": attention_mask[:, -response_len:].float(),
        "values": torch.randn(batch_size, response_len, generator=g) * 0.5,
        "returns": torch.randn(batch_size, response_len, generator=g),
    }
    info = {"global_token_num": attention_mask.sum(-1).tolist(), **(meta or {})}
    return DataProto(batch=TensorDict(tensors, batch_size=[batch_size]), meta_info=info)


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters of a plain or FSDP2 module, as CPU copies."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in full.items()}


def rel_change(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    """|Δa − Δb| / |Δb| over all parameters: how far one update is from another, from the same start."""
    da = torch.cat([(a[k] - before[k]).flatten().double() for k in before])
    db = torch.cat([(b[k] - before[k]).flatten().double() for k in before])
    return float((da - db).norm() / db.norm())
