"""`ppo-critic` (also `python -m ppo_critic`): train, values, bench, export.

Configs are YAML files plus `key=value` overrides (OmegaConf dot-list) over the built-in defaults of
`ppo_critic.config.train.TrainConfig`. Bad options exit with code 2 and a message that names the key. Help, the
version and option errors never import torch: the commands import what they run when they run.
"""

from __future__ import annotations

import argparse
import json
import pickle
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

from ppo_critic.config import reference
from ppo_critic.config.train import TrainConfig, load_options, read_yaml_options

EXAMPLES = """examples:
  ppo-critic train                                   # the built-in counting task, tiny model, runs/default
  ppo-critic train trainer.steps=50 trainer.run_dir=runs/short critic.optim.lr=1e-3
  ppo-critic train --config configs/default.yaml data=rollouts.jsonl trainer.run_dir=runs/file
  ppo-critic values runs/default data=rollouts.jsonl out=values.jsonl
  ppo-critic export runs/default critic-hf/
  ppo-critic bench paths=padded,packed repeats=3 out=bench.json   # throughput vs the padded HF baseline
  torchrun --nproc_per_node=4 -m ppo_critic train backend=megatron megatron.tensor_model_parallel_size=2 \
      megatron.pipeline_model_parallel_size=2          # megatron-core on CUDA GPUs (pip install 'ppo-critic[megatron]')

`backend=X` is short for critic.strategy=X (fsdp2, fsdp, ddp, none, megatron) and `megatron.K=V` for
critic.megatron.K=V. Runs of the megatron backend are resumed, exported and evaluated under torchrun with the
layout (world size, TP, PP) they were trained with.
"""
OPTIONS_TITLE = "options (key=value; the default, then what it does):"
ALIASES = {"backend": "critic.strategy", "megatron.": "critic.megatron."}
# what a saved config may not decide: options that import or run code (only this command line sets them)
CODE_FREE = {"trust_remote_code": False, "external_lib": None}
# what `values` takes from the command line (beside data= and out=): how the forward runs, never what the model's
# outputs mean, which is the run's or the export's
VALUES_OPTIONS = (
    "trainer.device",
    "trainer.dist_timeout_s",
    "trainer.rollout_batch_size",
    "critic.ppo_mini_batch_size",
    "critic.rollout_n",
    "critic.ppo_micro_batch_size",
    "critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size",
    "critic.forward_micro_batch_size_per_gpu",
    "critic.use_dynamic_bsz",
    "critic.ppo_max_token_len_per_gpu",
    "critic.forward_max_token_len_per_gpu",
    "critic.ulysses_sequence_parallel_size",
    "critic.dtype",
    "critic.model.use_remove_padding",
    "critic.model.attn_implementation",
    "critic.model.use_torch_compile",
    "critic.model.tokenizer_path",
    "critic.model.trust_remote_code",
    "critic.model.external_lib",
)


# a missing module -> the extra that installs it
EXTRAS = {"megatron": "megatron", "peft": "lora", "verl": "verl", "wandb": "wandb", "mlflow": "mlflow"}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a kill (e.g. a scheduler's) ends like Ctrl-C
    try:
        return args.run(args)
    except (ValueError, TypeError, OSError, pickle.UnpicklingError) as err:  # options, files, disks
        _fail(args.subparser, str(err))
    except KeyboardInterrupt:
        _fail(args.subparser, "interrupted; nothing partial was written")
    except ModuleNotFoundError as err:
        package = (err.name or "").split(".")[0]
        extra = EXTRAS.get(package)
        hint = f"pip install 'ppo-critic[{extra}]'" if extra else f"install {package}"
        _fail(args.subparser, f"this needs the {package} package, which is not installed: {hint}")
    except MemoryError as err:
        _fail(args.subparser, f"out of memory ({err or 'MemoryError'}); use a smaller model or batch")
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 2


def _fail(subparser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exit 2 with one line, `ppo-critic <command>: error: <message>`: the message names the key and the fix, so
    no usage text is printed above it."""
    subparser.exit(2, f"{subparser.prog}: error: {message}\n")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppo-critic",
        description="Train and use PPO value models (critics) for LLMs.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command")
    train_options = reference.render_help(reference.train_options(TrainConfig()), reference.HELP_SECTIONS)
    train = sub.add_parser(
        "train",
        help="train a critic on the built-in task or a rollout file",
        description="Train a critic. Writes config.yaml, metrics.jsonl, tensorboard/, curves.png, checkpoints/ "
        "and hf/ under trainer.run_dir; trainer.resume=auto continues from the newest complete checkpoint.",
        epilog=f"{OPTIONS_TITLE}\n\n{train_options}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", type=Path, help="a YAML file of options (applied before the overrides)")
    train.add_argument(
        "--print-config",
        action="store_true",
        help="print the options this command would train with, as YAML with what each does, and exit "
        "(without options: configs/default.yaml)",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="with trainer.resume=never: move a run already in trainer.run_dir aside (renamed, never deleted)",
    )
    train.add_argument("overrides", nargs="*", metavar="key=value", help="options, e.g. trainer.steps=100")
    train.set_defaults(run=_train, subparser=train)
    values = sub.add_parser(
        "values",
        help="write per-token values of a rollout file",
        description="Per-token values of every row of a rollout file (.jsonl/.parquet), in the input order.",
    )
    values.add_argument("source", type=Path, help="a run directory (its newest checkpoint) or an HF model directory")
    values.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="data=FILE out=FILE, and how the forward runs: " + ", ".join(VALUES_OPTIONS) + ". What the outputs "
        "mean (objective, value normalisation, the model) is the run's or the export's",
    )
    values.add_argument("--force", action="store_true", help="replace an existing out= file")
    values.set_defaults(run=_values, subparser=values)
    bench = sub.add_parser(
        "bench",
        help="throughput of the critic paths (padded baseline, packed, megatron) side by side",
        description="Valid tokens/s, MFU and peak memory of compute_values and update_critic for each path, and "
        "the ratio to the padded HF baseline measured in the same run. Defaults: the Qwen2.5-0.5B shape and "
        "32 x (512 + 1024) rollouts in bf16 on CUDA; a small model in fp32 on CPU.",
        epilog=f"{OPTIONS_TITLE}\n{reference.render_help(reference.bench_options())}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. paths=padded,packed layers=4")
    bench.set_defaults(run=_bench, subparser=bench)
    export = sub.add_parser("export", help="export a run's newest checkpoint as an HF model (safetensors)")
    export.add_argument("run_dir", type=Path)
    export.add_argument("out_dir", type=Path, help="a new (or empty) directory")
    export.add_argument(
        "--force", action="store_true", help="move an existing out_dir aside first (renamed, never deleted)"
    )
    export.set_defaults(run=_export, subparser=export)
    return parser


def load_config(yaml_file: Path | None, overrides: list[str], base: dict | None = None) -> TrainConfig:
    """Defaults (or `base`) ← YAML file ← overrides, checked key by key."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ValueError(f"overrides must look like key=value, got {bad}")
    overrides = [_expand_alias(o) for o in overrides]
    return load_options(overrides, base, None if yaml_file is None else _file_options(yaml_file))


def _file_options(yaml_file: Path) -> Any:
    """The options of a YAML file; a run's saved config (config.yaml of a run directory) decides no option that
    imports or runs code (`CODE_FREE`): opening a run directory's files runs no code, only this command line may."""
    from omegaconf import OmegaConf

    from ppo_critic.run.rundir import ADDED_OPTIONS, CONFIG_FILE, is_run_dir

    loaded = OmegaConf.create(read_yaml_options(yaml_file))
    if yaml_file.name == CONFIG_FILE and is_run_dir(yaml_file.resolve().parent) and OmegaConf.is_dict(loaded):
        for key, safe in CODE_FREE.items():
            if OmegaConf.select(loaded, f"critic.model.{key}") is not None:
                OmegaConf.update(loaded, f"critic.model.{key}", safe, merge=False)
        absent = object()
        for key, meant in ADDED_OPTIONS.items():  # what the run meant by a key its version did not have yet
            if OmegaConf.select(loaded, key, default=absent) is absent:
                OmegaConf.update(loaded, key, meant, merge=False)
    return loaded


def _expand_alias(override: str) -> str:
    """`backend=X` -> `critic.strategy=X`; `megatron.K=V` -> `critic.megatron.K=V`."""
    key, value = override.split("=", 1)
    for short, full in ALIASES.items():
        if key == short or (short.endswith(".") and key.startswith(short)):
            return f"{full}{key[len(short) :]}={value}"
    return override


def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(reference.render_yaml(cfg), end="")
        return 0
    try:
        from ppo_critic.train import Interrupted, train  # seconds of imports: an interrupt may land here too

        train(cfg, overwrite=args.overwrite)  # the trainer reports (on rank 0)
    except KeyboardInterrupt:  # before training started (imports, reading the rollouts, building the model)
        _fail(args.subparser, f"interrupted before training started; nothing was written. {_rerun(cfg)}")
    except Interrupted as err:  # (bound: the import succeeded, or the clause above matched first)
        _fail(args.subparser, str(err))
    return 0


def _rerun(cfg: TrainConfig) -> str:
    """What the same command does after an interrupt: resume from the run's newest checkpoint, or start."""
    from ppo_critic.run.checkpoint import latest_checkpoint

    resume = cfg.trainer.resume
    if resume not in ("auto", "never"):
        return f"Run the same command to resume from {resume}"
    newest = latest_checkpoint(Path(cfg.trainer.run_dir) / "checkpoints") if resume == "auto" else None
    return f"Run the same command to resume from {f'the newest checkpoint ({newest})' if newest else 'the start'}"


def _bench(args: argparse.Namespace) -> int:
    from ppo_critic.config.bench import parse_options

    cfg = parse_options(args.overrides)  # a mistyped option is an error before torch is imported

    from ppo_critic.throughput import run_and_report

    run_and_report(cfg)
    return 0


def _values(args: argparse.Namespace) -> int:
    from ppo_critic.backends.build import model_limits
    from ppo_critic.data.rows import collate
    from ppo_critic.rollout_files.read import read_rollouts, tokenizer_dir
    from ppo_critic.rollout_files.write import write_values
    from ppo_critic.run.rundir import check_output

    pairs = dict(o.split("=", 1) for o in args.overrides if o.split("=", 1)[0] in ("data", "out"))
    if "data" not in pairs or "out" not in pairs:
        raise ValueError("values needs data=<rollout file> and out=<output .jsonl/.parquet>")
    data, out = Path(pairs["data"]), Path(pairs["out"])
    check_output(out, "file", inputs=[data], force=args.force)
    rest = [o for o in args.overrides if o.split("=", 1)[0] not in ("data", "out")]
    cfg = _config_for(args.source, rest)
    vocab_size, positions = model_limits(cfg.critic.model)  # no row may be longer than the model's positions
    rows = read_rollouts(data, vocab_size=vocab_size, tokenizer=tokenizer_dir(cfg.critic.model), max_length=positions)
    worker = _worker_of(args.source, cfg)  # the model is built once the inputs are known to be good
    chunk = cfg.trainer.rollout_batch_size
    values: list[list[float]] = []
    for start in range(0, len(rows), chunk):
        batch = collate(rows[start : start + chunk])
        values_of = worker.compute_values(batch)
        values += [v[m.bool()].tolist() for v, m in zip(values_of, batch["response_mask"], strict=True)]
    if worker.rank == 0:  # under torchrun every rank has the values; the first writes and reports them
        write_values(out, values, replace=args.force)  # a file another command wrote meanwhile is kept
        print(f"wrote values of {len(values)} rollouts to {out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from ppo_critic.run.rundir import check_output, is_run_dir

    if not is_run_dir(args.run_dir):
        raise FileNotFoundError(f"{args.run_dir} is not a run directory (no config.yaml)")
    check_output(args.out_dir, "directory", inputs=[], force=args.force, move=False)
    worker = _worker_of(args.run_dir, _config_for(args.run_dir, []))  # verified and loaded before anything is written

    def moved(aside: Path) -> None:
        print(f"moved the previous {args.out_dir} aside to {aside}")

    # with --force, OUT is moved aside only once the new export is whole (a failure leaves it where it was)
    out = worker.export_hf(args.out_dir, replace=moved if args.force else False)
    if worker.rank == 0:
        print(f"exported step {worker.step} of {args.run_dir} to {out}")
    return 0


def _config_for(source: Path, overrides: list[str]) -> TrainConfig:
    """The options of a run directory (its config.yaml) or of an HF model directory, checked without building the
    model: a missing checkpoint or an incomplete critic is refused here, before any slow work.

    What the model's outputs mean (its objective, value normalisation, the model itself) is the run's or the
    export's: the command line may set only how the forward runs (`VALUES_OPTIONS`) or repeat a saved value. Options
    that import or execute code (critic.model.trust_remote_code, critic.model.external_lib) come only from this
    command line, never from the run directory's saved config: opening someone's run directory runs no code.
    """
    from omegaconf import OmegaConf

    from ppo_critic.run.checkpoint import latest_checkpoint
    from ppo_critic.run.rundir import is_run_dir

    if is_run_dir(source):
        base = OmegaConf.to_container(OmegaConf.load(source / "config.yaml"))
        base.setdefault("critic", {}).setdefault("model", {}).update(CODE_FREE)
        if latest_checkpoint(source / "checkpoints") is None:
            raise FileNotFoundError(f"{source} has no complete checkpoint under checkpoints/")
        return _kept_meaning(overrides, [], base, source / "config.yaml")
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is neither a run directory nor a model directory")
    from ppo_critic.models.hf import check_trained_critic

    check_trained_critic(source)  # every tensor a critic needs, or a refusal naming what is missing
    declared = [*_exported_objective(source, overrides), f"critic.model.path={source}"]
    return _kept_meaning(overrides, declared, None, source / "config.json")


def _kept_meaning(overrides: list[str], fixed: list[str], base: dict | None, where: Path) -> TrainConfig:
    """The source's options (`base` ← `fixed`) with the command line's `overrides`, which may change only
    `VALUES_OPTIONS`; any other option that differs from the source's is refused, every key named."""
    from ppo_critic.config.ranks import flat_options

    saved = flat_options(load_config(None, [*fixed, "trainer.resume=never"], base=base).to_dict())
    cfg = load_config(None, [*fixed, *overrides, "trainer.resume=never"], base=base)
    now = flat_options(cfg.to_dict())
    differ = [k for k in sorted(now) if now[k] != saved.get(k) and k not in VALUES_OPTIONS]
    if differ:
        listed = "; ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in differ)
        raise ValueError(
            f"values reads these options from {where}, not from the command line ({listed}): they are the "
            "model's, what its outputs mean among them; drop them (values takes data=, out= and how the forward "
            "runs: ppo-critic values --help)"
        )
    return cfg


def _worker_of(source: Path, cfg: TrainConfig) -> Any:
    """The worker of `_config_for`'s options: for a run directory, with its newest checkpoint loaded."""
    from ppo_critic.run.checkpoint import CheckpointDamaged
    from ppo_critic.run.rundir import is_run_dir
    from ppo_critic.train import make_worker

    worker = make_worker(cfg)
    if not is_run_dir(source):
        return worker
    try:
        _load_newest(worker, source / "checkpoints")
    except CheckpointDamaged as err:  # never an older checkpoint in silence
        raise CheckpointDamaged(
            f"{err}; restore it from a copy, or run `ppo-critic train` on {source} again (it resumes from the "
            "newest checkpoint that verifies and saves that step anew, moving the damaged one aside)"
        ) from err
    return worker


def _load_newest(worker: Any, root: Path, tries: int = 5) -> None:
    """Load the newest checkpoint under `root` into `worker`. A training run beside this command may delete it
    (`keep_last_n`) while it loads: then the newest one again, a few times (a damaged one that stays is an error)."""
    from ppo_critic.run.checkpoint import latest_checkpoint

    for attempt in range(tries):
        checkpoint = latest_checkpoint(root)
        if checkpoint is None:
            raise FileNotFoundError(f"{root} holds no complete checkpoint any more (a run beside this one removed it)")
        try:
            worker.load_checkpoint(checkpoint)
            return
        except (OSError, ValueError):
            if checkpoint.exists() or attempt == tries - 1:  # still there: damaged, not replaced
                raise


def _exported_objective(model_dir: Path, overrides: list[str]) -> list[str]:
    """The options an export's config.json declares (`EXPORTED_OBJECTIVE`): its objective, and value normalisation
    off (the statistics are folded into its head). A config.json that declares none is refused unless the command
    line says how to read the outputs (`critic.vf_loss_type=mse` for a critic whose outputs are its values)."""
    from ppo_critic.config.modes import EXPORTED_OBJECTIVE, VF_LOSS_TYPES

    config_file = model_dir / "config.json"
    try:
        name = json.loads(config_file.read_text(encoding="utf-8")).get(EXPORTED_OBJECTIVE)
    except (OSError, ValueError, AttributeError):
        return []  # no readable config: the model loader says what is wrong
    given = [o.split("=", 1)[1] for o in overrides if _expand_alias(o).startswith("critic.vf_loss_type=")]
    if name is None and not given:
        raise ValueError(
            f"{config_file} does not say how to read the model's outputs (no {EXPORTED_OBJECTIVE}; ppo-critic's "
            "exports name their objective there): pass critic.vf_loss_type=mse if its outputs are the values "
            "(e.g. a critic saved by verl)"
        )
    name = given[-1] if name is None else name
    if name not in VF_LOSS_TYPES:
        raise ValueError(
            f"{config_file}: {EXPORTED_OBJECTIVE}={name!r} is unknown; expected one of {tuple(VF_LOSS_TYPES)} (an "
            "objective registered at run time cannot be read back by ppo-critic values)"
        )
    return [f"critic.vf_loss_type={name}", "critic.value_norm=off"]


class _Version(argparse.Action):
    """`--version`: prints `ppo-critic <version>` and exits 0, looking the version up only then."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(f"ppo-critic {version()}")
        parser.exit()


def version() -> str:
    """The installed distribution's version, else the source tree's `ppo_critic.__version__`."""
    import importlib.metadata  # a few tens of ms: only when asked

    try:
        return importlib.metadata.version("ppo-critic")
    except importlib.metadata.PackageNotFoundError:
        from ppo_critic import __version__

        return __version__


if __name__ == "__main__":
    sys.exit(main())
