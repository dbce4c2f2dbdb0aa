"""ppo-critic inside verl's own critic worker: a few PPO critic steps, printing verl's metric dict.

verl's trainer hands `config.critic` (its dataclass) to `verl.workers.fsdp_workers.CriticWorker`; with
`VERL_USE_EXTERNAL_MODULES=ppo_critic.integrations.verl` set, that worker builds ppo-critic's critic. This script
does what the trainer does for the critic, in one process (where importing the module is the same as the
variable): build the worker from verl's composed config, then per step compute values, GAE returns (verl's own
function) and one critic update. The rollouts come from ppo-critic's counting task, whose true values are known, so
the last line says how much of them the critic explains.

Needs verl 0.7.x (`bash tests/with_verl/run.sh 0.7.1` builds such an environment in .venv-verl-0.7.1):
    .venv-verl-0.7.1/bin/python examples/verl_ppo.py [--steps N] [--model HF_DIR] [--options "ema_decay=0.9"]
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from unittest import mock

import torch
import verl
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.metric_utils import reduce_metrics
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.fsdp_workers import CriticWorker
from verl_common import counting_task, critic_loop, example_args, init_single_process, tiny_critic_dir

import ppo_critic.integrations.verl  # noqa: F401 - what VERL_USE_EXTERNAL_MODULES does in each of verl's processes


def critic_config(model_dir: Path, steps: int):
    """verl's critic section, composed by hydra from the yaml verl ships, as its trainer converts it."""
    config_dir = str(Path(verl.__file__).resolve().parent / "trainer" / "config")
    overrides = [
        "critic.strategy=fsdp2",
        f"actor_rollout_ref.model.path={model_dir}",
        f"critic.model.path={model_dir}",
        "critic.ppo_mini_batch_size=32",
        "critic.ppo_micro_batch_size_per_gpu=16",
        "critic.forward_micro_batch_size_per_gpu=32",
        "critic.optim.lr=1e-3",
        f"critic.optim.total_training_steps={steps}",
    ]
    if not torch.cuda.is_available():  # verl's defaults assume flash-attn and bf16 on a GPU
        overrides += [
            "+critic.model.override_config.attn_implementation=sdpa",
            "+critic.model.fsdp_config.mixed_precision={param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}",
        ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return omega_conf_to_dataclass(compose(config_name="ppo_trainer", overrides=overrides).critic)


def cpu_shims() -> list:
    """On a machine without CUDA, two things verl 0.7.1 hard-codes for CUDA: its value-model loader forces
    flash_attention_2 (use the configured attention instead), and its FLOPs counter asks CUDA for the GPU's name."""
    if torch.cuda.is_available():
        return []
    from transformers import AutoModelForTokenClassification

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        return AutoModelForTokenClassification.from_pretrained(
            local_path, torch_dtype=torch_dtype, config=model_config, trust_remote_code=trust_remote_code
        )

    device = mock.MagicMock()
    device.get_device_name.return_value = "CPU"
    return [
        mock.patch("verl.utils.model.load_valuehead_model", load_valuehead_model),
        mock.patch("verl.utils.flops_counter.get_torch_device", return_value=device),
    ]


def main() -> None:
    args = example_args(__doc__.splitlines()[0])
    init_single_process(port=29511)
    shims = cpu_shims()
    for shim in shims:
        shim.start()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or tiny_critic_dir(Path(tmp), counting_task().vocab_size)
        worker = CriticWorker(critic_config(model_dir, args.steps))
        worker.init_model()
        print(f"verl's CriticWorker runs {type(worker.critic).__module__}.{type(worker.critic).__name__}")
        critic_loop(
            values_of=lambda data: worker.compute_values(data).batch["values"],
            update=lambda data: reduce_metrics(worker.update_critic(data).meta_info["metrics"]),
            steps=args.steps,
            lam=args.lam,
        )
    for shim in shims:
        shim.stop()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
