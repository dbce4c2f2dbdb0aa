"""docs/DESIGN.md stays true to the code: every "DESIGN §N" citation names a section that exists, §4 lists exactly
the modules under src/ppo_critic and its layering line holds for their module-level imports, and the import paths,
signatures, entry points and commands of §2 are the code's (the torch-free ones import without torch)."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "DESIGN.md"
PACKAGE = ROOT / "src" / "ppo_critic"
CITING = ("src", "tests", "bench", "docs", "README.md")  # where citations may be
CITATION = re.compile(r"DESIGN(?:\.md)? §(\d+)(?:\s*[–-]\s*(\d+))?")
SECTION = re.compile(r"^## (\d+)\. \S", re.M)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
TORCH_FREE = "# torch-free"


def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def sections() -> dict[int, str]:
    """Section number -> its text (heading to the next `## N.` heading)."""
    text = doc()
    heads = list(SECTION.finditer(text))
    return {
        int(h.group(1)): text[h.start() : heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        for i, h in enumerate(heads)
    }


def blocks(section: int, language: str) -> list[str]:
    """The fenced code blocks of one section in one language, in order."""
    return [body for lang, body in FENCE.findall(sections()[section]) if lang == language]


# (a) citations ---------------------------------------------------------------------------------------------------


def citations() -> list[tuple[str, int]]:
    """(`file:line`, section) of every "DESIGN §N" / "DESIGN.md §N" (both ends of "§N–M") outside this test."""
    files = []
    for name in CITING:
        path = ROOT / name
        files += [path] if path.is_file() else [p for p in path.rglob("*") if p.suffix in (".py", ".md", ".sh")]
    found = []
    for path in sorted(files):
        if path == Path(__file__).resolve() or path == DOC:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            for match in CITATION.finditer(line):
                where = f"{path.relative_to(ROOT)}:{number}"
                found += [(where, int(n)) for n in match.groups() if n is not None]
    return found


def test_the_sections_are_numbered_one_to_eight_in_order():
    assert [int(n) for n in SECTION.findall(doc())] == list(range(1, 9))


def test_every_design_citation_names_a_section_that_exists():
    found = citations()
    assert len(found) >= 30, f"the citation scan finds too little ({len(found)}): is CITATION still right?"
    missing = [f"{where}: §{n}" for where, n in found if n not in sections()]
    assert not missing, f"citations of sections docs/DESIGN.md does not have: {missing}"


def test_the_citation_pattern_reads_ranges_and_both_spellings():
    assert [m.groups() for m in CITATION.finditer("(DESIGN §2–3) and DESIGN.md §8, DESIGN §6")] == [
        ("2", "3"),
        ("8", None),
        ("6", None),
    ]


# (b) the layout of the code ----------------------------------------------------------------------------------------


def documented_modules() -> list[str]:
    """The module paths of §4's tree: the first token of each line of its first `text` block."""
    tree = blocks(4, "text")
    assert tree, "§4 has no ```text block listing the modules"
    return [line.split()[0] for line in tree[0].splitlines() if line.strip()]


def test_section_4_names_every_module_once_and_nothing_else():
    listed = documented_modules()
    actual = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))
    duplicates = sorted({m for m in listed if listed.count(m) > 1})
    assert not duplicates, f"§4 lists these modules twice: {duplicates}"
    undocumented = sorted(set(actual) - set(listed))
    assert not undocumented, f"modules under src/ppo_critic that §4 of docs/DESIGN.md does not list: {undocumented}"
    gone = sorted(set(listed) - set(actual))
    assert not gone, f"§4 of docs/DESIGN.md lists modules that do not exist: {gone}"


def test_every_module_line_of_section_4_says_what_the_module_is():
    tree = blocks(4, "text")[0]
    bare = [line.strip() for line in tree.splitlines() if len(line.split()) < 2 and line.strip()]
    assert not bare, f"§4 lines without a description: {bare}"


def layers() -> dict[str, int]:
    """Unit (package or top-level module) -> its level, from §4's line `a → b ⇄ c → d, e → ...`."""
    lines = [line.strip() for line in sections()[4].splitlines() if line.startswith("    ") and "→" in line]
    assert len(lines) == 1, f"§4 must hold exactly one indented layering line with →, found {lines}"
    return {
        unit.strip(): level
        for level, part in enumerate(lines[0].split("→"))
        for unit in re.split(r"[,⇄]", part)
        if unit.strip()
    }


def unit_of(module: str) -> str:
    """`ppo_critic.critics.base` -> `critics`; `ppo_critic.worker` -> `worker`; `ppo_critic` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of the `ppo_critic` imports that run when `path` is imported: not inside functions, not
    under `if TYPE_CHECKING:`."""
    found = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((node.lineno, node.module))
            elif isinstance(node, ast.Import):
                found.extend((node.lineno, alias.name) for alias in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []))

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return [(line, m) for line, m in found if m == "ppo_critic" or m.startswith("ppo_critic.")]


def test_the_layering_line_places_every_unit_of_the_package():
    units = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.glob("*")}
    units = {u for u in units if not u.startswith((".", "__"))}
    placed = layers()
    assert units - placed.keys() == set(), f"§4's layering line does not place {sorted(units - placed.keys())}"
    assert placed.keys() - units == set(), f"§4's layering line names what does not exist: {placed.keys() - units}"


def test_module_level_imports_only_reach_leftwards_in_the_layering_line():
    level = layers()
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = unit_of("ppo_critic." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        if source in ("__init__", "__main__"):
            continue
        for line, target in module_level_imports(path):
            to = unit_of(target)
            if to != source and level.get(to, -1) > level[source]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({source}) imports {target} ({to})")
    assert not wrong, f"imports against §4's layering (move them, or change the line): {wrong}"


def test_the_layering_check_sees_imports_where_they_are():
    imports = dict((m, line) for line, m in module_level_imports(PACKAGE / "critics" / "base.py"))
    assert "ppo_critic.config.critic" in imports and "ppo_critic.data.batching" in imports
    lazy = [m for _, m in module_level_imports(PACKAGE / "cli.py")]
    assert "ppo_critic.train" not in lazy  # imported inside the `train` command only


# (c) the public API ------------------------------------------------------------------------------------------------


def import_statements() -> list[tuple[str, bool]]:
    """(statement, torch-free?) of §2's first python block."""
    code = blocks(2, "python")
    assert code, "§2 has no ```python block of import paths"
    found = []
    for line in code[0].splitlines():
        statement, _, comment = line.partition("#")
        if statement.strip():
            ast.parse(statement)  # one whole statement per line
            found.append((statement.strip(), TORCH_FREE in "#" + comment))
    return found


BLOCK_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not available here (tests/test_design_doc.py)")
sys.meta_path.insert(0, NoTorch())
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def test_section_2_lists_the_public_names_and_marks_the_torch_free_paths():
    statements = import_statements()
    assert any(free for _, free in statements) and not all(free for _, free in statements)
    import ppo_critic

    top = set()
    for statement, _ in statements:
        node = ast.parse(statement).body[0]
        if isinstance(node, ast.ImportFrom) and node.module == "ppo_critic":
            top |= {alias.name for alias in node.names}
    assert top == set(ppo_critic.__all__), "§2's `from ppo_critic import ...` lines must name exactly __all__"


def test_the_torch_free_paths_of_section_2_import_without_torch():
    free = [s for s, is_free in import_statements() if is_free]
    for statement in free:
        result = run_python(BLOCK_TORCH + statement + "\nassert 'torch' not in sys.modules, 'torch was imported'\n")
        assert result.returncode == 0, f"{statement!r} (marked torch-free in §2):\n{result.stderr[-2000:]}"


def test_the_torch_free_check_would_catch_torch():
    result = run_python(BLOCK_TORCH + "from ppo_critic import DataParallelPPOCritic\n")
    assert result.returncode != 0 and "torch is not available here" in result.stderr


def test_every_import_path_of_section_2_imports():
    statements = [s for s, _ in import_statements()]
    script = "import json\nfailed = []\n"
    for statement in statements:
        script += f"try:\n    {statement}\nexcept Exception as err:\n    failed.append([{statement!r}, repr(err)])\n"
    script += "print(json.dumps(failed))\n"
    result = run_python(script)
    assert result.returncode == 0, result.stderr[-2000:]
    failed = json.loads(result.stdout.strip().splitlines()[-1])
    assert failed == [], f"import paths of §2 that do not import: {failed}"


def resolve(dotted: str):
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def documented_signature(line: str) -> tuple[str, list[tuple[str, str, object]]]:
    """`pkg.mod.f(a, b=1, *, c=None, **kw) -> T` -> ("pkg.mod.f", [(name, kind, default), ...])."""
    name, rest = line.split("(", 1)
    func = ast.parse(f"def f({rest.rsplit(')', 1)[0]}): ...").body[0]
    args = func.args
    params: list[tuple[str, str, object]] = []
    positional = args.posonlyargs + args.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults
    ]
    kinds = ["POSITIONAL_ONLY"] * len(args.posonlyargs) + ["POSITIONAL_OR_KEYWORD"] * len(args.args)
    params += [(a.arg, k, d) for a, k, d in zip(positional, kinds, defaults, strict=True)]
    if args.vararg:
        params.append((args.vararg.arg, "VAR_POSITIONAL", inspect.Parameter.empty))
    for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append((a.arg, "KEYWORD_ONLY", inspect.Parameter.empty if d is None else ast.literal_eval(d)))
    if args.kwarg:
        params.append((args.kwarg.arg, "VAR_KEYWORD", inspect.Parameter.empty))
    return name.strip(), params


def actual_signature(obj) -> list[tuple[str, str, object]]:
    params = list(inspect.signature(obj).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return [(p.name, p.kind.name, p.default) for p in params]


def signature_lines() -> list[str]:
    code = blocks(2, "python")
    assert len(code) >= 2, "§2 needs a second ```python block: the signatures"
    return [line.strip() for line in code[1].splitlines() if line.strip()]


def test_the_signatures_of_section_2_are_the_codes():
    lines = signature_lines()
    assert len(lines) >= 10
    wrong = []
    for line in lines:
        name, documented = documented_signature(line)
        actual = actual_signature(resolve(name))
        if documented != actual:
            wrong.append(f"{name}: §2 says {documented}, the code has {actual}")
    assert not wrong, "\n".join(wrong)


def test_the_signature_check_tells_a_changed_signature():
    _, documented = documented_signature("ppo_critic.algos.masked_mean(values, mask, axis=0) -> Tensor")
    assert documented != actual_signature(resolve("ppo_critic.algos.masked_mean"))


def test_the_entry_points_of_section_2_are_in_pyproject():
    tomllib = pytest.importorskip("tomllib")
    quoted = blocks(2, "toml")
    assert quoted, "§2 has no ```toml block quoting pyproject.toml"
    documented = tomllib.loads(quoted[0])["project"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert documented["scripts"] == project["scripts"]
    assert documented["entry-points"] == {k: project["entry-points"][k] for k in documented["entry-points"]}
    for target in [*documented["scripts"].values(), *documented["entry-points"]["verl.plugins"].values()]:
        assert (PACKAGE.parent / (target.split(":")[0].replace(".", "/") + ".py")).is_file(), target


def test_the_commands_of_section_2_are_the_clis():
    from ppo_critic import cli

    listed = blocks(2, "text")
    assert listed, "§2 has no ```text block of commands"
    documented = {line.split()[1] for line in listed[0].splitlines() if line.startswith("ppo-critic ")}
    documented.discard("--version")
    parser = cli._parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert documented == set(commands)
