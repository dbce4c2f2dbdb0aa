"""A failing or stuck rank ends the whole torchrun job with an error, within the configured timeout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_layouts import torchrun

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize(("mode", "message"), [("raise", "injected failure on rank 1"), ("hang", "imed out")])
def test_a_failing_rank_ends_the_job(mode, message):
    start = time.monotonic()
    result = torchrun(str(HERE / "fault_worker.py"), mode, "5", timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
    assert elapsed < 60, elapsed
