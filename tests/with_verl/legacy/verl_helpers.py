"""The verl 0.7.x suite's pieces: verl's critic config and worker in one CPU process, and the few patches for what
verl 0.7.1 hard-codes for CUDA (each says what and why); tests/with_verl/verl_shared.py has the rest.

Importing this module installs `ppo_critic.integrations.verl` (as `VERL_USE_EXTERNAL_MODULES` would); a test that
wants verl's own critic inside verl's worker says so with `critic_class(VerlCritic)`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
from omegaconf import DictConfig
from verl import DataProto
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.critic import dp_critic

import ppo_critic.integrations.verl as integration
from verl_shared import composed, hydra_value

VerlCritic = integration.REPLACED[dp_critic.__name__]  # verl's own critic, which the integration replaced
OursInVerl = integration.DataParallelPPOCritic


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
    return base + [f"critic.{key}={hydra_value(value)}" for key, value in critic.items()]


def critic_dataclass(cfg: DictConfig):
    """The critic section as verl's trainer hands it to `CriticWorker`: its config dataclass."""
    return omega_conf_to_dataclass(cfg.critic)


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
