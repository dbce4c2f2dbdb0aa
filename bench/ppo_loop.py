"""PPO at small scale (issue 42): does a better critic make the actor learn faster?

A tiny causal-LM actor (a transformers config built here, as the critic's is) answers a built-in task's prompts with
`generate` (temperature 1, seeded; its tokens restricted to the task's response alphabet), and the task's reward
definition scores what it wrote (`task.rewards`). Every iteration: `batch` responses (`group` per prompt), their
advantages by the method, one pass of verl's clipped policy loss over `mini_batches` (clip 0.2, dual clip 3,
token-mean; `kl_coef` > 0 adds the low-variance KL to the initial actor). Methods:

- `critic:<configuration>`: GAE under the actor's γ and λ from the values of a `CriticWorker` built from
  bench/ablation.py's configuration (its recipe and its own regression targets, `critic_returns` under its λ:
  decoupled from the actor's); the critic is called as verl calls it (`compute_values`, then `update_critic` on the
  batch with `values` and `returns`).
- `mc`: GAE from Monte-Carlo values of the current actor (`mc_samples` continuations of every prefix): what a
  perfect critic would give, at a cost no real run pays.
- `critic_mc:<configuration>`: a learned critic as `critic:` but regressed on those Monte-Carlo values instead of
  returns: what learning the values of a moving actor costs alone (no return noise, no bootstrap error).
- `grpo`: the outcome normalised within each group of `group` responses to one prompt (no critic).
- `reinforce`: the outcome minus the batch mean, over the batch's standard deviation (no critic).

Levers of a learned critic (issue 53), LoopConfig fields: `critic_targets` ("own": its recipe's targets, the built-in
trainer; "actor": the returns of the actor's GAE, what verl's trainer hands a critic), `critic_warmup` (verl's
`trainer.critic_warmup`: the critic learns on the first actor's rollouts, which count; with Monte-Carlo targets over
them, value pretraining), `critic_mini_batches`, `critic_options` (epochs, rate, EMA, PopArt, λ), `critic_init`
("actor": the actor's first weights under a new head). `ours-verl` is ours with only what verl's trainer passes;
`verl_lr*_mb*_ep*` sweeps verl's critic; `<method>+<lever>` changes one lever. The actor's λ is a number or VAPO's
length-adaptive 1 − 1/(α·l) (`lam_alpha`).

Reported: the actor's mean score on held-out prompts (one sampled response each) every `eval_every` iterations, by
iterations and by rollout tokens; iterations to the task's target score; the critic's EV and MSE against
Monte-Carlo values of the current actor on a fixed probe set of prefixes every `probe_every` iterations, with the
targets' variance beside them; wall and critic seconds per iteration.

    OMP_NUM_THREADS=1 python bench/ppo_loop.py --tasks counting --seeds 0 1 2 3 4      # every method, one core
    python bench/ppo_loop.py --report                                                  # tables and curves

Each finished run is appended to `bench/results/ppo/<task>.json` at once (a run already there is not run again).
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import importlib.util
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ppo_critic.algos import (
    compute_gae_advantage_return,
    explained_variance,
    length_adaptive_lambda,
    masked_mean,
    masked_whiten,
)
from ppo_critic.cli import load_config
from ppo_critic.config.train import resolve_model
from ppo_critic.data.rows import rollout_batch
from ppo_critic.moving import draw_replay
from ppo_critic.run.files import write_with
from ppo_critic.tasks import TASKS
from ppo_critic.tasks.common import prefix_mask
from ppo_critic.train import critic_returns, make_worker

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results" / "ppo"
ACTOR_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


@dataclasses.dataclass(frozen=True)
class ActorTask:
    """A suite task as an actor's task: its overrides (the critic's γ among them), how many token ids from 0 a
    response may use, whether its score is per token (dense: the share of liked tokens) or per response, and the
    held-out score that counts as learned."""

    overrides: tuple[str, ...]
    alphabet: str | int  # the task option holding the alphabet's size, "ordinary" (targets + fillers), or the size
    per_token: bool
    target: float
    actor_lr: float
    """the actor's rate, screened at seed 0 with GRPO, REINFORCE and two critics (2026-12-05): the slowest that lets
    the methods reach the target within `iterations`"""
    iterations: int
    gamma: float = 1.0
    lam: float = 0.95
    """the actor's GAE λ"""
    lam_alpha: float | None = None
    """VAPO's length-adaptive actor λ = 1 − 1/(α·l) by each response's length l, in place of `lam`"""
    base: str = ""
    """the suite task it runs (default: its own name)"""
    stop_at_target: bool = False
    """end a run at its first evaluation at the target (the discriminating settings: their cost is the time to it)"""
    loop_options: tuple[tuple[str, Any], ...] = ()
    """other LoopConfig fields the setting sets (the probes' size on long responses)"""


LONG_PROBES = (("probe_rows", 16), ("probe_samples", 16), ("probe_stride", 16), ("eval_every", 5))
ACTOR_TASKS = {
    "counting": ActorTask(("task.name=counting",), "ordinary", False, target=0.8, actor_lr=1e-4, iterations=200),
    "dense": ActorTask(
        ("task.name=dense", "trainer.gamma=0.9"), "num_symbols", True, 0.5, actor_lr=1e-3, iterations=300, gamma=0.9
    ),
    "recall": ActorTask(("task.name=recall",), "num_symbols", False, target=0.9, actor_lr=1e-4, iterations=200),
    # the discriminating settings (issue 53): a fast actor, and long responses whose advantages bootstrap at λ < 1
    "counting_fast": ActorTask(
        ("task.name=counting", "task.min_response_len=8", "task.max_response_len=16", "task.min_count=3"),
        "ordinary", False, 0.8, actor_lr=1e-3, iterations=100, base="counting", stop_at_target=True,
        loop_options=(("batch", 32), ("eval_every", 5)),
    ),
    **{
        f"counting_long{suffix}": ActorTask(
            ("task.name=counting", "task.min_response_len=128", "task.max_response_len=144", "task.min_count=17"),
            "ordinary", False, 0.8, actor_lr=1e-4, iterations=150, lam_alpha=alpha, base="counting",
            stop_at_target=True, loop_options=LONG_PROBES,
        )
        for suffix, alpha in (("", None), ("_vapo", 0.05))
    },
    **{
        f"dense_long{suffix}": ActorTask(
            ("task.name=dense", "trainer.gamma=0.9", "task.min_response_len=128", "task.max_response_len=144"),
            "num_symbols", True, 0.3, actor_lr=1e-3, iterations=150, gamma=0.9, lam_alpha=alpha, base="dense",
            stop_at_target=True, loop_options=LONG_PROBES,
        )
        for suffix, alpha in (("", None), ("_vapo", 0.05))
    },
}  # fmt: skip
BEGIN, END = "<!-- ppo tables: bench/ppo_loop.py --report -->", "<!-- end of ppo tables -->"


@dataclasses.dataclass
class LoopConfig:
    """One PPO run. The defaults are verl's where it has one (clip 0.2, dual clip 3, token-mean, grad clip 1, no KL)."""

    task: str = "counting"
    method: str = "critic:batch_alpha0.5_lr5e-4"
    seed: int = 0
    iterations: int = 200
    batch: int = 96
    """responses per iteration (every method the same: the rollout budget)"""
    group: int = 1
    """responses per prompt, in consecutive rows (GRPO needs >= 2)"""
    mini_batches: int = 2
    actor_lr: float = 1e-3
    lam: float = 0.95
    """the actor's GAE λ (VC-PPO's decoupled actor λ); the critic's targets keep its own recipe's"""
    lam_alpha: float | None = None
    """VAPO's length-adaptive actor λ = 1 − 1/(α·l) by each response's length, in place of `lam`"""
    critic_targets: str = "own"
    """what a learned critic regresses on: "own" (its configuration's recipe: the built-in trainer) or "actor" (the
    returns of the actor's GAE, what verl's trainer hands its critic)"""
    critic_options: tuple[str, ...] = ()
    """overrides of the critic's configuration (its levers), applied last"""
    critic_mini_batches: int = 0
    """the critic's mini-batches per batch (0: the actor's `mini_batches`, as verl's examples set them)"""
    critic_warmup: int = 0
    """iterations at the start whose rollouts train the critic while the actor stays (verl's
    `trainer.critic_warmup`; with Monte-Carlo targets over them: value pretraining); their rollouts count"""
    critic_init: str = "random"
    """"random" (the critic's own initialisation) or "actor" (the actor's first weights under a new value head, as
    a verl user starts a critic from the policy's checkpoint)"""
    stop_at_target: bool = False
    """end the run at its first evaluation at the target"""
    clip: float = 0.2
    clip_c: float = 3.0
    kl_coef: float = 0.0
    mc_samples: int = 8
    eval_every: int = 10
    eval_prompts: int = 256
    probe_every: int = 20
    probe_rows: int = 32
    probe_samples: int = 64
    probe_stride: int = 1
    """the probes compare every `probe_stride`-th response position (long responses: Monte-Carlo values cost
    continuations from every position compared)"""


def _ablation() -> Any:
    """bench/ablation.py as the module `ablation` (its critic configurations), loaded once."""
    if "ablation" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ablation", BENCH / "ablation.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["ablation"] = module
        spec.loader.exec_module(module)
    return sys.modules["ablation"]


# ---------------------------------------------------------------------------------------------------------------
# The actor: a tiny causal LM that writes from the task's response alphabet


def build_actor(vocab_size: int, positions: int, seed: int) -> torch.nn.Module:
    """A qwen2-style causal LM with a zero output layer: its first policy is uniform over the alphabet."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "qwen2", vocab_size=vocab_size, max_position_embeddings=positions, tie_word_embeddings=False, **ACTOR_MODEL
    )
    actor = AutoModelForCausalLM.from_config(config)
    torch.nn.init.zeros_(actor.lm_head.weight)
    actor.generation_config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=vocab_size - 1, use_cache=True
    )
    return actor


def actor_checkpoint(actor: torch.nn.Module, path: Path) -> Path:
    """`path`: the actor saved as a transformers checkpoint (its weights and config), for a critic to start from."""
    actor.save_pretrained(path)
    return path


def alphabet_size(task: Any, spec: ActorTask) -> int:
    """How many token ids from 0 a response may use."""
    c = task.config
    if isinstance(spec.alphabet, int):
        return spec.alphabet
    return c.num_targets + c.num_fillers if spec.alphabet == "ordinary" else getattr(c, spec.alphabet)


def restrict(logits: Tensor, alphabet: int) -> Tensor:
    """`logits` with every id outside the alphabet impossible."""
    return logits.masked_fill(torch.arange(logits.shape[-1]) >= alphabet, -math.inf)


def sample(actor: torch.nn.Module, ids: Tensor, mask: Tensor, new_tokens: int, alphabet: int, seed: int) -> Tensor:
    """[N, new_tokens] tokens `generate` samples after `ids` (temperature 1, from the alphabet), seeded."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Alphabet(LogitsProcessor):
        def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
            return restrict(scores, alphabet)

    torch.manual_seed(seed)
    with torch.no_grad():
        out = actor.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            logits_processor=LogitsProcessorList([Alphabet()]),
        )
    return out[:, ids.shape[1] :]


def token_logprobs(actor: torch.nn.Module, batch: dict[str, Tensor], alphabet: int) -> Tensor:
    """[B, R] log-probabilities of the response tokens under the actor (0 past each response's end)."""
    responses, mask = batch["responses"], batch["response_mask"]
    logits = actor(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits[:, -responses.shape[1] - 1 : -1]
    logp = torch.log_softmax(restrict(logits.float(), alphabet), dim=-1)
    picked = logp.gather(-1, responses.clamp(max=alphabet - 1)[..., None])[..., 0]
    return torch.where(mask.bool(), picked, torch.zeros_like(picked))


# ---------------------------------------------------------------------------------------------------------------
# Rollouts: the actor's responses as the critic's batch layout, scored by the task


def rollouts(task: Any, prompts: Tensor, prompt_mask: Tensor, lengths: Tensor, responses: Tensor) -> dict:
    """The DESIGN §3 batch of the actor's `responses` cut to the lengths the prompts ask, with the task's rewards."""
    mask = prefix_mask(lengths, responses.shape[1])
    responses = responses.masked_fill(~mask.bool(), task.pad_token_id)
    batch = rollout_batch(prompts, prompt_mask, responses, mask, torch.zeros(mask.shape))
    batch["token_level_rewards"] = task.rewards(batch)
    return batch


def respond(actor: torch.nn.Module, task: Any, alphabet: int, prompts: tuple, seed: int) -> dict[str, Tensor]:
    """One sampled response per row of `prompts` (`task.prompts`' triple), as a scored batch."""
    ids, mask, header = prompts
    tokens = sample(actor, ids, mask, task.response_width, alphabet, seed)
    return rollouts(task, ids, mask, header[1], tokens)


def scores(batch: dict[str, Tensor], per_token: bool) -> Tensor:
    """[B] each response's score: its summed rewards, per response token when `per_token`."""
    total = batch["token_level_rewards"].sum(-1)
    return total / batch["response_mask"].sum(-1) if per_token else total


def discounted_from(rewards: Tensor, t: int, gamma: float) -> Tensor:
    """[N] Σ_{k>=t} γ^(k-t)·r_k."""
    tail = rewards[:, t:]
    return (tail * gamma ** torch.arange(tail.shape[1], dtype=tail.dtype)).sum(-1)


def mc_values(
    actor, task, alphabet: int, batch: dict[str, Tensor], samples: int, gamma: float, seed: int, stride: int = 1
) -> Tensor:
    """[B, R] Monte-Carlo values of the actor at every `stride`-th response position (0 elsewhere and past each
    response's end): the mean discounted return from t of `samples` continuations that keep the row's tokens < t."""
    mask, responses = batch["response_mask"], batch["responses"]
    width, lengths = batch["input_ids"].shape[1] - responses.shape[1], mask.sum(-1)
    values = torch.zeros(mask.shape)
    for t in range(0, responses.shape[1], stride):
        rows = (lengths > t).nonzero()[:, 0]
        if len(rows) == 0:
            break
        keep = rows.repeat_interleave(samples)
        ids, ids_mask = batch["input_ids"][keep, : width + t], batch["attention_mask"][keep, : width + t]
        tail = sample(actor, ids, ids_mask, responses.shape[1] - t, alphabet, seed * 1009 + t)
        full = torch.cat([responses[keep, :t], tail], dim=1)
        cont = rollouts(task, ids[:, :width], ids_mask[:, :width], lengths[keep], full)
        returns = discounted_from(cont["token_level_rewards"], t, gamma)
        values[rows, t] = returns.view(len(rows), samples).mean(-1)
    return values


# ---------------------------------------------------------------------------------------------------------------
# Advantages: GAE from a critic's values, or a critic-free baseline


def gae_advantages(
    batch: dict[str, Tensor], values: Tensor, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """verl's GAE advantages (whitened over the batch's tokens) from `values`, and the returns verl's trainer hands
    its critic (the advantages before whitening plus `values`); `lam` a number or one per row."""
    advantages, returns = compute_gae_advantage_return(
        batch["token_level_rewards"], values, batch["response_mask"], gamma, lam
    )
    return masked_whiten(advantages, batch["response_mask"]), returns


def actor_lambda(batch: dict[str, Tensor], cfg: LoopConfig, gamma: float) -> float | Tensor:
    """The actor's GAE λ: `cfg.lam`, or VAPO's 1 − 1/(α·l) by each response's length under `lam_alpha`."""
    if cfg.lam_alpha is None:
        return cfg.lam
    return length_adaptive_lambda(batch["response_mask"], cfg.lam_alpha, gamma=gamma)


def outcome_advantages(batch: dict[str, Tensor], group: int, eps: float = 1e-6) -> Tensor:
    """The outcome normalised within each group of `group` consecutive rows (GRPO), or over the whole batch when
    `group` is the batch (REINFORCE with a batch-mean baseline), on every response token."""
    outcome = batch["token_level_rewards"].sum(-1).view(-1, group)
    centred = (outcome - outcome.mean(-1, keepdim=True)) / (outcome.std(-1, keepdim=True) + eps)
    return centred.reshape(-1, 1) * batch["response_mask"]


# ---------------------------------------------------------------------------------------------------------------
# The policy update: verl's clipped surrogate, token-mean over each mini-batch


def policy_loss(logp: Tensor, old: Tensor, advantages: Tensor, mask: Tensor, cfg: LoopConfig, ref: Tensor | None):
    """verl's dual-clip PPO loss (token-mean), plus `kl_coef` × the low-variance KL to `ref` when given."""
    ratio = torch.exp(logp - old)
    clipped = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - cfg.clip, 1 + cfg.clip))
    loss = torch.where(advantages < 0, torch.minimum(clipped, -advantages * cfg.clip_c), clipped)
    if ref is not None and cfg.kl_coef:
        log_ratio = (ref - logp).clamp(-20, 20)
        loss = loss + cfg.kl_coef * (torch.exp(log_ratio) - log_ratio - 1).clamp(-10, 10)
    return masked_mean(loss, mask)


def rows_of(batch: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    return {key: value[rows] for key, value in batch.items()}


def update_actor(actor, optimizer, batch, advantages, old, ref, alphabet: int, cfg: LoopConfig, generator) -> None:
    """One epoch of the policy loss over `mini_batches` shuffled mini-batches."""
    for rows in torch.randperm(len(advantages), generator=generator).chunk(cfg.mini_batches):
        part = rows_of(batch, rows)
        logp = token_logprobs(actor, part, alphabet)
        loss = policy_loss(
            logp, old[rows], advantages[rows], part["response_mask"], cfg, None if ref is None else ref[rows]
        )
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
        optimizer.step()


# ---------------------------------------------------------------------------------------------------------------
# One run


LEVER_FIELDS = ("critic_targets", "critic_options", "critic_mini_batches", "critic_warmup", "critic_init")


def check_levers(cfg: LoopConfig) -> None:
    """Refuse a lever that the method cannot take, or a value outside its choices, naming the field."""
    if cfg.critic_targets not in ("own", "actor"):
        raise ValueError(f"critic_targets={cfg.critic_targets!r}: expected 'own' or 'actor'")
    if cfg.critic_init not in ("random", "actor"):
        raise ValueError(f"critic_init={cfg.critic_init!r}: expected 'random' or 'actor'")
    if cfg.critic_warmup < 0 or cfg.critic_mini_batches < 0 or cfg.batch % (cfg.critic_mini_batches or 1):
        raise ValueError(
            f"critic_warmup={cfg.critic_warmup} must be >= 0 and critic_mini_batches={cfg.critic_mini_batches} "
            f"must divide batch={cfg.batch}"
        )
    default = LoopConfig()
    given = [key for key in LEVER_FIELDS if getattr(cfg, key) != getattr(default, key)]
    if given and critic_of(cfg.method) is None:
        raise ValueError(f"method {cfg.method!r} has no learned critic: {', '.join(given)} cannot apply")


CRITIC_KINDS = {"critic": False, "critic_mc": True}  # a learned critic's method prefix -> regressed on MC values
CRITICLESS = ("grpo", "reinforce", "mc")


def critic_of(method: str) -> tuple[str, bool] | None:
    """`(configuration, regressed on Monte-Carlo values)` of a learned critic's method, None for the others."""
    kind, _, name = method.partition(":")
    if kind in CRITIC_KINDS and name:
        return name, CRITIC_KINDS[kind]
    if method not in CRITICLESS:
        raise ValueError(
            f"method {method!r}: expected one of {CRITICLESS} or critic:<configuration> / critic_mc:<configuration>"
        )
    return None


class Critic:
    """A `CriticWorker` of bench/ablation.py's configuration `name` on the task, as verl uses it."""

    def __init__(self, name: str, mc_targets: bool, loop: Loop, run_dir: str):
        cfg, task = loop.cfg, loop.task
        overrides = [*_ablation().CONFIGS[name][1], *ACTOR_TASKS[cfg.task].overrides]
        overrides += [f"trainer.rollout_batch_size={cfg.batch}", f"trainer.steps={cfg.iterations}"]
        mini_batches = cfg.critic_mini_batches or cfg.mini_batches  # the actor's by default, as in verl's examples
        overrides += [f"critic.ppo_mini_batch_size={cfg.batch // mini_batches}"]
        overrides += [f"trainer.seed={cfg.seed}", f"trainer.run_dir={run_dir}", *cfg.critic_options]
        if cfg.critic_init == "actor":
            overrides.append(f"critic.model.path={actor_checkpoint(loop.actor, Path(run_dir) / 'actor')}")
        train_cfg = load_config(None, overrides)
        self.cfg = resolve_model(train_cfg, task.vocab_size, task.prompt_width + task.response_width)
        if (mc_targets or cfg.critic_targets == "actor") and self.cfg.replayed_rows():
            what = "Monte-Carlo targets" if mc_targets else "GAE returns (critic_targets=actor)"
            raise ValueError(  # a replayed row was written by an older actor: refused before anything is built
                f"method {cfg.method}: the current actor's {what} cannot be had for replayed rows; use a "
                "configuration without replay"
            )
        self.worker, self.mc_targets = make_worker(self.cfg), mc_targets
        self.seconds = 0.0
        self.held: collections.deque[dict[str, Tensor]] = collections.deque(maxlen=self.cfg.trainer.replay_window)

    def values(self, batch: dict[str, Tensor]) -> Tensor:
        start = time.perf_counter()
        values = self.worker.compute_values(batch)
        self.seconds += time.perf_counter() - start
        return values

    def update(self, batch: dict[str, Tensor], values: Tensor, targets: Tensor | None = None) -> None:
        """`update_critic` on the batch, its targets by the configuration's own recipe (or `targets`: Monte-Carlo
        values of the current actor); under its `replay_rows`, rows of the last batches go first, valued by the
        current critic (the built-in trainer's replay)."""
        start = time.perf_counter()
        fresh, t = batch, self.cfg.trainer
        replayed = self.replayed()
        if replayed:
            values = torch.cat([self.worker.compute_values(replayed), values])
            batch = {key: torch.cat([replayed[key], value]) for key, value in batch.items()}
        batch = {**batch, "values": values}
        batch["returns"] = critic_returns(batch, values, t, self.worker.step) if targets is None else targets
        self.worker.update_critic(batch)
        if self.cfg.replayed_rows():
            self.held.append(fresh)
        self.seconds += time.perf_counter() - start

    def replayed(self) -> dict[str, Tensor]:
        """`replay_rows` rows of the held batches (none when it is 0), drawn as the built-in trainer draws them."""
        t, rows, group = self.cfg.trainer, self.cfg.replayed_rows(), self.cfg.critic.rollout_n
        return draw_replay(list(self.held), rows, t.replay_decay, group, t.seed, self.worker.step)


class Loop:
    """The actor, its optimiser, the task, the method's critic (if any), and the fixed held-out and probe sets."""

    def __init__(self, cfg: LoopConfig, run_dir: str):
        self.cfg, spec = cfg, ACTOR_TASKS[cfg.task]
        check_levers(cfg)
        options = load_config(None, list(spec.overrides)).task_config()
        self.task = TASKS[spec.base or cfg.task][0](options)
        self.spec, self.gamma = spec, spec.gamma
        self.alphabet = alphabet_size(self.task, spec)
        self.actor = build_actor(self.task.vocab_size, self.task.prompt_width + self.task.response_width, cfg.seed)
        self.optimizer = torch.optim.AdamW(self.actor.parameters(), lr=cfg.actor_lr, weight_decay=0.0)
        self.ref = copy.deepcopy(self.actor).eval() if cfg.kl_coef else None
        learned = critic_of(cfg.method)
        self.critic = Critic(*learned, self, run_dir) if learned else None
        self.generator = torch.Generator().manual_seed(cfg.seed)
        held_out = torch.Generator().manual_seed(cfg.seed + 1_000_003)
        self.eval_prompts = self.task.prompts(cfg.eval_prompts, held_out)
        self.probe = respond(self.actor, self.task, self.alphabet, self.task.prompts(cfg.probe_rows, held_out), -1)
        self.live_probes: list[dict[str, float]] = []
        self.probe_seconds = 0.0

    def probing(self, step: int) -> bool:
        """Whether the critic is compared with Monte-Carlo values at `step`."""
        return self.critic is not None and (step % self.cfg.probe_every == 0 or step == 1)

    def mc_values(self, batch: dict[str, Tensor], step: int) -> Tensor:
        """Monte-Carlo values of the current actor at every response position of `batch`."""
        return mc_values(self.actor, self.task, self.alphabet, batch, self.cfg.mc_samples, self.gamma, step)

    def advantages(self, batch: dict[str, Tensor], step: int) -> Tensor:
        """The method's advantages for `batch` (and the critic's update, for a critic method)."""
        cfg = self.cfg
        if cfg.method == "grpo":
            return outcome_advantages(batch, cfg.group)
        if cfg.method == "reinforce":
            return outcome_advantages(batch, len(batch["responses"]))
        lam = actor_lambda(batch, cfg, self.gamma)
        if cfg.method == "mc":
            return gae_advantages(batch, self.mc_values(batch, step), self.gamma, lam)[0]
        values = self.critic.values(batch)
        if self.probing(step):  # the error the actor's advantages see: its own rollouts, before the critic's update
            start, rows = time.perf_counter(), torch.arange(min(cfg.probe_rows, len(values)))
            self.live_probes.append(self.compare(rows_of(batch, rows), values[rows], step))
            self.probe_seconds += time.perf_counter() - start  # not the iteration's cost
        advantages, returns = gae_advantages(batch, values, self.gamma, lam)
        if self.critic.mc_targets:
            targets = self.mc_values(batch, step)  # not the critic's time
        else:
            targets = returns if cfg.critic_targets == "actor" else None
        self.critic.update(batch, values, targets)
        return advantages

    def iteration(self, step: int) -> int:
        """Rollouts, advantages, one policy update; returns the rollout's response tokens."""
        prompts = self.task.prompts(self.cfg.batch, self.generator, self.cfg.group)
        batch = respond(self.actor, self.task, self.alphabet, prompts, self.cfg.seed * 100_003 + step)
        with torch.no_grad():
            old = token_logprobs(self.actor, batch, self.alphabet)
            ref = None if self.ref is None else token_logprobs(self.ref, batch, self.alphabet)
        advantages = self.advantages(batch, step)
        if step > self.cfg.critic_warmup:  # verl's critic_warmup: until then the critic learns, the actor stays
            update_actor(
                self.actor, self.optimizer, batch, advantages, old, ref, self.alphabet, self.cfg, self.generator
            )
        return int(batch["response_mask"].sum())

    def evaluate(self, step: int) -> float:
        """The actor's mean score on the held-out prompts (one response each, the same seed every time)."""
        batch = respond(self.actor, self.task, self.alphabet, self.eval_prompts, 7_777_777)
        return scores(batch, self.spec.per_token).mean().item()

    def probe_critic(self, step: int) -> dict[str, float]:
        """The critic against Monte-Carlo values of the current actor on the fixed probe prefixes (drawn from the
        first policy: as the actor moves on, prefixes it no longer writes)."""
        return self.compare(self.probe, self.critic.worker.compute_values(self.probe), step)

    def compare(self, batch: dict[str, Tensor], values: Tensor, step: int) -> dict[str, float]:
        """EV and MSE of `values` against Monte-Carlo values of the current actor on `batch`'s prefixes, with the
        truth's variance and its own noise (the variance of the Monte-Carlo mean, from two independent halves:
        E[(a - b)²] / 4), which bounds what any critic can score against it."""
        cfg, stride = self.cfg, self.cfg.probe_stride
        mask = batch["response_mask"] * (torch.arange(batch["response_mask"].shape[1]) % stride == 0)
        halves = [
            mc_values(self.actor, self.task, self.alphabet, batch, cfg.probe_samples // 2, self.gamma, seed, stride)
            for seed in (31 + step, 1_000_033 + step)
        ]
        truth = (halves[0] + halves[1]) / 2
        return {
            "step": step,
            "ev": explained_variance(values, truth, mask).item(),
            "mse": masked_mean((values - truth) ** 2, mask).item(),
            "target_var": masked_mean((truth - masked_mean(truth, mask)) ** 2, mask).item(),
            "mc_noise": masked_mean((halves[0] - halves[1]) ** 2, mask).item() / 4,
        }


def run(cfg: LoopConfig) -> dict:
    """Train the actor for `iterations` by the method; its curves and costs."""
    with tempfile.TemporaryDirectory() as run_dir:
        loop = Loop(cfg, run_dir)
        curve, probes, tokens, wall = [(0, 0, loop.evaluate(0))], [], 0, 0.0
        for step in range(1, cfg.iterations + 1):
            start = time.perf_counter()
            tokens += loop.iteration(step)
            wall += time.perf_counter() - start
            if step % cfg.eval_every == 0:
                curve.append((step, tokens, loop.evaluate(step)))
            if loop.probing(step):
                probes.append(loop.probe_critic(step))
            if cfg.stop_at_target and step % cfg.eval_every == 0 and curve[-1][2] >= loop.spec.target:
                break
    reached = next((step for step, _, score in curve if score >= loop.spec.target), None)
    return {
        **dataclasses.asdict(cfg),
        "curve": curve,
        "probes": probes,
        "live_probes": loop.live_probes,
        "iterations_to_target": reached,
        "tokens_to_target": next((tok for step, tok, _ in curve if step == reached), None),
        "final_score": statistics.mean(score for _, _, score in curve[-3:]),
        "iterations_run": step,
        "wall_s_per_iteration": (wall - loop.probe_seconds) / step,
        "critic_s_per_iteration": (loop.critic.seconds if loop.critic else 0.0) / step,
        "task_overrides": list(loop.spec.overrides),
    }


# ---------------------------------------------------------------------------------------------------------------
# The suite: every method on a task, several seeds; tables from the result files


# `ppo-critic`: the default recipe of `ppo-critic train` (PopArt + EMA + replay since 2026-12-05); the levers are
# the default until then (running statistics, no replay) with one change, `ppo-critic_running` that recipe itself
EARLIER_DEFAULT = "critic:batch_alpha0.5_lr5e-4"
METHODS = {  # name -> LoopConfig overrides
    "ppo-critic": {"method": f"{EARLIER_DEFAULT}_popart_ema_replay96"},
    **{f"verl_lr{lr}": {"method": f"critic:verl_lr{lr}"} for lr in ("3e-4", "1e-3", "3e-3")},
    "grpo_n4": {"method": "grpo", "group": 4},
    "grpo_n8": {"method": "grpo", "group": 8},
    "reinforce": {"method": "reinforce"},
    "mc": {"method": "mc"},
    "learned_mc": {"method": "critic_mc:verl_lr1e-3"},
}
LEVERS = {  # the earlier default with one lever changed (bench/ablation.py's names): screened with --methods
    "ppo-critic_running": {"method": EARLIER_DEFAULT},
    **{
        f"ppo-critic_{lever}": {"method": f"{EARLIER_DEFAULT}_{lever}"}
        for lever in ("nonorm", "noema", "nonorm_noema", "popart_ema")
    },
}
# issue 53: verl's critic as verl's trainer runs it (its targets the returns of the actor's GAE), swept over its rate,
# its mini-batches per batch and its epochs; the best per setting is the baseline
VERL_SWEEP = {
    f"verl_lr{lr}_mb{k}_ep{e}": {
        "method": f"critic:verl_lr{lr}",
        "critic_targets": "actor",
        "critic_mini_batches": k,
        "critic_options": (f"critic.ppo_epochs={e}",),
    }
    for lr in ("3e-4", "1e-3", "3e-3")
    for k in (1, 2, 4)
    for e in (1, 2)
}
# ours as a verl user gets it: only what verl's trainer passes (PPO_CRITIC_OPTIONS, verl's keys; its targets the
# actor's returns, no replay, no λ of its own)
METHODS["ours-verl"] = {
    "method": "critic:verl_lr1e-3",
    "critic_targets": "actor",
    "critic_options": ("critic.value_norm=popart", "critic.ema_decay=0.9", "critic.optim.lr=5e-4"),
}
PRETRAIN = 10  # iterations of value pretraining on the first actor (its rollouts counted)
LEVER_CHANGES = {  # suffix -> the lever's LoopConfig changes (critic_options appended to the base's)
    "pretrain": {"critic_warmup": PRETRAIN, "critic_options": (f"trainer.critic_warmup_steps={PRETRAIN}",)},
    "warmup": {"critic_warmup": PRETRAIN},  # verl's critic_warmup: the critic's usual targets
    "epochs2": {"critic_options": ("critic.ppo_epochs=2",)},
    "mb4": {"critic_mini_batches": 4},
    "lr1e-3": {"critic_options": ("critic.optim.lr=1e-3",)},
    "lr2e-3": {"critic_options": ("critic.optim.lr=2e-3",)},
    "noema": {"critic_options": ("critic.ema_decay=0.0",)},
    "nonorm": {"critic_options": ("critic.value_norm=off",)},
    "lam1": {"critic_options": ("trainer.length_adaptive_alpha=null", "trainer.lam=1.0")},  # VC-PPO's λ_critic
    "replay192": {"critic_options": ("trainer.replay_rows=192",)},
    "init-actor": {"critic_init": "actor"},
    # ours-verl regressing on λ 1 returns of its own (VC-PPO's λ_critic): in verl `PPO_CRITIC_OPTIONS=targets_lam=1.0`
    # (the same GAE from the rewards and old values; verl's configuration here regresses on λ 1 as its own recipe)
    "critic-lam1": {"critic_targets": "own"},
}
NOT_FOR = {  # the levers a row does not take: ours-verl only what verl's trainer hands (no own λ, no replay)
    "ppo-critic": ("critic-lam1",),
    "ours-verl": ("pretrain", "lam1", "replay192"),
}


def with_lever(base: dict, changes: dict) -> dict:
    """`base`'s LoopConfig overrides with a lever's `changes` (its critic options after the base's)."""
    options = (*base.get("critic_options", ()), *changes.get("critic_options", ()))
    return {**base, **changes, "critic_options": options}


LEVERS.update(
    {
        f"{base}+{suffix}": with_lever(METHODS[base], changes)
        for base in ("ppo-critic", "ours-verl")
        for suffix, changes in LEVER_CHANGES.items()
        if suffix not in NOT_FOR[base]
    }
)
LEVERS.update(VERL_SWEEP)


def same_config(result: dict, cfg: LoopConfig) -> bool:
    """Whether `result` is a run of `cfg` on its task as set now (a field the run predates at its default; tuples
    stored as lists)."""
    defaults, task = dataclasses.asdict(LoopConfig()), ACTOR_TASKS[cfg.task].overrides
    if result.get("task_overrides", list(task)) != list(task):
        return False
    return all(
        _plain(result.get(key, defaults[key])) == _plain(value) for key, value in dataclasses.asdict(cfg).items()
    )


def _plain(value: Any) -> Any:
    """`value` as JSON stores it."""
    return list(value) if isinstance(value, tuple) else value


def load(path: Path) -> list[dict]:
    """The runs of a result file (bench/ablation.py's reader)."""
    return _ablation().read_results(path)


def lower_median(values: list) -> Any:
    """The median (the lower one for an even count), where None (never reached) counts as slower than any number."""
    ordered = sorted(values, key=lambda v: math.inf if v is None else v)
    return ordered[(len(ordered) - 1) // 2] if ordered else None


def spread(values: list) -> str:
    """Each seed's value ("never" for None), in seed order."""
    return ", ".join("never" if v is None else f"{v:g}" for v in values)


def table(task: str, results: list[dict]) -> str:
    """Markdown: a row per method (median over seeds; every seed's value in brackets): iterations and rollout tokens
    to the target, the final score, the critic against Monte-Carlo values of the moving actor, the cost."""
    lines = [
        f"| method | seeds | iterations to {ACTOR_TASKS[task].target} | rollout tokens to it (k) | final score | "
        "critic EV / MSE vs MC on the fixed probe (its variance, its noise) | the same on the actor's own rollouts | "
        "s/iteration (critic) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in [*METHODS, *LEVERS]:
        rows = sorted((r for r in results if r["name"] == name), key=lambda r: r["seed"])
        if not rows:
            continue
        reach = [r["iterations_to_target"] for r in rows]
        tokens = [None if r["tokens_to_target"] is None else round(r["tokens_to_target"] / 1000) for r in rows]
        critic = probe_summary([p for r in rows for p in r["probes"]])
        live = probe_summary([p for r in rows for p in r.get("live_probes", [])])
        wall = statistics.median(r["wall_s_per_iteration"] for r in rows)
        work = statistics.median(r["critic_s_per_iteration"] for r in rows)
        med_reach, med_tokens = lower_median(reach), lower_median(tokens)
        lines.append(
            f"| {name} | {len(rows)} | {spread([med_reach])} ({spread(reach)}) | {spread([med_tokens])} "
            f"({spread(tokens)}) | {statistics.median(r['final_score'] for r in rows):.3f} | {critic} | {live} | "
            f"{wall:.2f} ({work:.2f}) |"
        )
    return "\n".join(lines)


def median_tokens(results: list[dict], name: str) -> float | None:
    """The lower median over seeds of a method's rollout tokens to the target (inf: never at its median; None: no
    run)."""
    reach = [r["tokens_to_target"] for r in results if r["name"] == name]
    if not reach:
        return None
    median = lower_median(reach)
    return math.inf if median is None else median


def best_of(results: list[dict], prefix: str) -> tuple[str, float] | None:
    """The method named `prefix`… with the fewest median rollout tokens to the target, and those tokens."""
    found = [(median_tokens(results, name), name) for name in {r["name"] for r in results} if name.startswith(prefix)]
    return min(found, key=lambda pair: (pair[0], pair[1]))[::-1] if found else None


def ratios(results: list[dict]) -> list[str]:
    """A line per method of interest: its median rollout tokens to the target over verl's best critic's and GRPO's
    best group size's (issue 53's measure), where both ran."""
    bases = {"verl-best": best_of(results, "verl_"), "GRPO-best": best_of(results, "grpo")}
    bases = {label: found for label, found in bases.items() if found and math.isfinite(found[1])}
    if not bases:
        return []
    head = "; ".join(f"{label} {name} ({tokens / 1000:.0f}k)" for label, (name, tokens) in bases.items())
    lines = []
    for name in ("ours-verl", "ppo-critic", "mc", "learned_mc"):
        mine = median_tokens(results, name)
        if mine is not None:
            parts = [f"{mine / tokens:.2f}× {label}" for label, (_, tokens) in bases.items()]
            lines.append(f"- {name}: {', '.join(parts)}")
    return [f"Rollout tokens to the target (medians over seeds) against {head}:", "", *lines] if lines else []


def probe_summary(probes: list[dict]) -> str:
    """`EV / MSE (the truth's variance, its Monte-Carlo noise)`, medians over `probes`; "—" without any."""
    if not probes:
        return "—"
    ev, mse, var, noise = (statistics.median(p[k] for p in probes) for k in ("ev", "mse", "target_var", "mc_noise"))
    return f"{ev:.2f} / {mse:.4f} ({var:.4f}, {noise:.4f})"


def plot(task: str, results: list[dict], out: Path) -> None:
    """`out` (PNG): the held-out score by iteration and by rollout tokens (median over seeds, the range shaded) and
    the critics' EV against Monte-Carlo values of the moving actor, a line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_tokens, ev) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name in [*METHODS, *LEVERS]:
        rows = [r for r in results if r["name"] == name]
        if not rows:
            continue
        steps = [c[0] for c in max((r["curve"] for r in rows), key=len)]
        scores = [[held(r["curve"], k)[2] for r in rows] for k in range(len(steps))]  # a stopped run holds its last
        tokens = [
            statistics.median(r["curve"][k][1] for r in rows if k < len(r["curve"])) / 1000 for k in range(len(steps))
        ]
        mid = [statistics.median(s) for s in scores]
        line = by_step.plot(steps, mid, label=f"{name} ({len(rows)} seeds)")[0]
        by_step.fill_between(
            steps, [min(s) for s in scores], [max(s) for s in scores], alpha=0.15, color=line.get_color()
        )
        by_tokens.plot(tokens, mid, color=line.get_color())
        for key, style in (("probes", "o:"), ("live_probes", "o-")):  # the fixed probe dotted, own rollouts solid
            if all(r.get(key) for r in rows):
                at = [p["step"] for p in min((r[key] for r in rows), key=len)]
                medians = [statistics.median(r[key][k]["ev"] for r in rows) for k in range(len(at))]
                ev.plot(at, medians, style, color=line.get_color(), label=name if style == "o-" else None)
    target = ACTOR_TASKS[task].target
    for axis, x in ((by_step, "iteration"), (by_tokens, "rollout tokens (thousands)")):
        axis.axhline(target, color="grey", linestyle=":")
        axis.set(xlabel=x, ylabel="held-out score (mean of one response per prompt)")
    ev.set(xlabel="iteration", ylabel="critic EV vs MC values (solid: own rollouts, dotted: fixed probe)")
    ev.set_ylim(-0.5, 1.0)
    ev.legend(fontsize=8)
    by_step.legend(fontsize=8)
    fig.suptitle(f"PPO on {task}: the actor's score with each critic (median over seeds, range shaded)")
    fig.tight_layout()
    write_with(out, lambda f: fig.savefig(f, format="png", dpi=90))
    plt.close(fig)


def held(curve: list, k: int) -> Any:
    """The k-th evaluation of `curve`, or its last where the run stopped before (at its target)."""
    return curve[min(k, len(curve) - 1)]


def report(results: Path = RESULTS) -> str:
    """A table per task of the result files in `results` (and its curves, `<task>.png` beside them)."""
    parts = []
    for path in sorted(results.glob("*.json")):
        task, runs = path.stem, load(path)
        plot(task, runs, path.with_suffix(".png"))
        spec = ACTOR_TASKS[task]
        first = runs[0]
        lam = f"λ {first['lam']:g}" if first.get("lam_alpha") is None else f"λ 1 − 1/({first['lam_alpha']:g}·l)"
        setting = f"actor lr {first['actor_lr']:g}, {first['batch']} responses per iteration, {lam}"
        title = f"### {task}: target score {spec.target} ({setting}; curves: `{path.with_suffix('.png').name}`)"
        parts += [title, "", table(task, runs), "", *ratios(runs), ""]
    return "\n".join(parts)


def setting(spec: ActorTask, args: argparse.Namespace) -> dict:
    """The LoopConfig fields a task sets, the command line's where given."""
    fields = {"iterations": spec.iterations, "actor_lr": spec.actor_lr, "lam": spec.lam, "lam_alpha": spec.lam_alpha}
    fields.update(stop_at_target=spec.stop_at_target, **dict(spec.loop_options))
    given = {"iterations": args.iterations, "actor_lr": args.actor_lr, "batch": args.batch, "lam": args.lam}
    return {**fields, **{key: value for key, value in given.items() if value is not None}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="*", default=["counting"], choices=list(ACTOR_TASKS))
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=[*METHODS, *LEVERS])
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--iterations", type=int, default=None, help="iterations of every run (default: the task's)")
    p.add_argument("--actor-lr", type=float, default=None, help="the actor's rate (default: the task's)")
    p.add_argument("--batch", type=int, default=None, help="responses per iteration (default: the task's, else 96)")
    p.add_argument("--lam", type=float, default=None, help="the actor's GAE λ (default: the task's)")
    p.add_argument("--results", type=Path, default=RESULTS, help="the folder of the result files (screens: another)")
    p.add_argument("--report", action="store_true", help="only the tables and curves (docs/QUALITY.md with --write)")
    p.add_argument("--write", action="store_true", help="with --report: replace the tables in docs/QUALITY.md")
    args = p.parse_args()
    if args.write and not args.report:
        p.error("--write rewrites docs/QUALITY.md's tables from stored runs: give it with --report")
    if args.report:
        text = report(args.results)
        _ablation().write_report(text, BEGIN, END) if args.write else print(text)
        return
    torch.set_num_threads(1)
    args.results.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "python": platform.python_version()}
    for task in args.tasks:
        path = args.results / f"{task}.json"
        for seed in args.seeds:
            for name in args.methods:
                cfg = LoopConfig(
                    task=task, seed=seed, **setting(ACTOR_TASKS[task], args), **{**METHODS, **LEVERS}[name]
                )
                if any(r["name"] == name and same_config(r, cfg) for r in load(path)):
                    continue
                result = {"name": name, **run(cfg)}
                _ablation().append_result(path, result, meta)  # under a lock: runs side by side keep each other's
                print(
                    f"{task} {name} seed={seed}: to target {result['iterations_to_target']} final "
                    f"{result['final_score']:.3f} {result['wall_s_per_iteration']:.2f} s/it",
                    flush=True,
                )


if __name__ == "__main__":
    main()
