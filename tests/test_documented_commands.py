"""Every shell command the user is shown runs as written: the ```bash blocks of README.md and of the documents
under docs/ (`DOCUMENTS`; docs/QUALITY.md's research record is left out, see `NOT_RUN`) and the examples of
`ppo-critic --help` (`ppo_critic.cli.EXAMPLES`). A command moved from the README into docs/ stays tested.

Finding the commands: the lines of each ```bash block of those documents, and the indented lines after `examples:` in
`cli.EXAMPLES` up to the first blank line; physical lines are joined over trailing backslashes, `#` comments are
stripped (a `#` at the start of a word, outside quotes, as bash reads it), runs of spaces count as one, and a line
is cut at `&&` and `;` into its commands. Identical commands documented in several places are one test (its id
lists the places).

What runs: commands that run `ppo-critic ...`, `python -m ppo_critic ...`, `torchrun ... -m ppo_critic ...` or
`python examples/*.py`. Everything else must be skipped for a reason in `SKIP_RULES` (the one place the reasons
are listed), and `test_documented_commands_are_run_or_skipped_as_expected` pins the skipped set, so a newly
documented command cannot be skipped silently.

How each command is rewritten to run here, minimally (`rewrite`; the failure message shows the result):
- `ppo-critic` and `python -m ppo_critic` → `<this interpreter> -m ppo_critic`; `torchrun` → `<this interpreter>
  -m torch.distributed.run` (the same launcher); `python examples/X.py` → this interpreter on the repo's file.
- torchrun, one machine with 2 CPU cores: multi-node flags (`--nnodes`, `--node_rank`, `--rdzv_*`,
  `--master_addr`, `--master_port`) are replaced by `--standalone` (added when missing, so the rendezvous takes a
  free port); `--nproc_per_node=N` becomes min(N, max(2, TP × PP)): 2, or 4 for megatron tensor × pipeline 2 × 2.
- `train`: `trainer.steps=2 trainer.eval_every=1` replace any step count (2 steps and an evaluation take little
  time and still save, resume and export); batch sizes are never changed: the defaults must work, also under
  torchrun. An absolute `trainer.run_dir=/x/y` becomes `x/y` inside the working directory.
- `bench`: `repeats=1` replaces any repeat count (the command is tested, not its numbers); sizes are kept.
- The megatron backend (`backend=megatron`, `critic.strategy=megatron`, a bench path `megatron`): megatron-core
  0.16 needs CUDA ("Torch not compiled with CUDA enabled" on CPU), so `-m ppo_critic` is run through a launcher
  that applies the test-only CPU redirect `tests/megatron_cpu.py` (docs/parallel.md, "Testing on CPU") and then runs
  `ppo_critic` as `__main__` with the same arguments.

Working directories: each command runs in a fresh directory of its own holding what commands refer to:
`rollouts.jsonl` (rows sampled from the built-in counting task with `ppo-critic train`'s default task options, so
their token ids fit a model trained by `ppo-critic train`) and `configs/default.yaml` (the repo's). A `values` or
`export` command whose RUN_DIR does not exist gets a copy of the run directory written by the first documented
`train` command with that `trainer.run_dir` (in document order; `runs/default` comes from `ppo-critic train`);
that command runs first (once: its result is shared with its own test), and if it failed the reader fails naming
it. Every command runs with OMP_NUM_THREADS=1 and a timeout of `TIMEOUT_S`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ppo_critic import cli

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600
QUICK_TRAIN = ("trainer.steps=2", "trainer.eval_every=1")
QUICK_BENCH = "repeats=1"
ROLLOUT_ROWS = 64
DEFAULT_RUN_DIR = "runs/default"  # trainer.run_dir's default (pinned against TrainerConfig below)
MULTI_NODE_FLAGS = ("--nnodes", "--node_rank", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id", "--rdzv_conf")
MULTI_NODE_FLAGS += ("--master_addr", "--master_port")
PYTHONS = ("python", "python3")
# documents whose ```bash blocks are not run, and why
NOT_RUN = {
    "docs/QUALITY.md": "the ablation's research record (bench/ablation.py runs of hours each), not commands to try",
}
DOCUMENTS = ["README.md", *(p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").glob("*.md")))]
DOCUMENTS = [name for name in DOCUMENTS if name not in NOT_RUN]

# --------------------------------------------------------------------------------------------------------------
# What is not run, and why: (reason, does this command get it?) — checked in order; the first match wins.

SETUP = "environment setup (creating and entering the virtual environment, installing: done before the tests run)"
CI = "CI's own lint and test steps (`pytest -q` would run this file again, as would tests/with_gpu_stack); CI runs them"
VERL = "verl: its test suites (CI runs tests/with_verl/run.sh itself) and verl's own trainer (needs verl, Ray, GPUs)"
CUDA = "needs CUDA, which this machine does not have"
GENERATE = "rewrites docs/options.md in this repository; tests/test_docs.py checks the file is what it writes"


def _is_setup(argv: list[str]) -> bool:
    return (
        argv[:1] in (["cd"], ["."], ["source"], ["export"])
        or argv[:2] in (["pip", "install"], ["git", "clone"])
        or (argv[0] in PYTHONS and argv[1:3] == ["-m", "venv"])
    )


def _is_verl(argv: list[str]) -> bool:
    verl_suite = argv[0] == "bash" and len(argv) > 1 and argv[1].startswith("tests/with_verl/")
    verl_module = argv[0] in PYTHONS and argv[1:2] == ["-m"] and argv[2:3] != [] and argv[2].startswith("verl.")
    return verl_suite or verl_module


def _needs_cuda(argv: list[str]) -> bool:
    return any(re.fullmatch(r"(\S*\.)?device=cuda(:\d+)?", a) for a in argv) or any(
        "offload=true" in a for a in argv
    )  # FSDP2 CPU offload: CUDA + torchrun only (docs/python.md)


SKIP_RULES = (
    (SETUP, _is_setup),
    (CI, lambda argv: argv[0] in ("ruff", "pytest") or argv[:2] == ["bash", "tests/with_gpu_stack/run.sh"]),
    (VERL, _is_verl),
    (CUDA, _needs_cuda),
    (GENERATE, lambda argv: argv[0] in PYTHONS and argv[1:3] == ["-m", "ppo_critic.config.reference"]),
)

# The commands skipped today, as documented. A new documented command that a rule skips fails the inventory test
# until it is added here (or made to run).
EXPECTED_SKIPPED = {
    "python3 -m venv .venv": SETUP,
    ". .venv/bin/activate": SETUP,
    "pip install torch==2.13.0": SETUP,
    "pip install -e .": SETUP,
    "pip install -e '.[dev]'": SETUP,
    "export VERL_USE_EXTERNAL_MODULES=ppo_critic.integrations.verl": SETUP,
    "ruff check .": CI,
    "ruff format --check .": CI,
    "pytest -q": CI,
    "bash tests/with_gpu_stack/run.sh": CI,
    "bash tests/with_verl/run.sh 0.7.1": VERL,
    "bash tests/with_verl/run.sh 0.9.1": VERL,
    "python -m verl.trainer.main_ppo algorithm.adv_estimator=gae critic.strategy=fsdp2 ...": VERL,
    "python -m verl.trainer.main_ppo algorithm.adv_estimator=gae critic.strategy=ppo_critic ...": VERL,
    "python -m ppo_critic.config.reference > docs/options.md": GENERATE,
}

# --------------------------------------------------------------------------------------------------------------
# Finding the documented commands


@dataclass
class Documented:
    text: str  # the command as documented (one logical line, comment stripped, one command of an && chain)
    where: list[str] = field(default_factory=list)  # "README.md:12", "docs/verl.md:30", "cli.EXAMPLES:3"

    @property
    def id(self) -> str:
        return f"{'+'.join(self.where)}: {self.text}"


def strip_comment(line: str) -> str:
    """`line` without its `#` comment: a `#` that starts a word, outside quotes (bash's rule)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def split_commands(line: str) -> list[str]:
    """The commands of a line, cut at `&&` and `;` outside quotes."""
    parts, quote, start, i = [], None, 0, 0
    while i < len(line):
        ch = line[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif line.startswith("&&", i) or ch == ";":
            parts.append(line[start:i])
            i += 1 if ch == ";" else 2
            start = i
            continue
        i += 1
    parts.append(line[start:])
    return [p.strip() for p in parts if p.strip()]


def logical_commands(lines: list[tuple[int, str]], source: str) -> list[Documented]:
    """`(line number, text)` of physical lines → commands, joined over trailing backslashes, comments stripped."""
    found, pending, first = [], "", None
    for number, raw in lines:
        text = strip_comment(raw)
        first = number if first is None else first
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            continue
        joined = " ".join((pending + text).split())  # runs of spaces (e.g. a joined --help line) as one
        found += [Documented(c, [f"{source}:{first}"]) for c in split_commands(joined)]
        pending, first = "", None
    assert not pending, f"{source}: a command ends with a backslash and nothing follows: {pending!r}"
    return found


def document_commands(name: str) -> list[Documented]:
    """The commands of the ```bash blocks of one document (`name` relative to the repository)."""
    lines, inside = [], False
    for number, line in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip().startswith("```"):
            inside = line.strip() == "```bash"
        elif inside:
            lines.append((number, line))
    return logical_commands(lines, name)


def help_example_commands() -> list[Documented]:
    text = cli.EXAMPLES.splitlines()
    assert text and text[0].strip() == "examples:", f"cli.EXAMPLES no longer starts with 'examples:': {text[:1]}"
    lines = []
    for number, line in enumerate(text[1:], start=1):
        if not line.strip():
            break
        lines.append((number, line))
    return logical_commands(lines, "cli.EXAMPLES")


def documented_commands() -> list[Documented]:
    """The documents' commands, then --help's, each once (documented in several places: the places are listed)."""
    by_text: dict[str, Documented] = {}
    for command in [*(c for name in DOCUMENTS for c in document_commands(name)), *help_example_commands()]:
        if command.text in by_text:
            by_text[command.text].where += command.where
        else:
            by_text[command.text] = command
    return list(by_text.values())


def argv_of(command: Documented) -> list[str]:
    return shlex.split(command.text)


def skip_reason(argv: list[str]) -> str | None:
    return next((reason for reason, applies in SKIP_RULES if applies(argv)), None)


def ppo_args(argv: list[str]) -> list[str] | None:
    """The arguments given to ppo_critic by `ppo-critic ...`, `python -m ppo_critic ...` or `torchrun ... -m
    ppo_critic ...`; None for any other command."""
    if argv[0] == "ppo-critic":
        return argv[1:]
    if argv[0] in PYTHONS and argv[1:3] == ["-m", "ppo_critic"]:
        return argv[3:]
    m = _module_index(argv) if argv[0] == "torchrun" else None
    return argv[m + 2 :] if m is not None else None


def _module_index(argv: list[str]) -> int | None:
    """The index of `-m` in `torchrun ... -m ppo_critic ...`."""
    return next((i for i in range(len(argv) - 1) if argv[i : i + 2] == ["-m", "ppo_critic"]), None)


def is_example(argv: list[str]) -> bool:
    return argv[0] in PYTHONS and len(argv) > 1 and re.fullmatch(r"examples/[\w.-]+\.py", argv[1]) is not None


def is_runnable(argv: list[str]) -> bool:
    return ppo_args(argv) is not None or is_example(argv)


COMMANDS = documented_commands()
RUNNABLE = [c for c in COMMANDS if is_runnable(argv_of(c))]

# --------------------------------------------------------------------------------------------------------------
# Rewriting a command to run here

MEGATRON_LAUNCHER = """\
# ppo_critic's command line with megatron-core redirected to the CPU (test-only: tests/megatron_cpu.py)
import runpy
import sys

sys.path.insert(0, {tests!r})
from megatron_cpu import redirect_cuda_to_cpu

redirect_cuda_to_cpu()
runpy.run_module("ppo_critic", run_name="__main__", alter_sys=True)
"""


def _value(args: list[str], *keys: str) -> str | None:
    """The last `key=value` of any of `keys` (later overrides win, as in the command line)."""
    found = None
    for a in args:
        key, _, value = a.partition("=")
        if key in keys:
            found = value
    return found


def uses_megatron(args: list[str]) -> bool:
    if _value(args, "backend", "critic.strategy") == "megatron":
        return True
    paths = _value(args, "paths") if args[:1] == ["bench"] else None
    return paths is not None and any(p.split("+")[0] == "megatron" for p in paths.split(","))


def ranks_needed(args: list[str]) -> int:
    tp = _value(args, "megatron.tensor_model_parallel_size", "critic.megatron.tensor_model_parallel_size")
    pp = _value(args, "megatron.pipeline_model_parallel_size", "critic.megatron.pipeline_model_parallel_size")
    return int(tp or 1) * int(pp or 1) if uses_megatron(args) else 1


def rewrite_args(args: list[str]) -> list[str]:
    """The ppo_critic arguments: a quick `train` or `bench`, an absolute run directory moved into the working
    directory."""
    if args[:1] == ["bench"]:  # one timed repeat: the command is what is tested here, not the numbers
        return [*(a for a in args if not a.startswith("repeats=")), QUICK_BENCH]
    if args[:1] != ["train"]:
        return list(args)
    steps = {q.split("=")[0] for q in QUICK_TRAIN}
    out = [a for a in args if a.split("=")[0] not in steps]
    out = [re.sub(r"^trainer\.run_dir=/+", "trainer.run_dir=", a) for a in out]
    return [*out, *QUICK_TRAIN]


def rewrite_torchrun(options: list[str], nproc_needed: int) -> list[str]:
    """torchrun's own options on one 2-core machine: standalone, 2 processes (more only if the layout needs them)."""
    out, i = [], 0
    while i < len(options):
        option, separate = options[i], "=" not in options[i]  # --flag=value or --flag value
        name = option.split("=")[0]
        value = options[i + 1] if separate and i + 1 < len(options) else option.partition("=")[2]
        if name == "--nproc_per_node":
            out.append(f"--nproc_per_node={min(int(value), max(2, nproc_needed))}")
        elif name not in MULTI_NODE_FLAGS:
            out.append(option)
            i += 1
            continue
        i += 2 if separate else 1
    return out if "--standalone" in out else ["--standalone", *out]


def rewrite(argv: list[str], workdir: Path) -> list[str]:
    """The argv that runs the documented `argv` here (see the module docstring); writes the megatron launcher into
    `workdir` when the command needs it."""
    python = [sys.executable]
    if is_example(argv):
        return [*python, str(ROOT / argv[1]), *argv[2:]]
    args = ppo_args(argv)
    launcher = argv[1 : _module_index(argv)] if argv[0] == "torchrun" else None
    program = ["-m", "ppo_critic"]
    if uses_megatron(args):
        script = workdir / "ppo_critic_megatron_on_cpu.py"
        script.write_text(MEGATRON_LAUNCHER.format(tests=str(ROOT / "tests")))
        program = [script.name]
    args = rewrite_args(args)
    if launcher is None:
        return [*python, *program, *args]
    torchrun = rewrite_torchrun(launcher, ranks_needed(args))
    return [*python, "-m", "torch.distributed.run", *torchrun, *program, *args]


# --------------------------------------------------------------------------------------------------------------
# Running


@dataclass
class Result:
    argv: list[str]
    cwd: Path
    returncode: int | None  # None: killed at the timeout
    output: str
    seconds: float

    def report(self, command: Documented) -> str:
        status = f"timed out after {TIMEOUT_S}s" if self.returncode is None else f"exited {self.returncode}"
        errors = [line.strip() for line in self.output.splitlines() if re.search(r"Error\b|error:", line)]
        errors = list(dict.fromkeys(errors))[-6:]
        return (
            f"`{command.text}` ({', '.join(command.where)}) {status} after {self.seconds:.0f}s\n"
            f"  ran: {shlex.join(self.argv)}\n  in:  {self.cwd}\n"
            + "".join(f"  error line: {e}\n" for e in errors)
            + f"--- last 3000 characters of its output ---\n{self.output[-3000:]}"
        )


def run(argv: list[str], cwd: Path) -> Result:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the command's own process group: torchrun and its workers
        output, _ = proc.communicate()
        returncode = None
    return Result(argv, cwd, returncode, output, time.monotonic() - start)


def rollout_rows() -> list[dict]:
    """Rows of the counting task with `ppo-critic train`'s default task options (token ids fit its model)."""
    import torch

    from ppo_critic.config.train import TrainConfig
    from ppo_critic.tasks import TASKS

    config = TrainConfig()
    task = TASKS[config.task["name"]][0](config.task_config())
    batch = task.sample(ROLLOUT_ROWS, torch.Generator().manual_seed(0))
    width = batch["responses"].shape[1]
    prompt_end = batch["input_ids"].shape[1] - width
    rows = []
    for i in range(ROLLOUT_ROWS):
        prompt = batch["input_ids"][i, :prompt_end][batch["attention_mask"][i, :prompt_end].bool()]
        valid = batch["response_mask"][i].bool()
        rows.append(
            {
                "prompt_ids": prompt.tolist(),
                "response_ids": batch["responses"][i][valid].tolist(),
                "token_level_rewards": batch["token_level_rewards"][i][valid].tolist(),
            }
        )
    return rows


def run_dir_of(args: list[str]) -> str:
    return _value(args, "trainer.run_dir") or DEFAULT_RUN_DIR


class Runner:
    """Runs each documented command once, in a fresh working directory, writing its inputs first."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory):
        self.tmp = tmp_path_factory
        self.results: dict[str, Result] = {}
        self.rollouts = "".join(json.dumps(row) + "\n" for row in rollout_rows())

    def result(self, command: Documented) -> Result:
        if command.text not in self.results:
            self.results[command.text] = self._run(command)
        return self.results[command.text]

    def _run(self, command: Documented) -> Result:
        workdir = self.tmp.mktemp(re.sub(r"\W+", "_", command.text)[:40])
        (workdir / "rollouts.jsonl").write_text(self.rollouts)
        (workdir / "configs").mkdir()
        shutil.copy(ROOT / "configs" / "default.yaml", workdir / "configs" / "default.yaml")
        argv = rewrite(argv_of(command), workdir)
        self._copy_run_it_reads(argv_of(command), workdir)
        return run(argv, workdir)

    def _copy_run_it_reads(self, argv: list[str], workdir: Path) -> None:
        args = ppo_args(argv) or []
        if args[:1] not in (["values"], ["export"]) or len(args) < 2 or (workdir / args[1]).exists():
            return
        run_dir = args[1].rstrip("/")
        producer = next((c for c in RUNNABLE if _trains_into(c, run_dir)), None)
        assert producer is not None, f"no documented `train` command writes {run_dir}, which `{shlex.join(argv)}` reads"
        made = self.result(producer)
        if made.returncode != 0:
            pytest.fail(f"needs {run_dir} from `{producer.text}`, which failed:\n{made.report(producer)}")
        shutil.copytree(made.cwd / run_dir, workdir / run_dir)


def _trains_into(command: Documented, run_dir: str) -> bool:
    args = ppo_args(argv_of(command)) or []
    return args[:1] == ["train"] and run_dir_of(args) == run_dir


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return Runner(tmp_path_factory)


# --------------------------------------------------------------------------------------------------------------
# Tests


def test_documented_commands_are_run_or_skipped_as_expected():
    unclassified, skipped = [], {}
    for command in COMMANDS:
        argv = argv_of(command)
        reason = skip_reason(argv)
        if reason is not None:
            skipped[command.text] = reason
        elif not is_runnable(argv):
            unclassified.append(command.id)
    assert not unclassified, f"documented commands neither run nor skipped for a listed reason: {unclassified}"
    assert skipped == EXPECTED_SKIPPED, (
        "the skipped documented commands changed:\n"
        f"  newly skipped: {sorted(set(skipped.items()) - set(EXPECTED_SKIPPED.items()))}\n"
        f"  no longer skipped (or documented): {sorted(set(EXPECTED_SKIPPED.items()) - set(skipped.items()))}"
    )
    # every source is read: a change of a document's or --help's format must not make their commands vanish
    for source in ("README.md", "docs/parallel.md", "docs/performance.md", "cli.EXAMPLES"):
        assert any(w.startswith(source) for c in RUNNABLE for w in c.where), f"no runnable command found in {source}"
    assert "docs/verl.md" in DOCUMENTS and all((ROOT / name).is_file() for name in NOT_RUN)
    runnable_and_skipped = [c.text for c in RUNNABLE if c.text in skipped]
    assert not runnable_and_skipped, f"a command both runs and is skipped: {runnable_and_skipped}"


def test_extraction_and_rewrites(tmp_path):
    """The parsing and rewriting rules on the forms documented today (so the command tests run what they say)."""
    joined = logical_commands(
        [(1, "torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=x \\"), (2, "  -m ppo_critic train  # note 'q' #")],
        "doc",
    )
    assert [(c.text, c.where) for c in joined] == [
        ("torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=x -m ppo_critic train", ["doc:1"])
    ]
    assert split_commands("a && b 'x && y'; c") == ["a", "b 'x && y'", "c"]
    assert strip_comment("echo 'a # b' a#b # c") == "echo 'a # b' a#b"
    py = sys.executable
    argv = shlex.split(joined[0].text + " trainer.steps=50 trainer.run_dir=/shared/r critic.ppo_mini_batch_size=8")
    assert rewrite(argv, tmp_path) == [
        *(py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "ppo_critic", "train"),
        *("trainer.run_dir=shared/r", "critic.ppo_mini_batch_size=8", *QUICK_TRAIN),
    ]
    megatron = "torchrun --nproc_per_node 8 -m ppo_critic train backend=megatron megatron.tensor_model_parallel_size=2"
    rewritten = rewrite(shlex.split(megatron + " megatron.pipeline_model_parallel_size=2"), tmp_path)
    assert rewritten[3:6] == ["--standalone", "--nproc_per_node=4", "ppo_critic_megatron_on_cpu.py"]
    assert (tmp_path / "ppo_critic_megatron_on_cpu.py").is_file()
    bench = ["ppo-critic", "bench", "paths=padded", "repeats=3", "out=b.json"]
    assert rewrite(bench, tmp_path) == [py, "-m", "ppo_critic", "bench", "paths=padded", "out=b.json", QUICK_BENCH]
    export = ["export", "runs/default", "out/"]
    assert rewrite(["ppo-critic", *export], tmp_path) == [py, "-m", "ppo_critic", *export]
    assert rewrite(["python", "-m", "ppo_critic", *export], tmp_path) == [py, "-m", "ppo_critic", *export]
    assert rewrite(["python", "examples/quickstart.py", "--steps", "2"], tmp_path) == [
        *(py, str(ROOT / "examples" / "quickstart.py"), "--steps", "2")
    ]
    from ppo_critic.config.train import TrainerConfig

    assert TrainerConfig().run_dir == DEFAULT_RUN_DIR


@pytest.mark.parametrize("command", RUNNABLE, ids=[c.id for c in RUNNABLE])
def test_documented_command_runs(command: Documented, runner: Runner):
    result = runner.result(command)
    assert result.returncode == 0, result.report(command)


def test_a_failing_command_fails_with_its_command_and_error(runner: Runner):
    """The harness sees a failure and its message names the command and the error (a bad option exits 2)."""
    command = Documented("ppo-critic train no_such_option=1", ["test"])
    result = runner.result(command)
    assert result.returncode == 2, result.report(command)
    report = result.report(command)
    assert "`ppo-critic train no_such_option=1` (test) exited 2" in report
    assert "no_such_option" in report.split("--- last 3000 characters")[0]  # on an error line, not only the tail
