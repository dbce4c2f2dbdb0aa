"""What `ppo-critic train` prints while it runs: a tqdm bar on a terminal, else one plain line every `log_every`
steps (log files of nohup / slurm stay readable), and a final summary. Only the first rank prints."""

from __future__ import annotations

import math
import time
from typing import IO, Any

EVAL_KEYS = ("eval/ev_true", "eval/mae_true", "eval/ev_returns")


def duration(seconds: float) -> str:
    """`1:02:03` / `2:03` for a number of seconds (`?` when unknown)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def rate(value: float) -> str:
    """Tokens per second, short: `950`, `12.3k`, `4.1M`."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"


def evaluation(metrics: dict[str, float]) -> str:
    """`ev_true 0.985, mae_true 0.025, ev_returns 0.612` for the evaluation keys present."""
    return ", ".join(f"{key.split('/')[1]} {metrics[key]:.3f}" for key in EVAL_KEYS if key in metrics)


def summary(prefix: str, step: int, metrics: dict[str, float], eval_name: str | None) -> str:
    """The last line of a run: its step, final loss and evaluation, and what the evaluation was computed on."""
    parts = [f"{prefix} at step {step}"]
    if "critic/vf_loss" in metrics:
        parts.append(f"vf_loss {metrics['critic/vf_loss']:.4g}")
    evaluated = evaluation(metrics)
    if evaluated:
        parts.append(f"eval {evaluated}" + (f" on {eval_name}" if eval_name else ""))
    return " | ".join(parts)


class Progress:
    """`mode`: `bar` (tqdm), `lines` (a line every `log_every` steps and at the last) or `off`."""

    def __init__(self, mode: str, total: int, start: int, log_every: int, out: IO[str]):
        self.mode, self.total, self.start, self.log_every, self.out = mode, total, start, log_every, out
        self.began = time.perf_counter()
        self.last_eval: dict[str, float] = {}
        self.bar: Any = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, dynamic_ncols=True, desc="train", file=out)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        self.last_eval |= {k: v for k, v in metrics.items() if k in EVAL_KEYS}
        ev = next((f"{k.split('/')[1]} {self.last_eval[k]:.3f}" for k in EVAL_KEYS[::2] if k in self.last_eval), None)
        loss, tokens = metrics["critic/vf_loss"], metrics.get("perf/tokens_per_s", float("nan"))
        if self.bar is not None:
            postfix = {"loss": f"{loss:.4f}", "tok/s": rate(tokens)} | ({"ev": ev.split()[1]} if ev else {})
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        elif self.mode == "lines" and (step % self.log_every == 0 or step == self.total):
            elapsed = time.perf_counter() - self.began
            eta = elapsed / (step - self.start) * (self.total - step)
            fields = [f"step {step}/{self.total}", f"loss {loss:.4g}", *([ev] if ev else []), f"{rate(tokens)} tok/s"]
            fields += [f"elapsed {duration(elapsed)}", f"eta {duration(eta)}"]
            print(" | ".join(fields), file=self.out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def mode_for(enabled: bool, progress: bool, out: IO[str]) -> str:
    """A bar only on a terminal and when `trainer.progress` asks for one; plain lines otherwise; nothing when
    this rank does not print or `console` is not among the loggers."""
    if not enabled:
        return "off"
    return "bar" if progress and getattr(out, "isatty", lambda: False)() else "lines"
