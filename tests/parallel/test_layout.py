"""`ParallelLayout`: the single-process default, the batch sizes it derives, and the sp check before torchrun."""

from __future__ import annotations

import dataclasses

import pytest

from ppo_critic.config.critic import CriticConfig, RankSizes
from ppo_critic.parallel.layout import ParallelLayout, data_parallel_layout, layout_of


def test_a_single_process_is_the_default_layout():
    layout = data_parallel_layout(1)
    assert layout == ParallelLayout() == layout_of(CriticConfig())
    assert (layout.dp, layout.sp, layout.tp, layout.pp, layout.vpp, layout.data_ranks) == (1, 1, 1, 1, 1, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.dp = 2  # type: ignore[misc]


def test_ulysses_without_torchrun_is_refused():
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=2 needs 2 processes per sequence"):
        layout_of(CriticConfig(ulysses_sequence_parallel_size=2))


def test_rank_sizes_divide_global_sizes_unless_they_are_per_rank():
    config = CriticConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2)
    layout = ParallelLayout(dp=2, sp=2)
    assert layout.data_ranks == 4
    assert layout.rank_sizes(config) == RankSizes.over_ranks(config, 2)
    assert layout.rank_sizes(config).mini_batch == 4
    assert layout.per_rank().rank_sizes(config) == RankSizes.as_given(config, 2)
    assert layout.per_rank().rank_sizes(config).mini_batch == 8
