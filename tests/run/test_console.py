"""What `ppo-critic train` prints: plain lines on a pipe, a bar on a terminal, nothing when told not to."""

from __future__ import annotations

import io

from ppo_critic.run import console

STEP = {"critic/vf_loss": 0.01234, "perf/tokens_per_s": 12_345.0}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_durations_and_rates_read_like_a_person_writes_them():
    assert [console.duration(s) for s in (0, 59.4, 61, 3600 + 62, float("nan"), -1)] == [
        "0:00",
        "0:59",
        "1:01",
        "1:01:02",
        "?",
        "?",
    ]
    assert [console.rate(r) for r in (950, 12_345, 4_100_000)] == ["950", "12.3k", "4.1M"]


def test_a_pipe_gets_a_line_every_log_every_steps_and_at_the_last():
    out = io.StringIO()
    progress = console.Progress(console.mode_for(True, True, out), total=7, start=0, log_every=3, out=out)
    for step in range(1, 8):
        metrics = STEP | ({"eval/ev_true": 0.5 + step / 100} if step == 2 else {})
        progress.update(step, metrics)
    progress.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 3/7", "step 6/7", "step 7/7"]
    # the last evaluation is carried to later lines; loss, throughput, elapsed time and ETA on every line
    assert all("ev_true 0.520" in line and "loss 0.01234" in line and "12.3k tok/s" in line for line in lines)
    assert all("elapsed " in line and "eta " in line for line in lines) and lines[-1].endswith("eta 0:00")
    assert "\r" not in out.getvalue()


def test_a_terminal_gets_a_bar_and_other_ranks_or_no_console_get_nothing():
    term = Terminal()
    assert console.mode_for(True, True, term) == "bar"
    assert console.mode_for(True, False, term) == "lines"  # trainer.progress=false: lines even on a terminal
    bar = console.Progress("bar", total=2, start=0, log_every=1, out=term)
    bar.update(1, STEP)
    bar.update(2, STEP)
    bar.close()
    assert "2/2" in term.getvalue() and "loss=0.0123" in term.getvalue()
    silent = io.StringIO()
    assert console.mode_for(False, True, silent) == "off"
    off = console.Progress("off", total=2, start=0, log_every=1, out=silent)
    off.update(1, STEP)
    off.close()
    assert silent.getvalue() == ""


def test_the_summary_names_what_the_evaluation_was_computed_on():
    final = {"critic/vf_loss": 0.0123, "eval/ev_true": 0.98512, "eval/ev_returns": 0.6, "eval/mae_true": 0.025}
    line = console.summary("done", 400, final, "512 held-out rollouts")
    assert line == (
        "done at step 400 | vf_loss 0.0123 | eval ev_true 0.985, mae_true 0.025, ev_returns 0.600 on 512 held-out "
        "rollouts"
    )
    assert console.summary("run complete", 3, {}, None) == "run complete at step 3"
