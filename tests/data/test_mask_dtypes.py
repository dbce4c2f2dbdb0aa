"""A 0/1 mask of any dtype (int, float, bool) is the same mask: the critic reads the same lengths and computes the same
values and update, padded or packed, with fixed or dynamic micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_batch, tiny_config
from ppo_critic import DataParallelPPOCritic, build_value_model
from ppo_critic.data.batch import Batch

DYNAMIC = {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 24}
LAYOUTS = {
    "padded": {"model": {"use_remove_padding": False}},
    "packed": {"model": {"use_remove_padding": True}},
    "padded, dynamic": {"model": {"use_remove_padding": False}, **DYNAMIC},
    "packed, dynamic": {"model": {"use_remove_padding": True}, **DYNAMIC},
}
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.bool, torch.int32]


def critic(model: torch.nn.Module, layout: str) -> DataParallelPPOCritic:
    config = {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2, "grad_clip": None, **LAYOUTS[layout]}
    model = copy.deepcopy(model)
    return DataParallelPPOCritic(config, model, torch.optim.SGD(model.parameters(), lr=0.1))


def values_and_update(model: torch.nn.Module, layout: str, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_values` of `batch`, then the parameters after one `update_critic` on it."""
    c = critic(model, layout)
    values = c.compute_values(batch)
    c.update_critic(batch)
    return values, torch.cat([p.detach().flatten() for p in c.critic_module.parameters()])


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_value_model(tiny_config("qwen2", classifier_dropout=0.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_float_or_bool_attention_mask_gives_the_int_masks_values_and_update(tiny_model, one_thread, layout, dtype):
    batch = make_batch(8, 6, 5, seed=2)
    other = {**batch, "attention_mask": batch["attention_mask"].to(dtype)}
    want_values, want_params = values_and_update(tiny_model, layout, batch)
    got_values, got_params = values_and_update(tiny_model, layout, other)
    # the same lengths, micro-batches, packing and masks: the same float32 computation, bit for bit
    torch.testing.assert_close(got_values, want_values, rtol=0, atol=0)
    torch.testing.assert_close(got_params, want_params, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lengths_are_integers_whatever_the_masks_dtype(dtype):
    mask = make_batch(8, 6, 5, seed=2)["attention_mask"]
    lengths = Batch({"input_ids": mask.long(), "attention_mask": mask.to(dtype)}).lengths()
    assert lengths == mask.sum(-1).tolist() and all(type(n) is int for n in lengths)
