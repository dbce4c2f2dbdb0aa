"""Value pretraining end to end (VC-PPO / VAPO: the critic fitted to the initial policy's rollouts before PPO starts).

verl records the SFT policy's rollouts (`trainer.rollout_data_dir`; the file is written here by verl's own trainer
code) → `ppo-critic train data=<that file>` → `ppo-critic export` → `critic.model.path=<export>` in verl 0.9.1, where
verl's own fsdp engine and ppo-critic's engine give, on the policy's own token ids, the values `ppo-critic values`
gives on the dump's rows. The critic keeps `ppo-critic train`'s defaults, `value_norm=popart` and `ema_decay=0.9`,
which the export must carry (folded into the head; the moving average as the weights): PopArt's first merge moves
the fresh head's ~0 outputs to the returns' mean (~11), so a short run ends near them.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import verl_cpu
import yaml
from engine_helpers import infer_values, training_worker
from tensordict import TensorDict
from verl import DataProto

from ppo_critic.data.rows import rollout_batch
from ppo_critic.rollout_files.read import read_rollouts
from verl_shared import VOCAB, save_tiny_critic

ROWS, STEPS = 24, 4
# DESIGN §6 FP32_REORDERED: the same fp32 math in another order (the export's folded head w·σ, b·σ + μ against σ·v + μ
# after the forward; verl's padded sdpa and ppo-critic's packed attention against the padded forward); measured:
# 9.5e-7, one float32 step at values of 12. Leaving out of the export the moving average (it moves the values by
# ~0.3 from the live weights here) or the return statistics (mean ~12) misses by far more.
SAME_VALUES = {"rtol": 1e-5, "atol": 1e-5}
# a chat template whose role markers are special tokens, as a chat model's are: verl's dump drops them
TEMPLATE = (
    "{% for m in messages %}<user> {{ m['content'] }}{% endfor %}{% if add_generation_prompt %} <assistant>{% endif %}"
)
WORDS = ["<pad>", "<s>", "</s>", "<unk>", "<user>", "<assistant>"] + [f"w{i}" for i in range(6, VOCAB)]
VERL_FSDP_ON_CPU = {
    "strategy": "fsdp2",
    "model.use_remove_padding": False,  # verl's packed path needs flash-attn
    "+fsdp.mixed_precision": "{param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}",  # verl's default: bf16
}


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> tuple[Path, Path]:
    """The SFT policy's weights (the tiny model) and its tokenizer: words with a chat template, in a directory of its
    own (transformers 5 loads a directory holding a qwen2 config.json with its Qwen2 tokenizer, not this one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, additional_special_tokens=["<user>", "<assistant>"], **special
    )
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(tokenizer_dir := tmp_path_factory.mktemp("tokenizer"))
    return save_tiny_critic(tmp_path_factory.mktemp("policy")), tokenizer_dir


def sft_rollouts(tokenizer, seed: int = 0) -> DataProto:
    """The SFT policy's rollouts as verl's trainer holds them when it dumps them: chat-rendered prompts, left-padded;
    answers ended by EOS, right-padded; the score (10 + the answer's token ids below 40) on the last answer token."""
    g = torch.Generator().manual_seed(seed)

    def words(low: int, high: int) -> list[int]:
        return torch.randint(6, VOCAB, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()

    prompts, answers = [], []
    for _ in range(ROWS):
        message = [{"role": "user", "content": " ".join(WORDS[i] for i in words(1, 5))}]
        prompts.append(tokenizer.apply_chat_template(message, add_generation_prompt=True, return_dict=False))
        answers.append([*words(1, 6), tokenizer.eos_token_id])
    scores = [10.0 + sum(token < 40 for token in answer) for answer in answers]
    prompt_ids, prompt_mask = pad(prompts, tokenizer.pad_token_id, left=True)
    response_ids, response_mask = pad(answers, tokenizer.pad_token_id, left=False)
    last = response_mask.sum(-1, keepdim=True) - 1
    token_scores = torch.zeros(response_ids.shape).scatter(1, last, torch.tensor(scores)[:, None])
    batch = rollout_batch(prompt_ids, prompt_mask, response_ids, response_mask, token_scores)
    tensors = {**batch, "prompts": prompt_ids, "token_level_scores": token_scores}
    return DataProto(
        batch=TensorDict(tensors, batch_size=[ROWS]),
        non_tensor_batch={"reward_model": np.array([{"ground_truth": None}] * ROWS, dtype=object)},
        meta_info={"temperature": 1.0, "global_token_num": batch["attention_mask"].sum(-1).tolist()},
    )


def pad(rows: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` padded with `pad_id` on the left (prompts) or the right (answers), and the 0/1 mask of real tokens."""
    width = max(map(len, rows))
    ids, mask = torch.full((len(rows), width), pad_id), torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span], mask[i, span] = torch.tensor(row), 1
    return ids, mask


def verl_dump(data: DataProto, tokenizer, directory: Path) -> Path:
    """verl's own `trainer.rollout_data_dir` dump of `data` at step 1 (`RayPPOTrainer._log_rollout_data`, on a trainer
    holding only what that method reads)."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.tokenizer, trainer.global_steps = tokenizer, 1
    trainer._init_dump_executor()
    trainer._log_rollout_data(data, {}, {}, str(directory))
    trainer._shutdown_dump_executor()
    return directory / "1.jsonl"


def ppo_critic(*args: str) -> None:
    """The `ppo-critic` command in a fresh process; it must succeed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "ppo_critic", *args], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]


def _sdpa_valuehead_loader(local_path, torch_dtype, model_config, trust_remote_code):
    """verl's `load_valuehead_model` with sdpa attention instead of its hard-coded flash_attention_2."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        local_path, torch_dtype=torch_dtype, config=model_config, attn_implementation="sdpa"
    )


@contextlib.contextmanager
def verl_fsdp_on_cpu() -> Iterator[None]:
    """What verl 0.9.1's own fsdp engine needs on a CPU (test code only): registered for the CPU platform, sdpa in
    its value-model loader, "cpu" as the platform's device (verl moves the module to it) and a device-memory probe."""
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

    with (
        mock.patch.dict(EngineRegistry._engines["value_model"]["fsdp2"], {"cpu": FSDPEngineWithValueHead}),
        mock.patch("verl.utils.model.load_valuehead_model", _sdpa_valuehead_loader),
        mock.patch.object(verl_cpu.PlatformCPU, "current_device", lambda self: "cpu"),
        mock.patch.object(verl_cpu._CpuDevice, "mem_get_info", staticmethod(lambda *a: (0, 0)), create=True),
    ):
        yield


def test_a_critic_pretrained_on_verls_rollout_dump_gives_its_values_in_verl(single_process, policy, tmp_path):
    from transformers import AutoTokenizer

    model_dir, tokenizer_dir = policy
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    data = sft_rollouts(tokenizer)
    dump = verl_dump(data, tokenizer, tmp_path / "rollout_data")
    assert set(json.loads(dump.read_text().splitlines()[0])) == {"input", "output", "gts", "score", "step"}
    # the dump is text without special tokens; the reader recovers the policy's own ids from it
    valid = data.batch["attention_mask"].bool()
    policy_ids = [ids[m].tolist() for ids, m in zip(data.batch["input_ids"], valid, strict=True)]
    assert [r.prompt_ids + r.response_ids for r in read_rollouts(dump, tokenizer=tokenizer_dir)] == policy_ids

    run, export, values = tmp_path / "run", tmp_path / "export", tmp_path / "values.jsonl"
    ppo_critic(
        "train", f"data={dump}", f"critic.model.path={model_dir}", f"critic.model.tokenizer_path={tokenizer_dir}",
        f"trainer.run_dir={run}", f"trainer.steps={STEPS}", "trainer.rollout_batch_size=16",
        "critic.ppo_mini_batch_size=8", "trainer.length_adaptive_alpha=null", "trainer.logger=[jsonl]",
        "trainer.progress=false", "trainer.export_hf=false",
    )  # fmt: skip
    critic = yaml.safe_load((run / "config.yaml").read_text())["critic"]
    assert (critic["value_norm"], critic["ema_decay"]) == ("popart", 0.9)  # docs/verl.md's step 2: the defaults
    ppo_critic("export", str(run), str(export))
    ppo_critic("values", str(run), f"data={dump}", f"out={values}")
    expected = torch.zeros(data.batch["responses"].shape)
    for line in map(json.loads, values.read_text().splitlines()):
        expected[line["row"], : len(line["values"])] = torch.tensor(line["values"])
    assert expected.sum() / data.batch["response_mask"].sum() > 5  # raw values (returns ~11): value_norm folded

    tokenizer_path = {"model.tokenizer_path": str(tokenizer_dir)}  # the export holds the weights only
    ours = training_worker(export, **tokenizer_path)
    torch.testing.assert_close(infer_values(ours, data), expected, **SAME_VALUES)
    with verl_fsdp_on_cpu():
        verls = training_worker(export, **VERL_FSDP_ON_CPU, **tokenizer_path)
        assert type(verls.engine).__name__ == "FSDPEngineWithValueHead"
        torch.testing.assert_close(infer_values(verls, data), expected, **SAME_VALUES)
