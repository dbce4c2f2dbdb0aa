"""ppo-critic inside verl's own critic worker: a few PPO critic steps, printing verl's metric dict.

verl's trainer hands `config.critic` (its dataclass) to `verl.workers.fsdp_workers.CriticWorker`; with
`VERL_USE_EXTERNAL_MODULES=ppo_critic.integrations.verl` set, that worker builds ppo-critic's critic. This script
does what the trainer does for the critic, in one process (where importing the module is the same as the
variable): build the worker from verl's composed config, then per step compute values, GAE returns (verl's own
function) and one critic update. The rollouts come from ppo-critic's
counting task, whose true values are known, so the last line says how much of them the critic explains.

Needs verl 0.7.x (`bash tests/with_verl/run.sh 0.7.1` builds such an environment in .venv-verl-0.7.1):
    .venv-verl-0.7.1/bin/python examples/verl_ppo.py [--steps N] [--model HF_DIR] [--options "ema_decay=0.9"]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from unittest import mock

import torch
import verl
from hydra import compose, initialize_config_dir
from tensordict import TensorDict
from tiny_critic import tiny_critic_dir
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_gae_advantage_return
from verl.trainer.ppo.metric_utils import reduce_metrics
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.fsdp_workers import CriticWorker

import ppo_critic.integrations.verl  # noqa: F401 - what VERL_USE_EXTERNAL_MODULES does in each of verl's processes
from ppo_critic.algos import explained_variance
from ppo_critic.tasks import CountingTask, CountingTaskConfig


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


def to_data_proto(batch: dict[str, torch.Tensor]) -> DataProto:
    response_mask = batch["attention_mask"][:, -batch["responses"].shape[1] :].float()
    tensors = {**batch, "response_mask": response_mask}
    meta = {"global_token_num": batch["attention_mask"].sum(-1).tolist()}
    return DataProto(batch=TensorDict(tensors, batch_size=[len(response_mask)]), meta_info=meta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", type=Path, help="an HF critic checkpoint (default: a tiny random one)")
    parser.add_argument("--lam", type=float, default=0.5, help="GAE lambda of the critic's returns")
    parser.add_argument(
        "--options", default="ema_decay=0.9", help="ppo-critic's own options for the critics verl builds"
    )
    args = parser.parse_args()
    os.environ["PPO_CRITIC_OPTIONS"] = args.options  # read when verl's worker constructs the critic
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)  # what verl's Ray worker group sets for each worker
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    task = CountingTask(CountingTaskConfig(num_targets=2, max_response_len=12))
    shims = cpu_shims()
    for shim in shims:
        shim.start()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or tiny_critic_dir(Path(tmp), task.vocab_size)
        worker = CriticWorker(critic_config(model_dir, args.steps))
        worker.init_model()
        print(f"verl's CriticWorker runs {type(worker.critic).__module__}.{type(worker.critic).__name__}")
        generator = torch.Generator().manual_seed(0)
        held_out = task.sample(256, generator)
        for step in range(1, args.steps + 1):
            batch = task.sample(64, generator)
            data = to_data_proto(batch)
            values = worker.compute_values(data).batch["values"]
            _, returns = compute_gae_advantage_return(
                batch["token_level_rewards"], values, data.batch["response_mask"], gamma=1.0, lam=args.lam
            )
            data.batch["values"], data.batch["returns"] = values, returns
            metrics = reduce_metrics(worker.update_critic(data).meta_info["metrics"])
            if step == 1 or step % 10 == 0 or step == args.steps:
                shown = {k: round(float(v), 4) for k, v in sorted(metrics.items()) if k.startswith("critic/")}
                print(f"step {step}: {shown}")
        mask = held_out["attention_mask"][:, -held_out["responses"].shape[1] :]
        predicted = worker.compute_values(to_data_proto(held_out)).batch["values"]
        ev = explained_variance(predicted, task.true_values(held_out), mask)
        print(f"explained variance of the true values on {len(mask)} held-out rollouts: {float(ev):.3f}")
    for shim in shims:
        shim.stop()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
