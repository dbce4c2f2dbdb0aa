"""What the verl examples share: a tiny randomly initialised critic on disk (Qwen2 token classification + a
word-level tokenizer, loaded by verl's workers like any HF checkpoint, no download), their command line, the
one-process group verl's workers expect, and the PPO critic loop on ppo-critic's counting task (whose true values
are known). Also used by the verl test suites."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch


def tiny_critic_dir(path: Path, vocab_size: int, seed: int = 0) -> Path:
    """A randomly initialised tiny Qwen2 token-classification critic and a word-level tokenizer: a model directory
    verl's worker loads like any HF checkpoint (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForTokenClassification

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        classifier_dropout=0.0,
        num_labels=1,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    Qwen2ForTokenClassification(config).save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t3"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3"
    )
    tokenizer.save_pretrained(path)
    return path


def example_args(description: str) -> argparse.Namespace:
    """`--steps`, `--model`, `--lam` and `--options` (set as PPO_CRITIC_OPTIONS, read when verl builds the critic)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", type=Path, help="an HF critic checkpoint (default: a tiny random one)")
    parser.add_argument("--lam", type=float, default=0.5, help="GAE lambda of the critic's returns")
    parser.add_argument(
        "--options", default="ema_decay=0.9", help="ppo-critic's own options for the critic verl builds"
    )
    args = parser.parse_args()
    os.environ["PPO_CRITIC_OPTIONS"] = args.options
    return args


def init_single_process(port: int) -> None:
    """The environment verl's Ray worker group sets for each worker, and a one-process group (nccl or gloo)."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def counting_task():
    """ppo-critic's built-in counting task (the true value of every response token is known)."""
    from ppo_critic.tasks import CountingTask, CountingTaskConfig

    return CountingTask(CountingTaskConfig(num_targets=2, max_response_len=12))


def counting_rollouts(task, batch_size: int, generator: torch.Generator):
    """Rollouts of the counting task as a verl `DataProto` (+ prompts, response mask and the token counts of
    `meta_info`, as verl's trainer has them)."""
    from tensordict import TensorDict
    from verl import DataProto

    batch = task.sample(batch_size, generator)
    r = batch["responses"].shape[1]
    tensors = {**batch, "prompts": batch["input_ids"][:, :-r], "response_mask": batch["attention_mask"][:, -r:]}
    meta = {"global_token_num": batch["attention_mask"].sum(-1).tolist()}
    return DataProto(batch=TensorDict(tensors, batch_size=[batch_size]), meta_info=meta)


def critic_loop(
    values_of: Callable[[object], torch.Tensor], update: Callable[[object], dict], steps: int, lam: float
) -> None:
    """Per step: rollouts, values (`values_of(data)`), GAE returns (verl's own function), one critic update
    (`update(data)`: verl's metrics, reduced); prints the metrics now and then and, at the end, the explained
    variance of the true values on held-out rollouts."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    from ppo_critic.algos import explained_variance

    task = counting_task()
    generator = torch.Generator().manual_seed(0)
    held_out = counting_rollouts(task, 256, generator)
    for step in range(1, steps + 1):
        data = counting_rollouts(task, 64, generator)
        values = values_of(data)
        rewards, mask = data.batch["token_level_rewards"], data.batch["response_mask"]
        data.batch["values"] = values
        data.batch["returns"] = compute_gae_advantage_return(rewards, values, mask, 1.0, lam)[1]
        metrics = update(data)
        if step == 1 or step % 10 == 0 or step == steps:
            shown = {k: round(float(v), 4) for k, v in sorted(metrics.items()) if not k.startswith(("perf/", "mfu"))}
            print(f"step {step}: {shown}")
    mask = held_out.batch["response_mask"]
    ev = explained_variance(values_of(held_out), task.true_values(held_out.batch), mask)
    print(f"explained variance of the true values on {len(mask)} held-out rollouts: {float(ev):.3f}")
