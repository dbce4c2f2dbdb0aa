"""Fixtures of both verl suites (tests/with_verl/run.sh runs each in its own environment)."""

from __future__ import annotations

import pytest
import torch

from verl_shared import init_single_process, save_tiny_critic


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny critic checkpoint (weights + tokenizer) that verl's workers load like any HF model."""
    return save_tiny_critic(tmp_path_factory.mktemp("tiny_critic"))


@pytest.fixture(scope="session")
def single_process():
    """One gloo rank, as verl's workers expect a process group."""
    init_single_process()
    yield
    torch.distributed.destroy_process_group()
