"""The main job: train a critic on a built-in task (or a rollout file) and judge it on a held-out set.

One iteration: draw rollouts → `compute_values` → GAE (`gamma`, `lam`) → `update_critic` → every `eval_every`
steps, explained variance of the values against the true values (built-in tasks) and the Monte-Carlo returns.
Under `task.drift` the built-in task's policy moves: iteration k's rollouts and the evaluation at step k come from
`task.at(k)`, and the last row adds how the critic tracked it (`tracking_metrics`).
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ppo_critic.algos import (
    compute_gae_advantage_return,
    explained_variance,
    length_adaptive_lambda,
    masked_mean,
    shared_prefix_mean,
)
from ppo_critic.config.train import TrainConfig, TrainerConfig, max_row_tokens, resolve_model
from ppo_critic.moving import ReplaySource, SurpriseSchedule
from ppo_critic.moving.surprise import row_residuals
from ppo_critic.parallel.mesh import init_distributed
from ppo_critic.run import console, rundir
from ppo_critic.run.lifecycle import Run
from ppo_critic.run.runlog import RunLog
from ppo_critic.tasks import TASKS
from ppo_critic.worker import CriticWorker


def critic_returns(
    batch: dict[str, Tensor], values: Tensor, t: TrainerConfig, step: int, monte_carlo: bool = False
) -> Tensor:
    """The critic's regression targets: GAE returns bootstrapped from `values`, with the λ of `t` at `step`
    (Monte-Carlo during `critic_warmup_steps` or when asked, then the length-adaptive rule or `lam`), averaged over
    the states rows share under `shared_prefix_returns`."""
    rewards, mask = batch["token_level_rewards"], batch["response_mask"]
    if monte_carlo or step < t.critic_warmup_steps:
        lam = 1.0
    elif t.length_adaptive_alpha is not None:
        lam = length_adaptive_lambda(mask, t.length_adaptive_alpha, gamma=t.gamma, scope=t.length_adaptive_scope)
    else:
        lam = t.lam
    returns = compute_gae_advantage_return(rewards, values, mask, t.gamma, lam)[1]
    if t.shared_prefix_returns:
        returns = shared_prefix_mean(returns, batch["input_ids"], batch["attention_mask"], mask)
    return returns


# what the built-in trainer regresses on: (batch, its values, the trainer's options, the worker's step) -> [B, R]
Targets = Callable[[dict[str, Tensor], Tensor, TrainerConfig, int], Tensor]


RECOVERED_EV = 0.9
"""The EV a critic is back at, after an abrupt change of the policy, when it has recovered (`tracking_metrics`)."""


def tracking_metrics(
    curve: list[tuple[int, float]], warmup: int, changed_at: int | None = None, recovered: float = RECOVERED_EV
) -> dict[str, float]:
    """How a critic follows a moving policy, from its evaluations `curve` [(step, EV)]: `tracking_ev` (the mean EV of
    the evaluations at steps >= `warmup`) and `worst_ev` (their least); after an abrupt change of the policy at
    iteration `changed_at`, `recover_steps`: iterations from it to the first evaluation at EV >= `recovered` (0 if
    none fell below; inf: not back by the last). Empty when nothing was evaluated after the warm-up."""
    after = [ev for step, ev in curve if step >= warmup]
    if not after:
        return {}
    metrics = {"tracking_ev": sum(after) / len(after), "worst_ev": min(after)}
    since = sorted((step, ev) for step, ev in curve if changed_at is not None and step >= changed_at)
    if since:
        back = next((step for step, ev in since if ev >= recovered), None)
        metrics["recover_steps"] = math.inf if back is None else float(back - changed_at)
    return metrics


class TaskSource:
    """Rollouts drawn on the fly from a built-in task, iteration k's from `task.at(k)` (its policy under
    `task.drift`); the held-out set comes from a separate seed, drawn from the policy of each evaluation's step."""

    def __init__(self, cfg: TrainConfig):
        name = cfg.task.get("name", "counting")
        self.name = f"task {name}"
        self.task = TASKS[name][0](cfg.task_config())
        self.batch_size, self.gamma = cfg.trainer.rollout_batch_size, cfg.trainer.gamma
        self.group = cfg.critic.rollout_n  # responses per prompt, in consecutive rows
        self.generator = torch.Generator().manual_seed(cfg.trainer.seed)
        self.held_out_seed, self.eval_size = cfg.trainer.seed + 1_000_003, cfg.trainer.eval_size
        self.eval_batch = self._held_out(self.task)
        self.eval_name = f"{cfg.trainer.eval_size} held-out rollouts of the {name} task (another seed)"
        if self.drifting:
            self.eval_name += ", drawn from the policy of each evaluation's step"
        self.vocab_size = self.task.vocab_size
        self.max_length = self.task.prompt_width + self.task.response_width
        self.step = 0  # the iteration whose rollouts `next_batch` draws
        self.notes: list[str] = []
        self.resume_note: str | None = None
        self.evals: list[tuple[int, float]] = []  # (step, eval/ev_true) under a drift, for `tracking`
        self._eval_at: tuple[Any, dict[str, Tensor]] = (self.task, self.eval_batch)

    @property
    def drifting(self) -> bool:
        """Whether the task's policy moves (`task.drift` is not none)."""
        return self.task.config.drift != "none"

    def next_batch(self) -> dict[str, Tensor]:
        batch = self.draw(self.step, self.generator)
        self.step += 1
        return batch

    def draw(self, step: int, generator: torch.Generator) -> dict[str, Tensor]:
        """Iteration `step`'s rollouts, drawn with `generator` (the same state draws the same rows)."""
        return self.task.at(step).sample(self.batch_size, generator, self.group)

    def evaluation_batch(self, step: int) -> dict[str, Tensor]:
        """The held-out set of the policy of iteration `step` (the one the critic values next): the same rows for a
        fixed policy; under a drift redrawn from the same seed, so it depends on the seed and the step alone."""
        task = self.task.at(step)
        if task is not self._eval_at[0]:
            self._eval_at = (task, self._held_out(task))
        return self._eval_at[1]

    def tracking(self, step: int, metrics: dict[str, float], last: bool) -> dict[str, float]:
        """Under a drift, record the evaluation of `step`; at the `last` step, `tracking_metrics` over the run since
        `task.drift_start` (recovery after a drift=step), as `eval/...` metrics."""
        if not self.drifting or "eval/ev_true" not in metrics:
            return {}
        self.evals.append((step, metrics["eval/ev_true"]))
        c = self.task.config
        tracked = tracking_metrics(self.evals, c.drift_start, c.drift_start if c.drift == "step" else None)
        return {f"eval/{key}": value for key, value in tracked.items()} if last else {}

    def _held_out(self, task: Any) -> dict[str, Tensor]:
        """`eval_size` rollouts of `task` from the held-out seed, with their true values under the run's gamma."""
        batch = task.sample(self.eval_size, torch.Generator().manual_seed(self.held_out_seed))
        batch["true_values"] = task.true_values(batch, self.gamma)
        return batch

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        state: dict[str, Any] = {"data_source": self.name}
        if self.drifting:
            state["drift_evals"] = self.evals
        return {"data/generator": self.generator.get_state()}, state

    def check_state(self, state: dict[str, Any]) -> None:
        _same_source(self.name, state)

    def load_state(self, tensors: dict[str, Tensor], state: dict[str, Any]) -> None:
        self.generator.set_state(tensors["data/generator"])
        self.step = int(state["worker_step"])
        self.evals = [(int(step), float(ev)) for step, ev in state.get("drift_evals", [])]


class FileSource:
    """Recorded rollouts, cycled in file order. The evaluation set is never trained on: `trainer.eval_data`, or a
    seeded `trainer.eval_fraction` of the file's rows held out (up to `eval_size` of them evaluated), or none."""

    def __init__(self, cfg: TrainConfig):
        from ppo_critic.data.rows import collate, fingerprint
        from ppo_critic.rollout_files.read import read_rollouts, tokenizer_dir

        t = cfg.trainer
        self.collate = collate
        self.name = f"data={cfg.data}"
        self.notes: list[str] = []  # what the run says of its rollouts before it starts
        self.resume_note: str | None = None  # what it says of rows changed since the checkpoint resumed from
        tokenizer, positions = tokenizer_dir(cfg.critic.model), max_row_tokens(cfg)
        read = functools.partial(read_rollouts, tokenizer=tokenizer, max_length=positions)
        rows = read(cfg.data)
        if t.eval_data:
            eval_rows, self.rows = read(t.eval_data), rows
            what = f"rows of eval_data={t.eval_data}"
            self.notes += filter(None, [overlap_warning(cfg.data, t.eval_data, self.rows, eval_rows)])
        else:
            eval_rows, self.rows = held_out_split(rows, t.eval_fraction, t.seed)
            what = f"rows of {cfg.data} held out (eval_fraction={t.eval_fraction}, seed {t.seed}; never trained on)"
        evaluated = eval_rows[: t.eval_size]
        self.eval_batch = collate(evaluated) if evaluated else None
        self.eval_name = f"{len(evaluated)} {what}" if evaluated else None
        self.batch_size = t.rollout_batch_size
        self.position = 0
        self.rows_total, self.fingerprint = len(rows), fingerprint(rows)
        self.split = not t.eval_data and t.eval_fraction > 0  # the held-out rows depend on the file's rows
        self.vocab_size = 1 + max(max(r.prompt_ids + r.response_ids) for r in self.rows + eval_rows)
        self.max_length = max(len(r.prompt_ids) + len(r.response_ids) for r in self.rows + eval_rows)

    def evaluation_batch(self, step: int) -> dict[str, Tensor] | None:
        """The held-out rows, the same at every step."""
        return self.eval_batch

    def tracking(self, step: int, metrics: dict[str, float], last: bool) -> dict[str, float]:
        """Nothing: recorded rollouts do not drift."""
        return {}

    def next_batch(self) -> dict[str, Tensor]:
        rows = [self.rows[(self.position + i) % len(self.rows)] for i in range(self.batch_size)]
        self.position = (self.position + self.batch_size) % len(self.rows)
        return self.collate(rows)

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        rows = {"data_rows": self.rows_total, "data_fingerprint": self.fingerprint}
        return {}, {"data_source": self.name, "data_position": self.position, **rows}

    def check_state(self, state: dict[str, Any]) -> None:
        _same_source(self.name, state)
        self.resume_note = self._check_rows(state)
        position = state.get("data_position")
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < len(self.rows):
            raise ValueError(f"the checkpoint's data_position={position!r} is not a row of {self.name}")

    def _check_rows(self, state: dict[str, Any]) -> str | None:
        """Rows that changed since the checkpoint: refused where the held-out split depends on them (trained rows
        could be held out), else what to say (None: unchanged, or a checkpoint from before fingerprints)."""
        saved = state.get("data_fingerprint")
        if saved is None or saved == self.fingerprint:
            return None
        what = f"{self.name} changed since the checkpoint ({state.get('data_rows')} rows then, {self.rows_total} now)"
        if self.split:
            raise ValueError(
                f"{what}: trainer.eval_fraction would now hold out other rows, some of them trained on. Resume with "
                "the rows as they were, or start a new run (another trainer.run_dir)"
            )
        return f"note: {what}; training goes on over the rows as they are now"

    def load_state(self, tensors: dict[str, Tensor], state: dict[str, Any]) -> None:
        self.position = int(state["data_position"])


def overlap_warning(data: str, eval_data: str, rows: list, eval_rows: list) -> str | None:
    """`trainer.eval_data` that is the training rows (the same file, or a copy) is refused: nothing held out would
    be measured; some rows in common are said with their numbers (None: none)."""
    from ppo_critic.data.rows import row_key

    trained = {row_key(r) for r in rows}
    common = sum(row_key(r) in trained for r in eval_rows)
    if common and common == len(eval_rows):
        raise ValueError(
            f"every row of trainer.eval_data={eval_data} is also a row of data={data}: the evaluation would measure "
            "rows trained on. Give rollouts kept out of training, or drop eval_data to hold out trainer.eval_fraction"
        )
    if common:
        return f"note: {common} of the {len(eval_rows)} rows of eval_data={eval_data} are also rows of data={data}"
    return None


def held_out_split(rows: list, fraction: float, seed: int) -> tuple[list, list]:
    """`(held_out, train)`: a seeded random `fraction` of the rows (at least one when `fraction` > 0) and the rest,
    both in file order; the same seed always holds out the same rows."""
    count = math.ceil(fraction * len(rows)) if fraction > 0 else 0
    if count and count >= len(rows):
        raise ValueError(
            f"trainer.eval_fraction={fraction} leaves no training rows of the {len(rows)} in the file; lower it, or "
            "give trainer.eval_data"
        )
    chosen = set(torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:count].tolist())
    return [r for i, r in enumerate(rows) if i in chosen], [r for i, r in enumerate(rows) if i not in chosen]


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


def make_worker(cfg: TrainConfig) -> CriticWorker:
    t = cfg.trainer
    return CriticWorker(cfg.critic, total_steps=t.steps, device=t.device, seed=t.seed, dist_timeout_s=t.dist_timeout_s)


def evaluate(worker: CriticWorker, batch: dict[str, Tensor], gamma: float, live: bool = False) -> dict[str, float]:
    """Explained variance of the critic's values against Monte-Carlo returns (and true values when known; with
    `live`, under `ema_decay`, also the live weights', `eval/ev_true_live`)."""
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
        live_values = worker.compute_live_values(batch) if live else None  # beside the average (docs/QUALITY.md)
        if live_values is not None:
            metrics["eval/ev_true_live"] = explained_variance(live_values, truth, mask).item()
    return metrics


def train(
    cfg: TrainConfig,
    out: Any = None,
    on_step: Callable[[int, dict[str, float], float], None] | None = None,
    overwrite: bool = False,
    targets: Targets = critic_returns,
) -> dict[str, float]:
    """Run (or resume) the job in `cfg.trainer.run_dir`; returns the last metrics row.

    The run directory has one writer (a lock); a new run never starts over an existing one (`overwrite` moves it
    aside); a resumed run starts from the newest checkpoint that verifies, with only the options of
    `rundir.changeable_on_resume` allowed to differ from the saved ones (`run.lifecycle.Run`). Under torchrun every
    rank trains its share; the first rank alone writes files and prints. `on_step(step, metrics, train_s)` is called
    after every step (benchmarks): `train_s` is the wall time spent in training iterations so far in this call.
    `targets` are what the critic regresses on (default: `critic_returns`; benchmarks pass e.g. a task's exact values).
    """
    if init_distributed(cfg.trainer.dist_timeout_s):  # under torchrun: every rank checks the others' options first
        rundir.same_options(cfg.to_dict())
    source = make_source(cfg)
    cfg = resolve_model(cfg, source.vocab_size, source.max_length)
    worker = make_worker(cfg)
    t = cfg.trainer
    if t.export_hf:  # an export that would be refused at the last step is refused before the first
        worker.check_exportable()
    schedule = SurpriseSchedule(t.surprise_z, t.surprise_steps, t.surprise_lr_scale) if t.surprise_z else None
    out = out or sys.stdout
    say = functools.partial(print, file=out) if worker.rank == 0 else lambda *_: None  # the first rank alone prints
    with Run(cfg.trainer, worker.rank == 0, say).claim(overwrite) as run:
        try:
            _resume(worker, source, schedule, cfg, run)
            if worker.step >= cfg.trainer.steps:
                return run.complete(worker.step, _exporter(worker), run_title(cfg, source), source.eval_name)
            run.start(cfg.to_dict(), worker.step)
            return _loop(worker, source, schedule, cfg, run, out, on_step, targets)
        except KeyboardInterrupt as interrupt:
            raise Interrupted(
                f"interrupted at step {worker.step}; nothing partial was saved. Run the same command to resume from "
                f"{run.resumes_from(worker.step)}"
            ) from interrupt


class Interrupted(RuntimeError):
    """Ctrl-C or SIGTERM during training: says which step a rerun resumes from."""


def make_source(cfg: TrainConfig) -> TaskSource | FileSource | ReplaySource:
    """The rollouts of the run: a data= file or the built-in task, the latter with its replay window under
    `trainer.replay_rows`."""
    if cfg.data:
        return FileSource(cfg)
    t, source, rows = cfg.trainer, TaskSource(cfg), cfg.replayed_rows()
    if not rows:
        return source
    return ReplaySource(source, rows, t.replay_window, t.replay_decay, cfg.critic.rollout_n, t.seed)


Source = TaskSource | FileSource | ReplaySource


def _resume(
    worker: CriticWorker, source: Source, schedule: SurpriseSchedule | None, cfg: TrainConfig, run: Run
) -> None:
    """Say what runs, refuse options that cannot change, and resume from the checkpoint `trainer.resume` names."""
    run.say(f"run: {run_title(cfg, source)}, {cfg.trainer.steps} steps")
    run.say(f"every option: {run.path / 'config.yaml'} once the run starts (`ppo-critic train --print-config`)")
    run.say(f"rollouts: {source.name}; evaluation: {source.eval_name or 'none (no evaluation set)'}")
    for note in source.notes:
        run.say(note)
    run.check_options(cfg.to_dict(), cfg.critic.strategy)
    resumed = run.resume(functools.partial(_load, worker, source, schedule, run.say))
    if resumed is not None and "critic.optim.lr" in run.changes:
        worker.set_learning_rate(cfg.critic.optim.lr)
    if source.resume_note:
        run.say(source.resume_note)


def _load(
    worker: CriticWorker,
    source: Source,
    schedule: SurpriseSchedule | None,
    say: Callable[[str], None],
    checkpoint: Path,
) -> Path:
    """Load `checkpoint` into the worker, the rollout source and the surprise schedule (nothing changes unless the
    worker and the source accept it)."""
    tensors, state = worker.load_checkpoint(checkpoint, source.state()[0], check_state=source.check_state)
    source.load_state(tensors, state)
    if schedule is not None:
        schedule.load_state(state)
    say(f"resumed from {checkpoint} at step {worker.step}")
    return checkpoint


def _exporter(worker: CriticWorker) -> Callable[[Path], Path]:
    """The run's HF export: into its own `hf`, replacing one an earlier call of the run wrote."""
    return functools.partial(worker.export_hf, replace=True)


def _loop(
    worker: CriticWorker,
    source: Source,
    schedule: SurpriseSchedule | None,
    cfg: TrainConfig,
    run: Run,
    out: Any,
    on_step: Callable[[int, dict[str, float], float], None] | None,
    targets: Targets,
) -> dict[str, float]:
    """Steps from the worker's current one to `trainer.steps`: metrics, evaluation, checkpoints, the HF export."""
    t = cfg.trainer
    lead = worker.rank == 0
    log = RunLog(run.path, worker.step, t.logger, t.project_name, t.experiment_name, cfg.to_dict()) if lead else None
    metrics: dict[str, float] = {}
    mode = console.mode_for(lead and "console" in t.logger, t.progress, out)
    progress = console.Progress(mode, t.steps, worker.step, t.log_every, out)
    train_s = 0.0
    try:
        while worker.step < t.steps:
            start = time.perf_counter()
            metrics = _iteration(worker, source, t, targets, schedule)
            train_s += time.perf_counter() - start
            step = worker.step
            if source.eval_batch is not None and (step % t.eval_every == 0 or step == t.steps):
                metrics |= evaluate(worker, source.evaluation_batch(step), t.gamma, t.eval_live_weights)
                metrics |= source.tracking(step, metrics, last=step == t.steps)
            if log is not None:
                log.log(step, metrics)
            progress.update(step, metrics)
            if on_step is not None:
                on_step(step, metrics, train_s)
            if (t.save_every and step % t.save_every == 0) or step == t.steps:
                tensors, state = source.state()
                state |= schedule.state() if schedule is not None else {}
                worker.save_checkpoint(run.checkpoints, tensors, state, keep_last_n=t.keep_last_n or None)
    finally:
        progress.close()
        if log is not None:
            log.close()
    run.finish(worker.step, _exporter(worker), run_title(cfg, source), source.eval_name)
    run.say(console.summary("done", worker.step, metrics, source.eval_name) + f" | {run.path}")
    return metrics


def run_title(cfg: TrainConfig, source: Source) -> str:
    """The run and its key settings, for the curves' title: where, what data, which model, rate, averaging, λ."""
    model = cfg.critic.model
    shape = model.override_config
    what = Path(model.path).name if model.path else f"{shape.get('model_type')} {shape.get('hidden_size')}×"
    what += "" if model.path else f"{shape.get('num_hidden_layers')}"
    t = cfg.trainer
    length = ("" if t.length_adaptive_scope == "response" else "mean ") + ("l" if t.gamma == 1 else "l_γ")
    lam = f"1−1/({t.length_adaptive_alpha:g}·{length})" if t.length_adaptive_alpha is not None else f"{t.lam:g}"
    return (
        f"{t.run_dir} — {source.name}, {what}, lr {cfg.critic.optim.lr:g}, ema {cfg.critic.ema_decay:g}, "
        f"λ {lam}, γ {t.gamma:g}"
    )


def _iteration(
    worker: CriticWorker,
    source: Source,
    t: TrainerConfig,
    targets: Targets = critic_returns,
    schedule: SurpriseSchedule | None = None,
) -> dict[str, float]:
    """One step: rollouts (replayed ones first under `replay_rows`), their values, the `targets` regressed on, one
    `update_critic` (at a raised rate while the surprise `schedule` reacts)."""
    batch = source.next_batch()
    batch["values"] = worker.compute_values(batch)
    batch["returns"] = targets(batch, batch["values"], t, worker.step)
    replaying = isinstance(source, ReplaySource)
    replayed = source.replayed if replaying else 0  # rows ahead of the fresh ones
    reaction = _surprise(worker, schedule, batch, replayed) if schedule is not None else {}
    reacting = bool(reaction.get("surprise/reacting"))
    if reacting and t.surprise_mc_targets:  # no bootstrap from the values of the policy before the change
        batch["returns"] = critic_returns(batch, batch["values"], t, worker.step, monte_carlo=True)
    metrics = worker.update_critic(batch, lr_scale=t.surprise_lr_scale if reacting else 1.0)
    return metrics | reaction | ({"replay/rows": float(replayed)} if replaying else {})


def _surprise(worker: CriticWorker, schedule: SurpriseSchedule, batch: dict[str, Tensor], replayed: int) -> dict:
    """Score the fresh rows' residuals (targets − values) before the update; on a surprise restart the weight
    average. Returns the metrics; `surprise/reacting` says whether this update is one of the reaction's."""
    fresh = slice(replayed, None)
    residual, error = row_residuals(batch["returns"][fresh], batch["values"][fresh], batch["response_mask"][fresh])
    z = schedule.score(residual, error)
    surprised = schedule.observe(residual, error)
    if surprised:
        worker.restart_average()
    reacting = float(schedule.reacting())
    return {
        "surprise/residual": residual,
        "surprise/z": z,
        "surprise/reacted": float(surprised),
        "surprise/reacting": reacting,
    }
