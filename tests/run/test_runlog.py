"""metrics.jsonl after crashes: a torn last line is dropped, a damaged earlier one is named, a resume trims; every
row carries `time` and `elapsed_s`, and the run's elapsed time continues across a resume."""

from __future__ import annotations

import json
import time

import pytest

from conftest import without_timings
from ppo_critic.run.runlog import RunLog, read_metrics


def test_a_line_torn_by_a_crash_is_not_a_row_and_a_resume_trims_to_its_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')  # killed mid-append
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    log = RunLog(tmp_path, resume_step=1, loggers=["jsonl"])
    log.log(2, {"a": 5.0})
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0] == {"step": 1, "a": 1.0}
    assert without_timings(rows[1]) == {"step": 2, "a": 5.0}


def test_a_damaged_row_before_the_end_is_named_with_its_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": \n{"step": 3}\n')
    with pytest.raises(ValueError, match=f"{path}:2 is not a JSON row"):
        read_metrics(path)


def test_rows_carry_time_and_elapsed_which_continues_across_a_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "elapsed_s": 50.0}\n{"step": 2, "elapsed_s": 100.0}\n{"step": 3, "elapsed_s": 150.0}\n'
    )
    before = time.time()
    log = RunLog(tmp_path, resume_step=2, loggers=["console", "jsonl"])
    time.sleep(0.05)
    log.log(3, {"a": 3.0})
    log.log(4, {"a": 4.0})
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert before - 0.001 <= rows[2]["time"] <= rows[3]["time"] <= time.time() + 0.001  # rounded to ms
    assert 100.05 <= rows[2]["elapsed_s"] <= rows[3]["elapsed_s"] < 100.0 + (time.time() - before) + 0.001


def test_a_new_run_counts_from_zero_and_without_jsonl_writes_no_metrics_file(tmp_path):
    log = RunLog(tmp_path / "a", loggers=["jsonl"])
    log.log(1, {"a": 1.0})
    log.close()
    assert 0 <= json.loads((tmp_path / "a" / "metrics.jsonl").read_text())["elapsed_s"] < 5
    (tmp_path / "b").mkdir()
    log = RunLog(tmp_path / "b", loggers="console")
    log.log(1, {"a": 1.0})
    log.close()
    assert list((tmp_path / "b").iterdir()) == []


def test_an_unknown_logger_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.logger: unknown logger 'jsonll'; did you mean 'jsonl'\?"):
        RunLog(tmp_path, loggers=["jsonll"])
    assert list(tmp_path.iterdir()) == []
