"""The verl 0.9.x suite's pieces: verl's `TrainingWorker` built for the critic exactly as verl's trainer builds it
(`critic.strategy=ppo_critic`), the calls the trainer makes (`reset`, `set_loss_fn`, `infer_batch`,
`train_mini_batch`, checkpoints), and ppo-critic's own `DataParallelPPOCritic` on the same weights as the reference.
`verl_cpu` (imported first) gives verl a CPU platform; nothing else of verl is patched."""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path

import pytest
import torch
import verl_cpu  # noqa: F401 - before anything asks verl for its platform
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.metric import reduce_metrics
from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
from verl.workers.utils.losses import value_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from ppo_critic import DataParallelPPOCritic, build_value_model
from verl_shared import composed, hydra_value, params

SGD = {"optim.optimizer": "SGD", "optim.weight_decay": 0.0, "optim.lr": 0.1}
MEASURED = ("perf/", "mfu")  # the machine's measurements (memory, time): no layout reproduces them
# every metric the engine reports is a property of the global mini-batches, whatever the layout: equal to fp32 rounding
# of sums taken in another order
METRICS = {"rel": 1e-5, "abs": 1e-6}


def critic_config(model_dir: Path, **critic: object):
    """verl's critic section (its dataclass, as the trainer converts it) with `critic.<key>=<value>` settings.
    verl's dataclass wants `critic.ppo_micro_batch_size_per_gpu` although its engine reads `critic.fsdp.*`."""
    critic = {"ppo_micro_batch_size_per_gpu": 2, **critic}
    overrides = [
        "critic.strategy=ppo_critic",
        f"actor_rollout_ref.model.path={model_dir}",
        f"critic.model.path={model_dir}",
        # a key verl's yaml lacks (but its dataclass has) is added with hydra's `+`: `+fsdp.micro_batch_size_per_gpu`
        *(f"{'+' * key.startswith('+')}critic.{key.lstrip('+')}={hydra_value(value)}" for key, value in critic.items()),
    ]
    return omega_conf_to_dataclass(composed(overrides).critic)


def training_worker(model_dir: Path, **critic: object) -> TrainingWorker:
    """verl's critic worker as `RayPPOTrainer.init_workers` builds it (one process), after `reset` and
    `set_loss_fn(value_loss)`."""
    cfg = critic_config(model_dir, **critic)
    engine = cfg.engine
    engine.infer_max_token_len_per_gpu = cfg.ppo_infer_max_token_len_per_gpu
    engine.max_token_len_per_gpu = cfg.ppo_max_token_len_per_gpu
    worker = TrainingWorker(
        TrainingWorkerConfig(
            model_type="value_model",
            model_config=cfg.model,
            engine_config=engine,
            optimizer_config=cfg.optim,
            checkpoint_config=cfg.checkpoint,
        )
    )
    worker.reset()
    worker.set_loss_fn(partial(value_loss, config=cfg))
    return worker


def infer_values(worker: TrainingWorker, data: DataProto) -> torch.Tensor | None:
    """Values [B, R] as `RayPPOTrainer._compute_values` gets them (None on a rank that does not report)."""
    batch = left_right_2_no_padding(copy.deepcopy(data).to_tensordict())
    tu.assign_non_tensor(batch, compute_loss=False)
    output = worker.infer_batch(batch)
    return None if output is None else no_padding_2_padding(tu.get(output, "values"), batch).float()


def train(worker: TrainingWorker, data: DataProto, mini_batch_size: int, epochs: int = 1) -> dict | None:
    """One critic update as `RayPPOTrainer._update_critic` makes it (in order: shuffle off); verl's metrics (None on
    a rank that does not report)."""
    batch = left_right_2_no_padding(copy.deepcopy(data).to_tensordict())
    tu.assign_non_tensor(
        batch,
        global_batch_size=mini_batch_size,
        mini_batch_size=mini_batch_size,
        epochs=epochs,
        seed=42,
        dataloader_kwargs={"shuffle": False},
    )
    output = worker.train_mini_batch(batch)
    return None if output is None else tu.get(output, "metrics")


def critic_metrics(metrics: dict | None) -> dict[str, float] | None:
    """verl's metrics of one update reduced as its trainer reduces them, without the machine's measurements."""
    if metrics is None:
        return None
    return {k: float(v) for k, v in reduce_metrics(dict(metrics)).items() if not k.startswith(MEASURED)}


def assert_metrics_equal(got: dict[str, float], want: dict[str, float], name: str = "") -> None:
    """The same keys, each value equal within `METRICS` (every mismatch named: key, got, want)."""
    assert sorted(got) == sorted(want), name
    differ = {k: (got[k], v) for k, v in want.items() if got[k] != pytest.approx(v, **METRICS)}
    assert not differ, f"{name}: {differ}"


def engine_params(worker: TrainingWorker) -> dict[str, torch.Tensor]:
    return params(worker.engine.worker.model)


def reference(model_dir: Path, data: DataProto, mini_batch_size: int, **config: object) -> dict:
    """ppo-critic's `DataParallelPPOCritic` in one process on the same weights and rows: values before, parameters
    before and after one update (SGD at `SGD`'s rate), values after."""
    model = build_value_model(str(model_dir))
    critic = DataParallelPPOCritic(
        {"ppo_mini_batch_size": mini_batch_size, "grad_clip": 1.0, **config},
        model,
        torch.optim.SGD(model.parameters(), lr=SGD["optim.lr"]),
    )
    out = {"values": critic.compute_values(data), "before": params(model)}
    critic.update_critic(data)
    return out | {"after": params(model), "values_after": critic.compute_values(data)}
