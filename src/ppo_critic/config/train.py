"""What `ppo-critic train` reads (`TrainConfig`: the rollout source, the critic, the loop) and its checks, torch-free.

Kept apart from `ppo_critic.train` so that loading, checking and describing options (`--help`, config errors,
`--print-config`) never imports torch. Every field's description is its attribute docstring
(`ppo_critic.config.reference`).
"""

from __future__ import annotations

import codecs
import copy
import dataclasses
import difflib
import io
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ppo_critic.config.critic import CriticConfig, OptimConfig, from_mapping, show
from ppo_critic.config.modes import LENGTH_ADAPTIVE_SCOPES
from ppo_critic.config.tasks import TASK_CONFIGS

MAX_SEED = 2**62  # seeds of torch generators are 64-bit; the held-out set uses seed + a constant
# torch.distributed turns a timeout into a deadline of int64 nanoseconds since the epoch, which end 292 years after
# 1970: a timeout of at most 100 years keeps that deadline representable (and is still "forever" for a job)
MAX_TIMEOUT_S = 100 * 365 * 24 * 3600.0
# a rollout batch holds at least input_ids, attention_mask and position_ids over every token, int64 each
TOKEN_BYTES = 3 * 8
MIN_ROW_TOKENS = 2  # a rollout row has at least one prompt token and one response token
REPLAY_AUTO = "auto"  # trainer.replay_rows chosen by the rollout source (TrainConfig.replayed_rows)
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v2, v1
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
    shared_prefix_returns: bool = False
    """a response position whose state (the attended tokens before it) other rows of the batch share gets the mean
    of their returns as its target: with critic.rollout_n > 1 a group's prompt and common first tokens; the same
    expectation with less noise (docs/QUALITY.md, issue 41's group screen)"""
    replay_rows: int | Literal["auto"] = "auto"
    """rows of the last replay_window batches trained on ahead of each fresh batch (a multiple of
    critic.ppo_mini_batch_size × rollout_n; 0: off): more of the critic's work per rollout, recent rows more often;
    their values and targets are recomputed with the current critic; built-in tasks only. auto: half of
    rollout_batch_size in whole mini-batches (at least one) on a built-in task, 0 with data= (docs/QUALITY.md)"""
    replay_window: int = 4
    """earlier batches replay_rows draws from"""
    replay_decay: float = 0.5
    """in (0, 1]: a batch a iterations old is drawn with weight replay_decay^(a−1) (1: the window alike)"""
    surprise_z: float | None = None
    """when the mean residual (targets − values) of a fresh batch, before its update, jumps more than this many
    standard errors from its running mean (the policy moved), the weight average starts over from the live weights
    and the next surprise_steps updates run at surprise_lr_scale × the rate; null: off (docs/QUALITY.md)"""
    surprise_steps: int = 20
    """updates at the raised rate after a surprise (and batches scored before the first can be one)"""
    surprise_lr_scale: float = 2.0
    """the factor of the rate after a surprise (1: only restart the average)"""
    surprise_mc_targets: bool = False
    """the surprise_steps updates after a surprise regress on Monte-Carlo returns (λ 1), not on returns bootstrapped
    from values of the policy before it"""
    eval_size: int = 512
    """rollouts evaluated: the built-in task's held-out set (drawn from a separate seed); with data=, at most this
    many of the held-out rows"""
    eval_every: int = 10
    """evaluate every N steps, and at the last step"""
    eval_live_weights: bool = False
    """under critic.ema_decay, also score the live weights beside their average on a built-in task
    (eval/ev_true_live: what the average buys); one more forward over the held-out set per evaluation"""
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
    `ema_decay` and PopArt return statistics (outputs kept while the statistics move, the average's too); with the
    trainer's length-adaptive λ and replay window the recipe that did best on the task suite, under a moving policy
    and on a fixed one (docs/QUALITY.md)."""
    return CriticConfig(
        strategy="none",
        ppo_mini_batch_size=96,
        ema_decay=0.9,
        value_norm="popart",
        optim=OptimConfig(lr=5e-4),
    )


@dataclass
class TrainConfig:
    """Everything `ppo-critic train` reads: the rollout source (`task` or `data`), the critic, the loop."""

    task: dict = field(default_factory=lambda: {"name": "counting"})
    """the built-in rollout task, read when data is null: its name and its options"""
    data: str | None = None
    """a rollout file (.jsonl or .parquet, or a directory of .parquet parts) to train on instead of the built-in task"""
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
        for name in ("shared_prefix_returns", "eval_live_weights", "surprise_mc_targets"):
            if not isinstance(getattr(t, name), bool):
                raise ValueError(f"trainer.{name}={getattr(t, name)!r} must be true or false")
        if t.critic_warmup_steps < 0:
            raise ValueError(f"trainer.critic_warmup_steps={t.critic_warmup_steps} must be >= 0")
        if self.critic.targets_lam is not None:  # the trainer computes its critic's targets itself
            raise ValueError(
                f"critic.targets_lam={self.critic.targets_lam} is for verl's trainer; ppo-critic train sets the "
                "critic's λ with trainer.lam (or trainer.length_adaptive_alpha) and its discount with trainer.gamma"
            )
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
        self._check_moving(mini)
        if not (isinstance(t.dist_timeout_s, int | float) and math.isfinite(t.dist_timeout_s) and t.dist_timeout_s > 0):
            raise ValueError(f"trainer.dist_timeout_s={t.dist_timeout_s} must be a positive number of seconds")
        if t.dist_timeout_s > MAX_TIMEOUT_S:
            raise ValueError(
                f"trainer.dist_timeout_s={t.dist_timeout_s:g} is too large: torch.distributed keeps deadlines as int64 "
                f"nanoseconds; use at most {MAX_TIMEOUT_S:g} seconds (100 years)"
            )
        if not 0 <= t.seed <= MAX_SEED:
            raise ValueError(f"trainer.seed={t.seed} must be in [0, {MAX_SEED}]")
        if t.resume not in ("auto", "never") and not Path(t.resume).is_dir():
            raise ValueError(f"trainer.resume={t.resume!r} must be auto, never or a checkpoint directory")
        if not 0 <= t.eval_fraction < 1:
            raise ValueError(f"trainer.eval_fraction={t.eval_fraction} must be in [0, 1) (0: no evaluation)")
        if t.eval_data is not None and self.data is None:
            raise ValueError("trainer.eval_data is read together with data=<rollout file>; set data, or unset it")
        t.logger = check_loggers(t.logger)  # known names, without repeats
        self.check_sizes()

    def replayed_rows(self) -> int:
        """`trainer.replay_rows` in rows, `auto` resolved: half the rollout batch in whole mini-batches (at least
        one) on a built-in task; 0 with data=, whose rows every pass over the file revisits."""
        t = self.trainer
        if t.replay_rows != REPLAY_AUTO:
            return t.replay_rows
        mini = self.critic.ppo_mini_batch_size * self.critic.rollout_n
        return 0 if self.data is not None else max(t.rollout_batch_size // 2 // mini, 1) * mini

    def _check_moving(self, mini: int) -> None:
        """The levers for a moving policy (`ppo_critic.moving`): a replay window of whole mini-batches of a built-in
        task, a surprise schedule with a positive threshold."""
        t = self.trainer
        rows = t.replay_rows
        if rows != REPLAY_AUTO and (rows < 0 or rows % mini):
            raise ValueError(
                f"trainer.replay_rows={rows!r} must be auto, 0 (off) or a multiple of critic.ppo_mini_batch_size"
                f"={self.critic.ppo_mini_batch_size} (× rollout_n={self.critic.rollout_n}): whole mini-batches"
            )
        if rows != REPLAY_AUTO and rows and self.data is not None:
            raise ValueError(
                "trainer.replay_rows replays a built-in task's batches; with data= every pass over the file already "
                "revisits its rows: set trainer.replay_rows=0"
            )
        if t.replay_window < 1 or not 0 < t.replay_decay <= 1:
            raise ValueError(
                f"trainer.replay_window={t.replay_window} must be >= 1 and trainer.replay_decay={t.replay_decay} in "
                "(0, 1]"
            )
        z = t.surprise_z
        if z is not None and not (isinstance(z, int | float) and math.isfinite(z) and z > 0):
            raise ValueError(f"trainer.surprise_z={z!r} must be a number of standard errors > 0, or null (off)")
        if t.surprise_steps < 1 or not (math.isfinite(t.surprise_lr_scale) and t.surprise_lr_scale > 0):
            raise ValueError(
                f"trainer.surprise_steps={t.surprise_steps} must be >= 1 and trainer.surprise_lr_scale="
                f"{t.surprise_lr_scale} a number > 0"
            )

    def check_sizes(self) -> None:
        """Refuse, before anything runs, rollout batches that cannot fit in this machine's memory and task rows longer
        than the model's positions (the rows of a data= file are checked as they are read)."""
        t = self.trainer
        if self.data is not None:  # held-out rows are at most the file's: only the training batch is new memory
            blame = f"trainer.rollout_batch_size={t.rollout_batch_size}"
            check_batch_memory(t.rollout_batch_size, MIN_ROW_TOKENS, blame, f"{t.rollout_batch_size} rollouts a step")
            return
        task_cfg = self.task_config()
        tokens, length_key = task_row_tokens(task_cfg)
        length = f"task.{length_key}={getattr(task_cfg, length_key)}"
        positions = model_positions(self)
        if positions is not None and tokens > positions[0]:
            raise ValueError(
                f"{length}: the task's rows reach at least {tokens} tokens, more than the model's {positions[0]} "
                f"positions ({positions[1]}); use a model with max_position_embeddings >= {tokens}, or shorter rows"
            )
        replayed = self.replayed_rows()
        held = t.replay_window * t.rollout_batch_size + replayed if replayed else 0  # the replay window
        parts = {"rollout_batch_size": t.rollout_batch_size, "eval_size": t.eval_size, "replay_window": held}
        rows = sum(parts.values())
        blame = length
        shortest, memory = task_row_tokens(type(task_cfg)())[0], host_memory() or math.inf
        if batch_bytes(rows, shortest) > memory:  # too many rows: the largest part, the window only if it alone is
            name = max(parts, key=parts.__getitem__)
            if name == "replay_window" and batch_bytes(rows - held, shortest) > memory:
                name = max(("rollout_batch_size", "eval_size"), key=parts.__getitem__)
            blame = f"trainer.{name}={getattr(t, name)}"
        what = f"{rows} rollouts ({t.rollout_batch_size} a step, {t.eval_size} held out"
        what += f", {held} replayed or held to replay)" if held else ")"
        check_batch_memory(rows, tokens, blame, what)

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
    rows = cfg.trainer.rollout_batch_size
    blame = f"trainer.rollout_batch_size={rows}"
    check_batch_memory(rows, max_length, blame, f"{rows} rollouts a step, padded to the longest row,")
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# Sizes: what the rows of a run take, against what the machine and the model can hold


def task_row_tokens(task_cfg: Any) -> tuple[int, str]:
    """At least how wide a built-in task's batches are (its longest prompt plus its longest response: every row is
    padded to that), and the name of the longer of the two options."""
    prompt_key = "max_prompt_len" if hasattr(task_cfg, "max_prompt_len") else "max_distractors"
    prompt, response = getattr(task_cfg, prompt_key), task_cfg.max_response_len
    return prompt + response, prompt_key if prompt >= response else "max_response_len"


def model_positions(cfg: TrainConfig) -> tuple[int, str] | None:
    """The most positions the value model takes and where that is set: critic.model.override_config's
    max_position_embeddings, else the model directory's config.json's (its text config's for a multimodal model);
    None for the built-in model without one (sized to the rollouts) or a directory without a readable config.json."""
    model = cfg.critic.model
    given = model.override_config.get("max_position_embeddings")
    if given is not None:
        return given, "critic.model.override_config.max_position_embeddings"
    if model.path is None:
        return None
    config_file = Path(model.path) / "config.json"
    try:
        hf = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # the worker reports a model directory it cannot load
        return None
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    for key in ("max_position_embeddings", "n_positions"):  # n_positions: GPT-2's name
        value = text.get(key) if isinstance(text, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"{key} in {config_file}"
    return None


def max_row_tokens(cfg: TrainConfig) -> int | None:
    """The longest rollout row the run's model takes (`read_rollouts(max_length=...)`): its positions; None for the
    built-in model without max_position_embeddings, which is sized to the rows (`resolve_model`)."""
    positions = model_positions(cfg)
    return None if positions is None else positions[0]


def batch_bytes(rows: int, tokens: int) -> int:
    """The least memory `rows` rollouts padded to `tokens` tokens take: their token ids, masks and positions."""
    return rows * tokens * TOKEN_BYTES


def host_memory() -> int | None:
    """Bytes of memory this process can ever have: the machine's physical memory (`os.sysconf`), or its cgroup's limit
    when lower; None where neither is known. Rollout batches are built here, on the host, whatever the device."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system, or the names are unknown
        total = 0
    limits = [total] if total > 0 else []
    for limit_file in CGROUP_LIMITS:
        try:
            limits.append(int(Path(limit_file).read_text().strip()))
        except (OSError, ValueError):  # absent, or "max" (no limit)
            continue
    return min(limits) if limits else None


def check_batch_memory(rows: int, tokens: int, blame: str, what: str) -> None:
    """Raise ValueError naming `blame` (`key=value`, the option to lower) when `rows` rollouts of `tokens` tokens cannot
    fit in this machine's memory even before the model runs (`what` says which rollouts)."""
    need, have = batch_bytes(rows, tokens), host_memory()
    if have is not None and need > have:
        raise ValueError(
            f"{blame}: {what} of at least {tokens} tokens need at least {_size(need)} of memory for their token ids, "
            f"masks and positions alone, more than this machine's {_size(have)}; lower {blame.split('=')[0]}"
        )


def _size(n: float) -> str:
    """Bytes in binary units, e.g. 23.5 GiB."""
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"]
    while n >= 1024 and len(units) > 1:
        n, units = n / 1024, units[1:]
    return f"{n:.1f} {units[0]}"


# ---------------------------------------------------------------------------------------------------------------
# Reading options: defaults ← a YAML file ← key=value overrides


def load_options(overrides: list[str], base: dict | None = None, file_options: Any = None) -> TrainConfig:
    """Defaults (or `base`) ← `file_options` (`read_yaml_options`; a dict or an OmegaConf node) ← `key=value`
    overrides (aliases expanded), checked key by key; every problem is one ValueError naming the key and the fix."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged = copy.deepcopy(base) if base is not None else TrainConfig().to_dict()
    if file_options is not None:
        options = OmegaConf.to_container(file_options) if OmegaConf.is_config(file_options) else file_options
        merged = _merged(merged, options)
    for override in overrides:
        merged = _merged(merged, _read_override(override))
    try:
        plain = OmegaConf.to_container(OmegaConf.create(merged), resolve=True)
    except OmegaConfBaseException as err:
        raise ValueError(f"could not read the options: {_one_line(err)}") from err
    return TrainConfig.from_mapping(plain)


def read_yaml_options(path: Path) -> dict:
    """The options of a `--config` file: a YAML mapping; anything else is a ValueError naming the file and the fix."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    text = _config_text(path)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        huge = _huge_integer(root)
        if huge is not None:
            where, digits, mark = huge
            raise ValueError(f"{path}:{mark.line + 1}:{mark.column + 1}: {where}{_too_many_digits(digits)}")
        if root is not None and not isinstance(root, yaml.MappingNode):
            kind = "a list" if isinstance(root, yaml.SequenceNode) else f"a single value ({show(root.value)})"
            raise ValueError(
                f"{path} holds {kind}, not options: a config file maps option names to values, e.g. 'trainer: "
                "{steps: 100}' (see ppo-critic train --print-config)"
            )
        node = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ValueError(f"{where}: not valid YAML ({getattr(err, 'problem', None) or _one_line(err)})") from err
    except OmegaConfBaseException as err:
        raise ValueError(f"{path}: {_one_line(err)}") from err
    except RecursionError:
        raise ValueError(f"{path} nests too deeply to read (thousands of levels); options nest a few levels") from None
    return nested_keys(OmegaConf.to_container(node), str(path))


def nested_keys(tree: dict, where: str, prefix: str = "") -> dict:
    """Dotted keys (`trainer.steps: 3`, as on the command line) read as the nested ones they name; an option given
    twice, dotted and nested, is an error naming it. `override_config` keeps its keys as written."""
    out: dict = {}
    for key, value in tree.items():
        parts = [str(key)] if prefix.endswith("override_config.") else str(key).split(".")
        if isinstance(value, dict):
            value = nested_keys(value, where, f"{prefix}{key}.")
        for part in reversed(parts[1:]):
            value = {part: value}
        _merge_into(out, parts[0], value, where, prefix)
    return out


def _merge_into(node: dict, name: str, value: object, where: str, prefix: str) -> None:
    """`node[name] = value`, merging two spellings of one option group; the same option twice is an error."""
    if name not in node:
        node[name] = value
        return
    if not (isinstance(node[name], dict) and isinstance(value, dict)):
        raise ValueError(f"{where}: {prefix}{name} is given twice (dotted and nested); keep one")
    for key, inner in value.items():
        _merge_into(node[name], key, inner, where, f"{prefix}{name}.")


def _config_text(path: Path) -> str:
    """The text of a `--config` file, UTF-8 (a byte-order mark allowed); a directory, a binary file or UTF-16/32 text
    is an error saying so."""
    if path.is_dir():
        raise ValueError(f"--config {path} is a directory; give the YAML file of options (e.g. {path / 'config.yaml'})")
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    raw = path.read_bytes()
    boms = {"UTF-32": (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE), "UTF-16": (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)}
    for encoding, marks in boms.items():  # UTF-32 first: its little-endian mark starts with UTF-16's
        if raw.startswith(marks):
            raise ValueError(f"{path} is {encoding} text; save it as UTF-8 (e.g. iconv -f {encoding} -t UTF-8)")
    if b"\0" in raw:
        raise ValueError(
            f"{path} is not a text file (it holds NUL bytes: binary, or UTF-16 without a byte-order mark); a config "
            "file is YAML saved as UTF-8"
        )
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        bad = f"byte {err.start} is 0x{raw[err.start]:02x}"
        raise ValueError(f"{path} is not UTF-8 text ({bad}); a config file is YAML saved as UTF-8") from None


PATH_KEYS = ("run_dir", "data", "eval_data", "path", "tokenizer_path", "resume")
"""Options that name a file or directory: a space at an end of one given on the command line is refused, since the
YAML reading of a value drops it (a run would use another path than the one typed)."""


def _read_override(override: str) -> dict:
    """One `key=value` override as a nested dict, its value read as YAML; a ValueError naming it if it cannot be."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    key, value = override.split("=", 1)
    if value != value.strip() and value.strip() and key.rsplit(".", 1)[-1] in PATH_KEYS:
        raise ValueError(
            f"{key}={value!r} has whitespace at an end, which an option's value drops; give the path without it"
        )
    try:
        huge = _huge_integer(yaml.compose(value, Loader=yaml.SafeLoader))
        if huge is not None:
            raise ValueError(f"{key}{huge[0] and '.' + huge[0]}{_too_many_digits(huge[1])}".replace(".[", "["))
        return OmegaConf.to_container(OmegaConf.from_dotlist([override]))
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or _one_line(err)
        raise ValueError(f"{key}={show(value)} is not a valid YAML value ({problem})") from err
    except OmegaConfBaseException as err:
        raise ValueError(f"{show(override)} is not a valid key=value option ({_one_line(err)})") from err


def _huge_integer(node: Any, key: str = "", seen: set[int] | None = None) -> tuple[str, int, Any] | None:
    """The first YAML integer under `node` with more digits than Python reads: (its dotted key, digits, mark)."""
    import yaml

    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    seen = set() if seen is None else seen
    if not limit or node is None or id(node) in seen:  # an alias repeats a node: look at it once
        return None
    seen.add(id(node))
    if isinstance(node, yaml.ScalarNode):
        digits = len(node.value.lstrip("+-").replace("_", ""))
        return (key, digits, node.start_mark) if node.tag.endswith(":int") and digits > limit else None
    if isinstance(node, yaml.MappingNode):
        children = [(f"{key}.{getattr(name, 'value', '?')}".lstrip("."), child) for name, child in node.value]
    else:
        children = [(f"{key}[{i}]", child) for i, child in enumerate(node.value)]
    for child_key, child in children:
        found = _huge_integer(child, child_key, seen)
        if found is not None:
            return found
    return None


def _too_many_digits(digits: int) -> str:
    """The end of the message for an integer longer than Python reads (sys.get_int_max_str_digits)."""
    return f"=<a {digits}-digit integer> is too large to read: an integer option is 64-bit (below 2**63)"


def _merged(base: Any, update: Any) -> Any:
    """`update` over `base`: mappings merged key by key, anything else replaced (as OmegaConf merges, without its type
    errors, so that a wrong type is reported by the option's own check). A null over a mapping (a YAML section whose
    options are all commented out) sets nothing: the section keeps its options, not the library's defaults."""
    if isinstance(base, dict) and update is None:
        return copy.deepcopy(base)
    if not (isinstance(base, dict) and isinstance(update, dict)):
        return copy.deepcopy(update)
    return {**base, **{k: _merged(base.get(k), v) if k in base else copy.deepcopy(v) for k, v in update.items()}}


def _one_line(err: Exception) -> str:
    """An OmegaConf or YAML error in one line: its first line, and the key it concerns when it names one."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    key = getattr(err, "full_key", None)
    return f"{key}: {first}" if key else first


LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")  # what trainer.logger may name


def check_loggers(value: object) -> list[str]:
    """`trainer.logger` as a list of known names, without repeats; a string may name one or several
    (`"console,wandb"`, `"[console, wandb]"`)."""
    if isinstance(value, str):
        value = [part.strip().strip("'\"") for part in value.strip().strip("[]").split(",") if part.strip()]
    if not isinstance(value, Sequence):
        raise ValueError(f"trainer.logger={value!r} must be a list of names from {', '.join(LOGGERS)}")
    names: list[str] = []
    for entry in value:
        name = entry.strip().lower() if isinstance(entry, str) else entry
        if name not in LOGGERS:
            close = difflib.get_close_matches(str(name), LOGGERS, n=1, cutoff=0.75)  # not swanlab -> wandb
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"trainer.logger: unknown logger {entry!r}{hint} (known: {', '.join(LOGGERS)})")
        if name not in names:
            names.append(name)
    return names
