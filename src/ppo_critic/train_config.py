"""What `ppo-critic train` reads (`TrainConfig`: the rollout source, the critic, the loop) and its checks, torch-free.

Kept apart from `ppo_critic.train` so that loading, checking and describing options (`--help`, config errors,
`--print-config`) never imports torch. Every field's description is its attribute docstring (`ppo_critic.options`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppo_critic.config import CriticConfig, OptimConfig, from_mapping
from ppo_critic.loggers import check_loggers
from ppo_critic.modes import LENGTH_ADAPTIVE_SCOPES
from ppo_critic.tasks import TASK_CONFIGS

MAX_SEED = 2**62  # seeds of torch generators are 64-bit; the held-out set uses seed + a constant
# the model of a run without critic.model.path (vocab_size: the rollouts'), see resolve_model
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
    """training steps: rollouts → values → GAE → one update_critic call each"""
    rollout_batch_size: int = 192
    """rollouts per step (a multiple of critic.ppo_mini_batch_size × critic.rollout_n)"""
    gamma: float = 1.0
    """discount factor of the returns (GAE's γ)"""
    lam: float = 1.0
    """the λ of the critic's GAE targets when length_adaptive_alpha is null (1: Monte-Carlo returns, verl's default;
    lower: more bootstrapping from the critic's values)"""
    length_adaptive_alpha: float | None = 0.5
    """VAPO's length-adaptive λ for the critic's targets: λ = 1 − 1/(α·l), l a length in tokens (see
    length_adaptive_scope), clamped to [0, 1], in place of lam (0.5: λ 0.75 at 8 tokens, 0.83 at 12, 0.98 at 96,
    0.99 at 256); with gamma < 1, l is the discounted length (1 − γ^l)/(1 − γ); null: lam for every response"""
    length_adaptive_scope: str = "batch"
    """whose length l is in length_adaptive_alpha's rule: batch (every response gets the λ of the batch's mean
    length) or response (each its own, VAPO's rule: a response's length is a future its first tokens cannot see,
    and where it correlates with the reward, λ by it biases the critic's targets; docs/QUALITY.md)"""
    critic_warmup_steps: int = 0
    """the first N steps use Monte-Carlo returns (λ = 1), not bootstrapped from an untrained critic (not verl's
    trainer.critic_warmup, which freezes an actor)"""
    eval_size: int = 512
    """rollouts evaluated: the built-in task's held-out set (drawn from a separate seed); with data=, at most this
    many of the held-out rows"""
    eval_every: int = 10
    """evaluate every N steps, and at the last step"""
    save_every: int = 50
    """a checkpoint every N steps, and at the last step; 0: only at the last step"""
    keep_last_n: int = 2
    """checkpoints kept (older ones are deleted); 0: keep all"""
    run_dir: str = "runs/default"
    """the run's directory: config.yaml, metrics, checkpoints/, the HF export"""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in run_dir; never: a new run (see --overwrite); or the
    path of a checkpoint to resume from"""
    seed: int = 0
    """seed of the model's initialisation and of the rollouts (the held-out set uses a seed derived from it)"""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N"""
    dist_timeout_s: float = 600.0
    """seconds a rank waits in a collective under torchrun before the job fails"""
    progress: bool = True
    """a progress bar when the output is a terminal"""
    log_every: int = 10
    """a plain progress line every N steps when the output is not a terminal or progress=false"""
    logger: list = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """experiment loggers, a list of: console, jsonl, tensorboard, wandb, mlflow (the last two need the extras of
    the same name: pip install 'ppo-critic[wandb]')"""
    project_name: str = "ppo-critic"
    """the project (wandb) or experiment (mlflow) the run is logged under"""
    experiment_name: str | None = None
    """the run's name in wandb / mlflow; null: the run directory's name"""
    eval_data: str | None = None
    """a rollout file held out for evaluation (with data=)"""
    eval_fraction: float = 0.1
    """with data= and no eval_data: a seeded fraction of the file's rows held out for evaluation, never trained on;
    0: no evaluation"""
    export_hf: bool = True
    """at the end, export the critic as an HF model (safetensors) to run_dir/hf"""


def _default_critic() -> CriticConfig:
    """The critic of `ppo-critic train`: verl's critic defaults with a rate for a small randomly initialised model,
    `ema_decay` and running return statistics; with the trainer's length-adaptive λ the recipe that did best on the
    task suite as a whole (docs/QUALITY.md)."""
    return CriticConfig(
        strategy="none",
        ppo_mini_batch_size=96,
        ema_decay=0.9,
        value_norm="running",
        optim=OptimConfig(lr=5e-4),
    )


@dataclass
class TrainConfig:
    """Everything `ppo-critic train` reads: the rollout source (`task` or `data`), the critic, the loop."""

    task: dict = field(default_factory=lambda: {"name": "counting"})
    """the built-in rollout task, read when data is null: its name and its options"""
    data: str | None = None
    """a rollout file (.jsonl or .parquet) to train on instead of the built-in task"""
    critic: CriticConfig = field(default_factory=_default_critic)
    """verl's critic section: the model, its loss, batching and optimizer"""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """the training loop"""

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
        for name in ("steps", "rollout_batch_size", "eval_size", "eval_every", "log_every"):
            if getattr(t, name) < 1:
                raise ValueError(f"trainer.{name}={getattr(t, name)} must be >= 1")
        if t.critic_warmup_steps < 0:
            raise ValueError(f"trainer.critic_warmup_steps={t.critic_warmup_steps} must be >= 0")
        if t.save_every < 0 or t.keep_last_n < 0:
            raise ValueError("trainer.save_every and trainer.keep_last_n must be >= 0 (0: only at the end / keep all)")
        if not (0 <= t.gamma <= 1 and 0 <= t.lam <= 1):
            raise ValueError(f"trainer.gamma={t.gamma} and trainer.lam={t.lam} must be in [0, 1]")
        alpha = t.length_adaptive_alpha
        if alpha is not None and not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"trainer.length_adaptive_alpha={alpha!r} must be a number > 0, or null (trainer.lam)")
        if t.length_adaptive_scope not in LENGTH_ADAPTIVE_SCOPES:
            raise ValueError(
                f"trainer.length_adaptive_scope={t.length_adaptive_scope!r} must be one of "
                f"{', '.join(LENGTH_ADAPTIVE_SCOPES)}"
            )
        if alpha is not None and t.lam != 1.0:  # lam would be silently unused: each response's λ comes from alpha
            raise ValueError(
                f"trainer.lam={t.lam} has no effect while trainer.length_adaptive_alpha={alpha} sets each response's λ;"
                " set trainer.length_adaptive_alpha=null to use trainer.lam for every response"
            )
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
        if not 0 <= t.eval_fraction < 1:
            raise ValueError(f"trainer.eval_fraction={t.eval_fraction} must be in [0, 1) (0: no evaluation)")
        if t.eval_data is not None and self.data is None:
            raise ValueError("trainer.eval_data is read together with data=<rollout file>; set data, or unset it")
        t.logger = check_loggers(t.logger)  # known names, without repeats

    def task_config(self) -> Any:
        """The task's own config dataclass, from `task` minus its `name`."""
        fields = dict(self.task)
        name = fields.pop("name", "counting")
        if name not in TASK_CONFIGS:
            raise ValueError(f"task.name={name!r} is unknown; built-in tasks: {sorted(TASK_CONFIGS)}")
        task_cfg = from_mapping(TASK_CONFIGS[name], fields, prefix="task.")
        task_cfg.validate()
        return task_cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def resolve_model(cfg: TrainConfig, vocab_size: int, max_length: int = 0) -> TrainConfig:
    """Without `critic.model.path`, the model is the built-in tiny `DEFAULT_MODEL` updated by `override_config`,
    with the rollouts' vocabulary size and (when longer than its default) their longest row as its maximum position,
    unless given. The result is what the run saves and reloads."""
    cfg = copy.deepcopy(cfg)
    model = cfg.critic.model
    if model.path is None:
        positions = max(DEFAULT_MODEL["max_position_embeddings"], max_length)
        given = model.override_config
        model.override_config = {
            **DEFAULT_MODEL, "vocab_size": vocab_size, "max_position_embeddings": positions, **given
        }  # fmt: skip
        if model.override_config["vocab_size"] < vocab_size:
            raise ValueError(
                f"critic.model.override_config.vocab_size={model.override_config['vocab_size']} is smaller than "
                f"the rollouts' vocabulary ({vocab_size} token ids)"
            )
    return cfg
