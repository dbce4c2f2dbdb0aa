"""metrics.jsonl after crashes: a torn last line is dropped, a damaged earlier one is named, a resume trims."""

from __future__ import annotations

import json

import pytest

from ppo_critic.runlog import RunLog, read_metrics


def test_a_line_torn_by_a_crash_is_not_a_row_and_a_resume_trims_to_its_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')  # killed mid-append
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    log = RunLog(tmp_path, resume_step=1, tensorboard=False)
    log.log(2, {"a": 5.0})
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"step": 1, "a": 1.0}, {"step": 2, "a": 5.0}]


def test_a_damaged_row_before_the_end_is_named_with_its_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": \n{"step": 3}\n')
    with pytest.raises(ValueError, match=f"{path}:2 is not a JSON row"):
        read_metrics(path)
