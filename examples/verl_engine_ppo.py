"""ppo-critic as verl ≥ 0.9's critic engine: a few PPO critic updates through verl's own `TrainingWorker` with
`critic.strategy=ppo_critic`, printing verl's metrics.

With ppo-critic installed, `import verl` loads its plugin (entry point `verl.plugins`), which registers the engine;
verl's trainer then builds the critic's `TrainingWorker` with it. This script does what the trainer does for the
critic, in one process: the worker from verl's composed config, then per step values (`infer_batch`), GAE returns
(verl's own function) and one update (`train_mini_batch`) with verl's value loss. The rollouts come from ppo-critic's
counting task, whose true values are known, so the last line says how much of them the critic explains.

Needs verl 0.9.x (`bash tests/with_verl/run.sh 0.9.1` builds such an environment in .venv-verl-0.9.1):
    .venv-verl-0.9.1/bin/python examples/verl_engine_ppo.py [--steps N] [--model HF_DIR] [--options "ema_decay=0.9"]
"""

from __future__ import annotations

import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

if not torch.cuda.is_available():  # verl knows no CPU platform: the test suite's one (test code, not the library)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "with_verl" / "engine"))
    import verl_cpu  # noqa: F401

import verl
from hydra import compose, initialize_config_dir
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.metric import reduce_metrics
from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
from verl.workers.utils.losses import value_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding
from verl_common import counting_task, critic_loop, example_args, init_single_process, tiny_critic_dir


def critic_worker(model_dir: Path, steps: int) -> TrainingWorker:
    """verl's critic `TrainingWorker` as `RayPPOTrainer.init_workers` builds it, with `critic.strategy=ppo_critic`."""
    overrides = [
        "critic.strategy=ppo_critic",
        f"actor_rollout_ref.model.path={model_dir}",
        f"critic.model.path={model_dir}",
        "critic.ppo_mini_batch_size=32",
        "critic.ppo_micro_batch_size_per_gpu=16",  # verl's dataclass wants it; the engine reads critic.fsdp.*
        "+critic.fsdp.use_dynamic_bsz=false",
        "+critic.fsdp.micro_batch_size_per_gpu=16",
        "critic.optim.lr=1e-3",
        f"critic.optim.total_training_steps={steps}",
    ]
    config_dir = str(Path(verl.__file__).resolve().parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = omega_conf_to_dataclass(compose(config_name="ppo_trainer", overrides=overrides).critic)
    cfg.engine.infer_max_token_len_per_gpu = cfg.ppo_infer_max_token_len_per_gpu
    cfg.engine.max_token_len_per_gpu = cfg.ppo_max_token_len_per_gpu
    worker = TrainingWorker(
        TrainingWorkerConfig(
            model_type="value_model",
            model_config=cfg.model,
            engine_config=cfg.engine,
            optimizer_config=cfg.optim,
            checkpoint_config=cfg.checkpoint,
        )
    )
    worker.reset()
    worker.set_loss_fn(partial(value_loss, config=cfg))
    return worker


def values_of(worker: TrainingWorker, data: DataProto) -> torch.Tensor:
    batch = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(batch, compute_loss=False)
    return no_padding_2_padding(tu.get(worker.infer_batch(batch), "values"), batch).float()


def update(worker: TrainingWorker, data: DataProto, mini_batch_size: int) -> dict:
    batch = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        batch,
        global_batch_size=mini_batch_size,
        mini_batch_size=mini_batch_size,
        epochs=1,
        seed=42,
        dataloader_kwargs={"shuffle": False},
    )
    return reduce_metrics(tu.get(worker.train_mini_batch(batch), "metrics"))  # as verl's trainer does


def main() -> None:
    args = example_args(__doc__.splitlines()[0])
    init_single_process(port=29512)
    with tempfile.TemporaryDirectory() as tmp:
        worker = critic_worker(args.model or tiny_critic_dir(Path(tmp), counting_task().vocab_size), args.steps)
        print(f"verl's TrainingWorker runs {type(worker.engine).__module__}.{type(worker.engine).__name__}")
        critic_loop(
            values_of=lambda data: values_of(worker, data),
            update=lambda data: update(worker, data, mini_batch_size=32),
            steps=args.steps,
            lam=args.lam,
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
