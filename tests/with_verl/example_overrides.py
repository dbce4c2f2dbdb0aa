"""The critic overrides of verl's example scripts at a git tag: the data the example-override tests pin.

    python tests/with_verl/example_overrides.py GIT_DIR TAG > FILE
    python tests/with_verl/example_overrides.py GIT_DIR TAG --check FILE   # exit 1 when FILE is out of date

GIT_DIR is a clone (or bare git directory) of github.com/verl-project/verl (formerly volcengine/verl). Every
`examples/**/*.sh` at TAG is read as bash would split it, without running anything: line continuations joined, a
quoted string that spans lines kept whole, quotes removed, comments dropped; `$VAR` / `${VAR}` values are kept as
written (the tests substitute a valid value). A script that sets a `critic` key gets one block: its hydra
`--config-name`, when it gives one, then its overrides of `critic` (with any `+` / `++` / `~` prefix) and of the
non-critic keys that decide what the critic section means (`DECIDING`), in script order. Overrides inside a string
variable count (bash word-splits it where it is used unquoted), `${OTHER//old/new}` expanded from OTHER's text (verl's
larger scripts derive the critic's settings from the actor's that way). A script's branches are not followed: its
block is what any branch may pass.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

# keys outside `critic` that decide its meaning: verl's critic yaml interpolates them (rollout_n, the actor's batch
# settings, the model path), they pick the critic yaml (`model_engine`), whether a critic runs (adv_estimator), which
# worker runs it (0.7's use_legacy_worker_impl), how many data-parallel ranks share its mini-batch (the trainer's GPUs)
# and which trainer assigns its token budgets (0.9's use_v1)
DECIDING = (
    "algorithm.adv_estimator",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.shuffle",
    "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.loss_scale_factor",
    "actor_rollout_ref.actor.data_loader_seed",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.external_lib",
    "actor_rollout_ref.model.trust_remote_code",
    "model_engine",
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
    "trainer.use_v1",
    "trainer.use_legacy_worker_impl",
)
OVERRIDE = re.compile(r"^(?P<prefix>\+\+|\+|~)?(?P<key>[A-Za-z_][\w.@-]*)(?:=(?P<value>.*))?$", re.DOTALL)
CONFIG_NAME = ("--config-name", "-cn")
ASSIGNMENT = re.compile(r"^(?P<name>[A-Za-z_]\w*)=(?P<value>.*)$", re.DOTALL)  # a shell variable's
SUBSTITUTION = re.compile(r"\$\{(?P<name>\w+)//(?P<old>[^/}]*)/(?P<new>[^}]*)\}")


def is_wanted(key: str) -> bool:
    """A `critic` key (or the section itself) or one of `DECIDING`."""
    return key == "critic" or key.startswith("critic.") or key in DECIDING


def commands(text: str) -> list[list[str]]:
    """The script's words, one list per command line, as bash splits them: backslash-newlines joined, a quoted string
    that spans lines kept whole, quotes removed, `#` comments dropped; variables stay as written."""
    lines = text.replace("\\\r\n", " ").replace("\\\n", " ").splitlines()
    out, pending = [], ""
    for line in lines:
        pending = f"{pending}\n{line}" if pending else line
        try:
            out.append(shlex.split(pending, comments=True))
        except ValueError:  # a quote still open: the string goes on on the next line
            continue
        pending = ""
    return out


def script_overrides(text: str) -> list[str]:
    """The block of one script: `--config-name=NAME` when given, then its wanted overrides in order ([] when it sets
    no critic key)."""
    config, found, strings = None, [], {}
    in_array = False
    for tokens in commands(text):
        tokens = tokens[1:] if tokens[:1] == ["export"] else tokens
        assignment = ASSIGNMENT.match(tokens[0]) if tokens and not in_array else None
        if assignment:
            value = expand(assignment["value"], strings)
            in_array = value.startswith("(")  # an array: its elements are words of their own
            strings[assignment["name"]] = value = value.removeprefix("(")
            tokens = [*value.split(), *tokens[1:]]
        if in_array and tokens and tokens[-1].endswith(")"):
            in_array, tokens[-1] = False, tokens[-1][:-1]
        for i, token in enumerate(tokens):
            flag, _, value = token.partition("=")
            if flag in CONFIG_NAME:
                config = value or (tokens[i + 1] if i + 1 < len(tokens) else None)
                continue
            match = OVERRIDE.match(token)
            if match and is_wanted(match["key"]) and (match["value"] is not None or match["prefix"] == "~"):
                found.append(token)
    if not any(o.lstrip("+~").startswith("critic") for o in found):
        return []
    return ([f"--config-name={config}"] if config else []) + found


def expand(value: str, strings: dict[str, str]) -> str:
    """`value` with bash's `${NAME//old/new}` expanded from NAME's text (other variables stay as written)."""
    return SUBSTITUTION.sub(lambda m: strings.get(m["name"], m[0]).replace(m["old"], m["new"]), value)


def git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True, text=True).stdout


def extract(git_dir: str, tag: str) -> str:
    """The pinned file's text: a header naming the command and commit, then one block per script."""
    commit = git(git_dir, "rev-parse", f"{tag}^{{commit}}").strip()
    scripts = sorted(p for p in git(git_dir, "ls-tree", "-r", "--name-only", tag, "examples").split("\n") if p)
    out = [
        f"# verl {tag} (commit {commit}): the critic overrides of examples/**/*.sh, one block per script",
        "# that sets a critic key, with the non-critic keys that decide the critic's meaning; values as bash",
        "# passes them ($VAR kept). Made by (GIT_DIR: a clone of github.com/verl-project/verl):",
        f"#   python tests/with_verl/example_overrides.py GIT_DIR {tag}",
    ]
    for path in scripts:
        if path.endswith(".sh"):
            block = script_overrides(git(git_dir, "show", f"{tag}:{path}"))
            if block:
                out += ["", f"[{path}]", *block]
    return "\n".join(out) + "\n"


def read_pinned(path: Path) -> dict[str, list[str]]:
    """A pinned file back as {script: [--config-name=..., override, ...]}."""
    blocks: dict[str, list[str]] = {}
    current: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = blocks.setdefault(line[1:-1], [])
        elif line and not line.startswith("#"):
            current.append(line)
    return blocks


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 4) or (len(argv) == 4 and argv[2] != "--check"):
        print("usage: python tests/with_verl/example_overrides.py GIT_DIR TAG [--check FILE]", file=sys.stderr)
        return 2
    text = extract(argv[0], argv[1])
    if len(argv) == 4:
        same = Path(argv[3]).read_text() == text
        print(f"{argv[3]}: {'up to date' if same else 'differs from ' + argv[1] + ' (regenerate it)'}")
        return 0 if same else 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
