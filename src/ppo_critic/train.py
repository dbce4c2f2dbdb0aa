"""The main job: train a critic on a built-in task (or a rollout file) and judge it on a held-out set.

One iteration: draw rollouts → `compute_values` → GAE (`gamma`, `lam`) → `update_critic` → every `eval_every`
steps, explained variance of the values against the true values (built-in tasks) and the Monte-Carlo returns.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ppo_critic import rundir
from ppo_critic.algos import compute_gae_advantage_return, explained_variance, masked_mean
from ppo_critic.checkpoint import latest_checkpoint
from ppo_critic.config import CriticConfig, OptimConfig, from_mapping
from ppo_critic.files import write_file
from ppo_critic.rundir import CHANGEABLE_ON_RESUME
from ppo_critic.runlog import CURVES_FILE, METRICS_FILE, RunLog, plot_curves, read_metrics
from ppo_critic.tasks import TASKS
from ppo_critic.worker import CriticWorker, make_critic_worker

MAX_SEED = 2**62  # seeds of torch generators are 64-bit; the held-out set uses seed + a constant
DEFAULT_MODEL = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
}


@dataclass
class TrainerConfig:
    """The loop around the critic. `rollout_batch_size` rollouts per step; checkpoints under `run_dir`.

    `critic_warmup_steps`: during the first N steps the returns are Monte-Carlo (GAE with λ = 1), so an untrained
    critic does not bootstrap from its own values; afterwards GAE uses `lam`. (verl's `trainer.critic_warmup`
    means something else — N steps in which the actor is frozen and only the critic trains; this trainer has no
    actor, so in verl's sense every step is a critic-warmup step.)
    """

    steps: int = 400
    rollout_batch_size: int = 192
    gamma: float = 1.0
    lam: float = 0.5
    critic_warmup_steps: int = 0
    eval_size: int = 512
    eval_every: int = 10
    save_every: int = 50
    keep_last_n: int = 2
    run_dir: str = "runs/default"
    resume: str = "auto"
    seed: int = 0
    device: str = "auto"
    dist_timeout_s: float = 600.0
    progress: bool = True
    tensorboard: bool = True
    export_hf: bool = True


def _default_critic() -> CriticConfig:
    """The critic of `ppo-critic train`: verl's critic defaults with a rate for a small randomly initialised model
    and `ema_decay`; with the trainer's `lam` 0.5 the fastest configuration of the ablation in docs/QUALITY.md."""
    return CriticConfig(
        strategy="none",
        ppo_mini_batch_size=96,
        ppo_micro_batch_size_per_gpu=96,
        ema_decay=0.9,
        optim=OptimConfig(lr=1e-3),
    )


@dataclass
class TrainConfig:
    """Everything `ppo-critic train` reads: the rollout source (`task` or `data`), the critic, the loop."""

    task: dict = field(default_factory=lambda: {"name": "counting", "num_targets": 2, "max_response_len": 12})
    data: str | None = None
    critic: CriticConfig = field(default_factory=_default_critic)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @classmethod
    def from_mapping(cls, data: dict) -> TrainConfig:
        cfg = from_mapping(cls, data)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Check the parts the nested configs cannot see on their own (all errors name the key)."""
        self.critic.validate(prefix="critic.")
        self.task_config()
        t = self.trainer
        for name in ("steps", "rollout_batch_size", "eval_size", "eval_every"):
            if getattr(t, name) < 1:
                raise ValueError(f"trainer.{name}={getattr(t, name)} must be >= 1")
        if t.critic_warmup_steps < 0:
            raise ValueError(f"trainer.critic_warmup_steps={t.critic_warmup_steps} must be >= 0")
        if t.save_every < 0 or t.keep_last_n < 0:
            raise ValueError("trainer.save_every and trainer.keep_last_n must be >= 0 (0: only at the end / keep all)")
        if not (0 <= t.gamma <= 1 and 0 <= t.lam <= 1):
            raise ValueError(f"trainer.gamma={t.gamma} and trainer.lam={t.lam} must be in [0, 1]")
        mini = self.critic.ppo_mini_batch_size * self.critic.rollout_n
        if t.rollout_batch_size % mini:
            raise ValueError(
                f"trainer.rollout_batch_size={t.rollout_batch_size} must be a multiple of critic.ppo_mini_batch_size"
                f"={self.critic.ppo_mini_batch_size} (× rollout_n={self.critic.rollout_n})"
            )
        if not (isinstance(t.dist_timeout_s, int | float) and math.isfinite(t.dist_timeout_s) and t.dist_timeout_s > 0):
            raise ValueError(f"trainer.dist_timeout_s={t.dist_timeout_s} must be a positive number of seconds")
        if not 0 <= t.seed <= MAX_SEED:
            raise ValueError(f"trainer.seed={t.seed} must be in [0, {MAX_SEED}]")
        if t.resume not in ("auto", "never") and not Path(t.resume).is_dir():
            raise ValueError(f"trainer.resume={t.resume!r} must be auto, never or a checkpoint directory")

    def task_config(self) -> Any:
        """The task's own config dataclass, from `task` minus its `name`."""
        fields = dict(self.task)
        name = fields.pop("name", "counting")
        if name not in TASKS:
            raise ValueError(f"task.name={name!r} is unknown; built-in tasks: {sorted(TASKS)}")
        task_cfg = from_mapping(TASKS[name][1], fields, prefix="task.")
        task_cfg.validate()
        return task_cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class TaskSource:
    """Rollouts drawn on the fly from a built-in task; the held-out set comes from a separate seed."""

    def __init__(self, cfg: TrainConfig):
        name = cfg.task.get("name", "counting")
        self.name = f"task {name}"
        self.task = TASKS[name][0](cfg.task_config())
        self.batch_size = cfg.trainer.rollout_batch_size
        self.generator = torch.Generator().manual_seed(cfg.trainer.seed)
        held_out = torch.Generator().manual_seed(cfg.trainer.seed + 1_000_003)
        self.eval_batch = self.task.sample(cfg.trainer.eval_size, held_out)
        self.eval_batch["true_values"] = self.task.true_values(self.eval_batch, cfg.trainer.gamma)
        self.vocab_size = self.task.vocab_size

    def next_batch(self) -> dict[str, Tensor]:
        return self.task.sample(self.batch_size, self.generator)

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        return {"data/generator": self.generator.get_state()}, {"data_source": self.name}

    def check_state(self, state: dict[str, Any]) -> None:
        _same_source(self.name, state)

    def load_state(self, tensors: dict[str, Tensor], state: dict[str, Any]) -> None:
        self.generator.set_state(tensors["data/generator"])


class FileSource:
    """Recorded rollouts, cycled in file order; the first `eval_size` rows double as the evaluation set."""

    def __init__(self, cfg: TrainConfig):
        from ppo_critic.rollouts import collate, read_rollouts

        self.collate = collate
        self.name = f"data={cfg.data}"
        self.rows = read_rollouts(cfg.data)
        self.batch_size = cfg.trainer.rollout_batch_size
        self.position = 0
        self.eval_batch = collate(self.rows[: cfg.trainer.eval_size])
        self.vocab_size = 1 + max(max(r.prompt_ids + r.response_ids) for r in self.rows)

    def next_batch(self) -> dict[str, Tensor]:
        rows = [self.rows[(self.position + i) % len(self.rows)] for i in range(self.batch_size)]
        self.position = (self.position + self.batch_size) % len(self.rows)
        return self.collate(rows)

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        return {}, {"data_source": self.name, "data_position": self.position}

    def check_state(self, state: dict[str, Any]) -> None:
        _same_source(self.name, state)
        position = state.get("data_position")
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < len(self.rows):
            raise ValueError(f"the checkpoint's data_position={position!r} is not a row of {self.name}")

    def load_state(self, tensors: dict[str, Tensor], state: dict[str, Any]) -> None:
        self.position = int(state["data_position"])


def _same_source(name: str, state: dict[str, Any]) -> None:
    """A run resumes on the rollouts it was trained on."""
    saved = state.get("data_source")
    if saved is None:  # older checkpoints tell only the kind of source (a file run saved its data_position)
        from_file = "data_position" in state
        if from_file == name.startswith("data="):
            return
        saved = "a data= file" if from_file else "a built-in task"
    if saved != name:
        raise ValueError(
            f"the checkpoint was written by a run reading {saved}; this run reads {name}. Resume with the same "
            "rollouts, or start a new run (another trainer.run_dir)"
        )


def resolve_model(cfg: TrainConfig, vocab_size: int) -> TrainConfig:
    """Without `critic.model.path`, the model is the built-in tiny `DEFAULT_MODEL` updated by `override_config`,
    with the rollouts' vocabulary size unless one is given. The result is what the run saves and reloads."""
    cfg = copy.deepcopy(cfg)
    model = cfg.critic.model
    if model.path is None:
        model.override_config = {**DEFAULT_MODEL, "vocab_size": vocab_size, **model.override_config}
        if model.override_config["vocab_size"] < vocab_size:
            raise ValueError(
                f"critic.model.override_config.vocab_size={model.override_config['vocab_size']} is smaller than "
                f"the rollouts' vocabulary ({vocab_size} token ids)"
            )
    return cfg


def make_worker(cfg: TrainConfig) -> CriticWorker:
    t = cfg.trainer
    return make_critic_worker(
        cfg.critic, total_steps=t.steps, device=t.device, seed=t.seed, dist_timeout_s=t.dist_timeout_s
    )


def evaluate(worker: CriticWorker, batch: dict[str, Tensor], gamma: float) -> dict[str, float]:
    """Explained variance of the critic's values against Monte-Carlo returns (and true values when known)."""
    values = worker.compute_values(batch)
    mask = batch["response_mask"]
    _, mc_returns = compute_gae_advantage_return(
        batch["token_level_rewards"], torch.zeros_like(values), mask, gamma, 1.0
    )
    metrics = {"eval/ev_returns": explained_variance(values, mc_returns, mask).item()}
    if "true_values" in batch:
        truth = batch["true_values"]
        metrics["eval/ev_true"] = explained_variance(values, truth, mask).item()
        metrics["eval/mae_true"] = masked_mean((values - truth).abs(), mask).item()
    return metrics


def train(
    cfg: TrainConfig,
    out: Any = None,
    on_step: Callable[[int, dict[str, float], float], None] | None = None,
    overwrite: bool = False,
) -> dict[str, float]:
    """Run (or resume) the job in `cfg.trainer.run_dir`; returns the last metrics row.

    The run directory has one writer (a lock); a new run never starts over an existing one (`overwrite` moves it
    aside); a resumed run starts from the newest checkpoint that verifies, with only the options of
    `rundir.CHANGEABLE_ON_RESUME` allowed to differ from the saved ones. Under torchrun every rank trains its share;
    the first rank alone writes files and prints. `on_step(step, metrics, train_s)` is called after every step
    (benchmarks): `train_s` is the wall time spent in training iterations so far in this call.
    """
    from omegaconf import OmegaConf

    t = cfg.trainer
    run_dir = Path(t.run_dir)
    source = FileSource(cfg) if cfg.data else TaskSource(cfg)
    cfg = resolve_model(cfg, source.vocab_size)
    worker = make_worker(cfg)
    lead = worker.rank == 0
    out = (out or sys.stdout) if lead else open(os.devnull, "w")  # noqa: SIM115 - closed with the process
    say = functools.partial(print, file=out)
    lock = rundir.agree(lead, lambda: rundir.claim(run_dir, t.resume, overwrite, say))
    try:
        current = cfg.to_dict()
        say(OmegaConf.to_yaml(OmegaConf.create(current)))
        changeable = CHANGEABLE_ON_RESUME if cfg.critic.strategy != "megatron" else CHANGEABLE_ON_RESUME[:-1]
        changes = {}
        if t.resume != "never":  # options that cannot change mid-run are refused before anything loads
            changes = rundir.agree(lead, lambda: rundir.option_changes(run_dir, current, changeable)) or {}
        resumed = rundir.resume(run_dir / "checkpoints", t.resume, functools.partial(_load, worker, source), say)
        if resumed is not None:
            say(f"resumed from {resumed} at step {worker.step}")
            if "critic.optim.lr" in changes:
                worker.set_learning_rate(cfg.critic.optim.lr)
            if changes:
                say("options changed on resume: " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()))
        if worker.step >= t.steps:
            return _complete(run_dir, worker.step, say)
        if lead:  # after a successful resume only: a refused or failed one leaves the run's files as they were
            write_file(run_dir / rundir.CONFIG_FILE, OmegaConf.to_yaml(OmegaConf.create(current)))
            if resumed is not None and changes:
                rundir.record_changes(run_dir, worker.step, changes)
        return _loop(worker, source, cfg, run_dir, out, on_step)
    except KeyboardInterrupt as interrupt:
        newest = latest_checkpoint(run_dir / "checkpoints")
        where = f"step {newest.name.split('_')[-1].lstrip('0') or 0} ({newest})" if newest else "the start"
        raise Interrupted(
            f"interrupted at step {worker.step}; nothing partial was saved. Run the same command to resume from {where}"
        ) from interrupt
    finally:
        if lock is not None:
            lock.release()


class Interrupted(RuntimeError):
    """Ctrl-C or SIGTERM during training: says which step a rerun resumes from."""


def _load(worker: CriticWorker, source: TaskSource | FileSource, checkpoint: Path) -> Path:
    """Load `checkpoint` into the worker and the rollout source (nothing changes unless both accept it)."""
    tensors, state = worker.load_checkpoint(checkpoint, source.state()[0], check_state=source.check_state)
    source.load_state(tensors, state)
    return checkpoint


def _complete(run_dir: Path, step: int, say: Callable[[str], None]) -> dict[str, float]:
    """A run already at its last step: say so, with its final metrics; nothing is written."""
    rows = read_metrics(run_dir / METRICS_FILE)
    final = rows[-1] if rows else {}
    summary = {k: round(v, 4) for k, v in final.items() if k.startswith(("eval/", "critic/vf_loss"))}
    say(f"run complete at step {step}: {summary}")
    return {k: v for k, v in final.items() if k != "step"}


def _loop(
    worker: CriticWorker,
    source: TaskSource | FileSource,
    cfg: TrainConfig,
    run_dir: Path,
    out: Any,
    on_step: Callable[[int, dict[str, float], float], None] | None,
) -> dict[str, float]:
    """Steps from the worker's current one to `trainer.steps`: metrics, evaluation, checkpoints, the HF export."""
    t = cfg.trainer
    lead = worker.rank == 0
    ckpt_root = run_dir / "checkpoints"
    log = RunLog(run_dir, resume_step=worker.step, tensorboard=t.tensorboard) if lead else None
    metrics: dict[str, float] = {}
    progress = _Progress(t, worker.step, enabled=lead)
    train_s = 0.0
    try:
        while worker.step < t.steps:
            start = time.perf_counter()
            metrics = _iteration(worker, source, t)
            train_s += time.perf_counter() - start
            step = worker.step
            if step % t.eval_every == 0 or step == t.steps:
                metrics |= evaluate(worker, source.eval_batch, t.gamma)
            if log is not None:
                log.log(step, metrics)
            progress.update(metrics)
            if on_step is not None:
                on_step(step, metrics, train_s)
            if (t.save_every and step % t.save_every == 0) or step == t.steps:
                tensors, state = source.state()
                worker.save_checkpoint(ckpt_root, tensors, state, keep_last_n=t.keep_last_n or None)
    finally:
        progress.close()
        if log is not None:
            log.close()
    if lead:
        plot_curves(run_dir / METRICS_FILE, run_dir / CURVES_FILE)
    if t.export_hf:
        worker.export_hf(run_dir / "hf", replace=True)  # the run's own export, written by an earlier call
    return metrics


def _iteration(worker: CriticWorker, source: TaskSource | FileSource, t: TrainerConfig) -> dict[str, float]:
    batch = source.next_batch()
    batch["values"] = worker.compute_values(batch)
    lam = 1.0 if worker.step < t.critic_warmup_steps else t.lam  # Monte-Carlo returns while the critic warms up
    _, batch["returns"] = compute_gae_advantage_return(
        batch["token_level_rewards"], batch["values"], batch["response_mask"], t.gamma, lam
    )
    return worker.update_critic(batch)


class _Progress:
    """A tqdm bar (step, loss, explained variance, tokens/s, ETA), or a line every `eval_every` steps."""

    def __init__(self, t: TrainerConfig, start: int, enabled: bool = True):
        from tqdm import tqdm

        disable = not (t.progress and enabled)
        self.bar = tqdm(total=t.steps, initial=start, disable=disable, dynamic_ncols=True, desc="train")
        self.ev = float("nan")

    def update(self, m: dict[str, float]) -> None:
        self.ev = m.get("eval/ev_true", m.get("eval/ev_returns", self.ev))
        self.bar.set_postfix(
            loss=f"{m['critic/vf_loss']:.4f}", ev=f"{self.ev:.3f}", tok_s=f"{m['perf/tokens_per_s']:.0f}", refresh=False
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
