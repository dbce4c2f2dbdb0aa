"""A tiny randomly initialised critic on disk (Qwen2 token classification + a word-level tokenizer): what verl's
workers load like any HF checkpoint, without a download. Used by the verl examples and their tests."""

from __future__ import annotations

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
