"""What every option of `ppo-critic train` and `ppo-critic bench` means, rendered as `--help` text and as YAML.

The one source is each config field's attribute docstring (PEP 257: the string literal after the field), read
from the module's source with `ast` without importing it, so `bench --help` needs no torch. `configs/default.yaml`
is `render_yaml(TrainConfig())`, written by `ppo-critic train --print-config`; `docs/options.md` is
`render_markdown()`, written by `python -m ppo_critic.config.reference > docs/options.md`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ppo_critic.config.modes import VF_LOSS_TYPES
from ppo_critic.config.tasks import TASK_CONFIGS
from ppo_critic.config.train import DEFAULT_MODEL, TrainConfig

MARKDOWN_COMMAND = "python -m ppo_critic.config.reference > docs/options.md"
# options whose choices config/modes.py describes, each choice with its description
CHOICES = {"critic.vf_loss_type": VF_LOSS_TYPES}
# sections of `train --help`, in this order ("": the top-level options)
HELP_SECTIONS = ("trainer", "critic", "critic.model", "critic.optim", "critic.megatron", "task", "")
YAML_HEADER = """\
# Every option of `ppo-critic train`, its value and what it does. Use: ppo-critic train --config FILE [key=value ...]
# Written by `ppo-critic train --print-config [--config FILE] [key=value ...]`; without options: configs/default.yaml.

"""


@dataclass(frozen=True)
class Option:
    """One option (`section`: a group of options, e.g. `critic.model`); `is_set` is false for a task option
    that the `task` mapping leaves at its default."""

    key: str
    value: Any
    doc: str
    section: bool = False
    is_set: bool = True


@functools.cache
def _module_fields(module: str) -> dict[str, list[tuple[str, ast.expr | None, str]]]:
    """Class name -> (field, default expression, docstring) of every annotated field of `module`'s classes,
    parsed from its source file (the module is not imported)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"no source for {module}", name=module)
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    classes = {}
    for node in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        fields = []
        for stmt, after in zip(node.body, [*node.body[1:], None], strict=True):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                docstring = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                doc = after.value.value if docstring and isinstance(after.value.value, str) else ""
                fields.append((stmt.target.id, stmt.value, " ".join(doc.split())))
        classes[node.name] = fields
    return classes


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its one-line description, for every field of `cls` that has one (those of its base classes
    too, e.g. the tasks' `DriftOptions`; a field a class redeclares takes its own)."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        docs |= {name: doc for name, _, doc in _module_fields(klass.__module__)[klass.__qualname__] if doc}
    return docs


def train_options(cfg: TrainConfig) -> list[Option]:
    """Every option of `cfg` and every group of options, in field order, nested keys dotted."""
    return _walk(cfg, "")


def _walk(obj: Any, prefix: str) -> list[Option]:
    docs = field_docs(type(obj))
    options = []
    for f in dataclasses.fields(obj):
        key, value, doc = prefix + f.name, getattr(obj, f.name), docs.get(f.name, "")
        if isinstance(obj, TrainConfig) and f.name == "task":
            options += [Option(key, None, doc, section=True), *_task_options(obj)]
        elif dataclasses.is_dataclass(value):
            options += [Option(key, None, doc, section=True), *_walk(value, f"{key}.")]
        else:
            options.append(Option(key, value, doc + _choices_note(key) + _default_model_note(key)))
    return options


def _task_options(cfg: TrainConfig) -> list[Option]:
    """`task.name` and the options of that task (its policy schedule, `task.drift*`, last), those the `task` mapping
    leaves out marked as not set."""
    task = cfg.task_config()
    doc = f"the task: {', '.join(TASK_CONFIGS)} (--print-config task.name=X lists the options of X)"
    name = Option("task.name", cfg.task.get("name", "counting"), doc)
    docs = field_docs(type(task))
    return [name] + [
        Option(f"task.{f.name}", getattr(task, f.name), docs.get(f.name, ""), is_set=f.name in cfg.task)
        for f in sorted(dataclasses.fields(task), key=lambda f: f.name.startswith("drift"))
    ]


def _choices_note(key: str) -> str:
    """`: name (what it is); ...` for an option whose choices are listed in config/modes.py (a new one shows itself)."""
    choices = CHOICES.get(key, {})
    return (": " + "; ".join(f"{name} ({what})" for name, what in choices.items())) if choices else ""


def _default_model_note(key: str) -> str:
    """What `critic.model.override_config` completes when no `critic.model.path` is given."""
    if key != "critic.model.override_config":
        return ""
    shape = " ".join(f"{name}={value}" for name, value in DEFAULT_MODEL.items())
    return f". ppo-critic train with path null: {shape} vocab_size=<the rollouts' vocabulary>, each replaced by yours"


def bench_options() -> list[Option]:
    """The options of `ppo-critic bench` (`ppo_critic.config.bench.BenchConfig`) read from its source: no torch."""
    return [
        Option(name, ast.literal_eval(default) if default is not None else None, doc)
        for name, default, doc in _module_fields("ppo_critic.config.bench")["BenchConfig"]
    ]


def render_help(options: list[Option], sections: tuple[str, ...] | None = None) -> str:
    """`key=value  description` per option; grouped under each section's title in `sections` order when given."""
    leaves = [o for o in options if not o.section]
    if sections is None:
        return "\n".join(_help_line(o) for o in leaves)
    titles = {o.key: o.doc for o in options if o.section} | {"": "the rollout source"}
    blocks = []
    for section in sections:
        lines = [_help_line(o) for o in leaves if o.key.rpartition(".")[0] == section]
        blocks.append(f"{section or 'top level'}: {titles[section]}\n" + "\n".join(lines))
    return "\n\n".join(blocks)


def _help_line(option: Option) -> str:
    return f"  {option.key}={yaml_value(option.value)}  {option.doc}"


def render_yaml(cfg: TrainConfig) -> str:
    """`cfg` as a YAML file that loads back to it, every option with its description as a comment; the task's
    options that `task` leaves out are listed commented out."""
    lines = []
    for option in train_options(cfg):
        depth, name = option.key.count("."), option.key.rpartition(".")[2]
        if option.section:
            lines += [""] if depth == 0 and lines else []  # a blank line between the top-level groups
            lines.append(f"{'  ' * depth}{name}:  # {option.doc}")
        else:
            mark = "" if option.is_set else "# "
            lines.append(f"{'  ' * depth}{mark}{name}: {yaml_value(option.value)}  # {option.doc}")
    return YAML_HEADER + "\n".join(lines) + "\n"


def yaml_value(value: Any) -> str:
    """`value` as one line of YAML (flow style), as it is typed in a config file or a key=value override."""
    plain = list(value) if isinstance(value, tuple) else value
    return yaml.safe_dump(plain, default_flow_style=True, width=math.inf).removesuffix("...\n").strip()


def render_markdown() -> str:
    """docs/options.md: every option of `ppo-critic train` (each built-in task's too) and of `ppo-critic bench`,
    with its default and description, one table per section, from the same source as `--help` and
    configs/default.yaml."""
    options = train_options(TrainConfig())
    titles = {o.key: o.doc for o in options if o.section} | {"": "the rollout source"}
    out = [
        "# Options",
        "",
        "<!-- generated by config/reference.py: do not edit; tests/test_docs.py checks it is up to date -->",
        "",
        "Every option of `ppo-critic train` and `ppo-critic bench`, its default and what it does: the same text as",
        "`ppo-critic train --help`, `ppo-critic bench --help` and `configs/default.yaml`, written from the",
        "descriptions in `src/ppo_critic/config/`. Set an option as `key=value` on the command line or in a YAML",
        "file given with `--config`. After changing an option, regenerate this file:",
        "",
        "```bash",
        MARKDOWN_COMMAND,
        "```",
    ]
    leaves = [o for o in options if not o.section and not o.key.startswith("task.")]
    for section in (s for s in HELP_SECTIONS if s != "task"):
        out += ["", f"## `{section}`" if section else "## Top level", "", _sentence(titles[section]), ""]
        out += _markdown_table([o for o in leaves if o.key.rpartition(".")[0] == section])
    out += ["", "## `task`", "", _sentence(titles["task"]), ""]
    out += _markdown_table([o for o in options if o.key == "task.name"])
    for name in TASK_CONFIGS:
        task = [o for o in _task_options(TrainConfig(task={"name": name})) if o.key != "task.name"]
        out += ["", f"### `task.name={name}`", "", *_markdown_table(task)]
    out += ["", "## `ppo-critic bench`", "", "Options of `ppo-critic bench` (`key=value`).", ""]
    out += _markdown_table(bench_options())
    return "\n".join(out) + "\n"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _markdown_table(options: list[Option]) -> list[str]:
    rows = ["| option | default | what it does |", "|---|---|---|"]
    for o in options:
        value, doc = (text.replace("|", "\\|") for text in (yaml_value(o.value), o.doc))
        rows.append(f"| `{o.key}` | `{value}` | {doc} |")
    return rows


if __name__ == "__main__":
    print(render_markdown(), end="")
