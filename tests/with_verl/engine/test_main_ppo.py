"""verl's own trainer, `python -m verl.trainer.main_ppo`, on the CPU with `critic.strategy=ppo_critic`: three PPO
steps of verl's default (v1) trainer at DP=2 through Ray, and of the legacy `trainer.use_v1=false` one in one process,
and of the default trainer at DP=1 x Ulysses 2, each give the critic metrics (value loss, gradient norm, clip fraction,
mean prediction) of verl's own fsdp2 critic engine (default trainer, one process) on the same weights and data. Each
run starts about a dozen processes (a minute on two cores): four runs cover the cases.

Only `main_ppo_cpu/` stands in (a CPU platform, gloo, a rollout of seeded random tokens: see its module); the agent
loop, TransferQueue, reward, advantages, actor (fsdp2) and metrics are verl's. All runs share one Ray cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import ray
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ppo_critic.config.env import OPTIONS_ENV
from verl_shared import VOCAB, save_tiny_critic

HERE = Path(__file__).resolve().parent
SHIMS = HERE / "main_ppo_cpu"
STEPS = 3  # 16 prompts in batches of 8: step 3 sees step 1's batch again
# every critic metric the engines report: the same at any DP or Ulysses size (issue 39); verl's engine runs one
# micro-batch per step here, so its per-micro-batch means are the mini-batch's token-weighted ones
COMPARED = ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean")
# DESIGN §6's layout tolerance: both engines compute the same fp32 sums in another order (measured: < 1e-7)
RTOL = 1e-5
SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0-3; the stand-in rollout emits ids from 4 on
TRAINER = [
    "algorithm.adv_estimator=gae",  # gamma = lam = 1: the returns do not depend on the values
    "data.train_batch_size=8",
    "data.max_prompt_length=16",
    "data.max_response_length=8",
    "data.shuffle=false",
    "data.dataloader_num_workers=0",
    "actor_rollout_ref.model.use_remove_padding=false",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    "actor_rollout_ref.rollout.name=random",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.calculate_log_probs=false",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "critic.model.use_remove_padding=false",  # verl's fsdp engine packs rows with flash-attn only
    "+critic.model.override_config.attn_implementation=sdpa",
    "critic.model.enable_gradient_checkpointing=false",
    "critic.ppo_micro_batch_size_per_gpu=4",  # verl's critic config asks for it; its engines read critic.fsdp.*
    f"reward.custom_reward_function.path={SHIMS / 'reward.py'}",
    "reward.num_workers=1",
    "trainer.logger=[console,file]",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    f"trainer.total_training_steps={STEPS}",
    "trainer.device=cpu",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
]
# verl's fsdp2 critic engine in float32 (ppo-critic's computes in float32 on the CPU)
VERL_FSDP2 = [
    "critic.strategy=fsdp2",
    "critic.fsdp.use_torch_compile=false",
    "+critic.fsdp.mixed_precision.param_dtype=fp32",
]
# ppo-critic's engine with token budgets that cut each batch into several micro-batches (verl's: one), which leaves
# the update as it is (DESIGN §3). The v1 trainer trains with the first key's budget, the legacy one with the second's
PPO_CRITIC = [
    "critic.strategy=ppo_critic",
    "+critic.ppo_infer_max_token_len_per_gpu=24",
    "critic.ppo_max_token_len_per_gpu=24",
]


def tokenizer() -> PreTrainedTokenizerFast:
    """Words `w4` ... `w127` as token ids 4 ... 127, and a chat template that joins the messages' contents."""
    vocab = {word: i for i, word in enumerate(SPECIAL)} | {f"w{i}": i for i in range(len(SPECIAL), VOCAB)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


def save_models(root: Path) -> None:
    """The suite's tiny critic and a tinier Llama actor (a model type verl's agent loop tokenizes generically), both
    with the word tokenizer."""
    critic = save_tiny_critic(root / "critic")
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    actor = root / "actor"
    LlamaForCausalLM(config).save_pretrained(actor)
    for path in (critic, actor):
        tokenizer().save_pretrained(path)


def save_prompts(path: Path, rows: int = 16) -> None:
    """verl's RL parquet layout: chat prompts of 2-6 random words, scored by `main_ppo_cpu/reward.py`."""
    g = torch.Generator().manual_seed(0)
    records = []
    for i in range(rows):
        words = torch.randint(len(SPECIAL), VOCAB, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
        records.append(
            {
                "data_source": "random_words",
                "prompt": [{"role": "user", "content": " ".join(f"w{int(w)}" for w in words)}],
                "reward_model": {"style": "rule", "ground_truth": ""},
                "extra_info": {"index": i},
            }
        )
    pd.DataFrame(records).to_parquet(path)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("main_ppo")
    save_models(root)
    save_prompts(root / "prompts.parquet")
    return root


def run_env(metrics: Path) -> dict[str, str]:
    """What puts the stand-ins into every process of a run (`import verl` imports the module named), and where
    verl's file logger writes."""
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SHIMS), str(HERE), os.environ.get("PYTHONPATH")])),
        "VERL_USE_EXTERNAL_MODULES": "verl_cpu_trainer",
        "VERL_FILE_LOGGER_PATH": str(metrics),
        "OMP_NUM_THREADS": "1",
    }


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray cluster (two fake GPUs) for every run of the module: each run is a Ray job of its own."""
    ray.init(address="local", num_cpus=16, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def main_ppo(
    workdir: Path, ray_address: str, name: str, *overrides: str, gpus: int = 1, options: str = ""
) -> dict[int, dict]:
    """`python -m verl.trainer.main_ppo` in a subprocess (`options`: PPO_CRITIC_OPTIONS in every process); verl's
    metrics of each step, read from its file logger."""
    run_dir = workdir / name
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *TRAINER, *overrides]
    cmd += [
        f"data.train_files={workdir / 'prompts.parquet'}",
        f"data.val_files={workdir / 'prompts.parquet'}",
        f"actor_rollout_ref.model.path={workdir / 'actor'}",
        f"critic.model.path={workdir / 'critic'}",
        f"trainer.n_gpus_per_node={gpus}",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        f"+ray_kwargs.ray_init.address={ray_address}",
        "ray_kwargs.ray_init.num_cpus=null",
    ]
    env = run_env(metrics) | ({OPTIONS_ENV: options} if options else {})
    cmd += [f'+ray_kwargs.ray_init.runtime_env.env_vars.{key}="{value}"' for key, value in env.items()]  # Ray's workers
    log = run_dir / "main_ppo.log"
    start = time.perf_counter()
    with log.open("w") as out:
        run = subprocess.run(
            cmd, cwd=run_dir, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, timeout=900, check=False
        )
    print(f"main_ppo {name}: {time.perf_counter() - start:.0f} s")
    assert run.returncode == 0, f"{log}:\n" + log.read_text()[-6000:]
    steps = {row["step"]: row["data"] for row in map(json.loads, metrics.read_text().splitlines())}
    assert sorted(steps) == list(range(1, STEPS + 1)), sorted(steps)
    return steps


@pytest.fixture(scope="module")
def verl_engine(workdir, ray_address) -> dict[int, dict]:
    """The reference: verl's default trainer with verl's own fsdp2 critic engine, one process."""
    return main_ppo(workdir, ray_address, "verl_fsdp2", *VERL_FSDP2)


def assert_same_critic(got: dict[int, dict], want: dict[int, dict]) -> None:
    """Each step's value loss and gradient norm equal the reference's; and the critic's updates show in them (step 3
    trains on step 1's batch, with the same returns: a different loss comes from the weights alone)."""
    for step, metrics in want.items():
        for key in COMPARED:
            assert got[step][key] == pytest.approx(metrics[key], rel=RTOL), (step, key)
    returns = pytest.approx(want[1]["critic/returns/mean"], rel=RTOL)
    assert got[1]["critic/returns/mean"] == returns and got[3]["critic/returns/mean"] == returns
    assert abs(want[3]["critic/vf_loss"] / want[1]["critic/vf_loss"] - 1) > 100 * RTOL


def test_verls_default_trainer_at_dp2_through_ray(workdir, ray_address, verl_engine):
    """Each batch is one optimizer step (the mini-batch is the whole batch), so two ranks holding half of it each
    make the one-process update."""
    got = main_ppo(workdir, ray_address, "ppo_critic_dp2", *PPO_CRITIC, gpus=2)
    assert_same_critic(got, verl_engine)


def test_verls_default_trainer_under_ulysses_2(workdir, ray_address, verl_engine):
    """DP=1 x Ulysses 2: the metrics as at one rank (they read 2x the loss before issue 39's fix)."""
    ulysses = ["critic.fsdp.ulysses_sequence_parallel_size=2", "critic.model.use_remove_padding=true"]
    got = main_ppo(workdir, ray_address, "ppo_critic_sp2", *PPO_CRITIC, *ulysses, gpus=2)
    assert_same_critic(got, verl_engine)


def test_verls_legacy_trainer(workdir, ray_address, verl_engine):
    got = main_ppo(workdir, ray_address, "ppo_critic_legacy", *PPO_CRITIC, "trainer.use_v1=false")
    assert_same_critic(got, verl_engine)


def test_the_critics_own_lambda_through_verls_trainer(workdir, ray_address, verl_engine):
    """`PPO_CRITIC_OPTIONS=targets_lam=1.0` (issue 53, VC-PPO's decoupled λ) under `algorithm.lam=0.5`: verl hands the
    critic returns of λ 0.5 (the returns it logs), the critic trains on λ 1's, as verl's own engine does at
    algorithm.lam=1 (the reference). The stand-in rollout does not read the actor: every step's critic is the same."""
    got = main_ppo(
        workdir, ray_address, "ppo_critic_own_lambda", *PPO_CRITIC, "algorithm.lam=0.5", options="targets_lam=1.0"
    )
    for step, metrics in verl_engine.items():
        for key in COMPARED:
            assert got[step][key] == pytest.approx(metrics[key], rel=RTOL), (step, key)
    assert got[1]["critic/returns/mean"] != pytest.approx(verl_engine[1]["critic/returns/mean"], rel=1e-3)
