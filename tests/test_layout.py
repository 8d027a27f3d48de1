"""The package layout stays honest: stages import only earlier stages, no import cycles, small files,
and no test or script reaches into a private name of sparsekit.

The stages follow the data: Hugging Face plumbing -> pruning -> packed format -> kernels -> runtime
-> evaluation -> CLI (see the README's layout table). Imports inside functions count too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> installed package name
PACKAGES = {"sparsekit": "sparsekit", "cli": "sparsekit.cli", "kernels": "sparsekit.kernels"}
# module-name prefix -> stage floor (the longest matching prefix wins)
STAGES = {
    "sparsekit": 0,              # the package root: __version__ and lazy exports only
    "sparsekit.errors": 0,
    "sparsekit.progress": 0,
    "sparsekit.host": 0,         # output directories and host memory: no models
    "sparsekit.hf": 0,
    "sparsekit.pruning": 1,
    "sparsekit.packed": 2,
    "sparsekit.kernels": 3,
    "sparsekit.runtime": 4,
    "sparsekit.evaluation": 5,
    "sparsekit.cli": 6,
}
MAX_LINES = 400
LOOP_MAX_LINES = 250


def module_files() -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of the installed package."""
    out = {}
    for folder, pkg in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = f.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The sparsekit modules that ``module`` imports anywhere in its file."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_pkg, node)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(n for n in names if n == "sparsekit" or n.startswith("sparsekit."))
    found.discard(module)
    return found


def stage_of(module: str) -> int:
    best = max((p for p in STAGES if module == p or module.startswith(p + ".")), key=len)
    return STAGES[best]


def layering_errors(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a later stage, and modules that import each other (directly or around a cycle)."""
    errors = [f"{m} (stage {stage_of(m)}) imports {d} (stage {stage_of(d)})"
              for m, deps in sorted(graph.items()) for d in sorted(deps) if stage_of(d) > stage_of(m)]
    return errors + import_cycles(graph)


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Modules that import each other, directly or around a cycle (Tarjan's strongly connected components)."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [f"import cycle: {' <-> '.join(c)}" for c in comps]


def package_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    # a package's own __init__ importing its submodules is not a cycle of concern; the parent
    # package node stands for its __init__ only
    return {m: {d for d in imports_of(m, f, known) if d in known} for m, f in files.items()}


def test_checker_catches_a_later_stage_and_a_cycle():
    bad = {
        "sparsekit.packed.encoding": {"sparsekit.runtime.loader"},   # format importing the runtime
        "sparsekit.pruning.api": {"sparsekit.evaluation.ppl"},      # pruning importing evaluation
        "sparsekit.runtime.loader": {"sparsekit.runtime.swap"},
        "sparsekit.runtime.swap": {"sparsekit.runtime.loader"},     # two modules importing each other
        "sparsekit.evaluation.ppl": set(),
    }
    errors = layering_errors(bad)
    assert any("packed.encoding (stage 2) imports sparsekit.runtime.loader" in e for e in errors)
    assert any("pruning.api (stage 1) imports sparsekit.evaluation.ppl" in e for e in errors)
    assert any("cycle" in e and "runtime.loader" in e and "runtime.swap" in e for e in errors)
    assert layering_errors({"sparsekit.runtime.loader": {"sparsekit.hf.models"}, "sparsekit.hf.models": set()}) == []


def test_relative_imports_resolve(tmp_path):
    f = tmp_path / "launch.py"
    f.write_text("from . import plan\nfrom .compat import x\nfrom ..packed import tcabme\n")
    known = {"sparsekit.kernels.plan", "sparsekit.kernels.compat", "sparsekit.packed.tcabme"}
    assert imports_of("sparsekit.kernels.launch", f, known) == known


def test_stages_import_only_earlier_stages_and_nothing_imports_each_other():
    graph = package_graph()
    assert len(graph) > 30
    assert layering_errors(graph) == []


def test_files_stay_small():
    too_big = {str(f.relative_to(ROOT)): n for f in (ROOT / "sparsekit").rglob("*.py")
               if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert too_big == {}
    loop = ROOT / "sparsekit" / "pruning" / "engine.py"
    assert len(loop.read_text().splitlines()) < LOOP_MAX_LINES


def private_reaches(path: Path) -> list[str]:
    """Private sparsekit names that a test or script imports or reads off a sparsekit module."""
    tree = ast.parse(path.read_text(), str(path))
    modules = module_files()
    aliases: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparsekit"):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{path.name}: from {node.module} import {a.name}")
                if f"{node.module}.{a.name}" in modules:
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("sparsekit") and a.asname:
                    aliases.add(a.asname)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and _private(node.attr)):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
        elif (isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[0], ast.Name)
              and node.args[0].id in aliases and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            # monkeypatch.setattr(module, "_name", ...), getattr(module, "_name")
            found.append(f"{path.name}:{node.lineno}: {node.args[0].id}.{node.args[1].value} (by name)")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("sparsekit.")
              and any(_private(part) for part in node.value.split("."))):
            # monkeypatch.setattr("sparsekit.runtime.dispatch._usable", ...)
            found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_private_reach_checker_can_fail(tmp_path):
    f = tmp_path / "s.py"
    f.write_text("from sparsekit.evaluation import speed\nfrom sparsekit.runtime.loader import _x\nspeed._time_ms(1)\n"
                 "monkeypatch.setattr(speed, '_time_ms', None)\ngetattr(speed, '_y')\n"
                 "monkeypatch.setattr('sparsekit.runtime.dispatch._usable', None)\n"
                 "monkeypatch.setattr(speed, 'public', None)\nprint('sparsekit.x', '_z')\n")
    assert len(private_reaches(f)) == 5


@pytest.mark.parametrize("folder", ["tests", "scripts"])
def test_tests_and_scripts_use_public_names(folder):
    found = [r for f in sorted((ROOT / folder).rglob("*.py")) for r in private_reaches(f)]
    assert found == []


# ----------------------------------------------------------------------------- scripts/
SCRIPT_GROUPS = ("bench", "checks", "demos")


def script_files() -> dict[str, Path]:
    """``{scripts.group.name: file}`` for every Python file under scripts/."""
    return {".".join(("scripts", *f.relative_to(ROOT / "scripts").with_suffix("").parts)).removesuffix(".__init__"): f
            for f in sorted((ROOT / "scripts").rglob("*.py"))}


def script_problems(files: dict[str, Path]) -> list[str]:
    """What the scripts/ rules forbid: a sys.path edit, importing tests, an import cycle between
    scripts, a WikiText-2 folder named anywhere but in scripts/common.py."""
    problems, graph = [], {}
    for name, f in files.items():
        tree = ast.parse(f.read_text(), str(f))
        graph[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                problems.append(f"{name}: edits sys.path")
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for m in mods:
                if m == "tests" or m.startswith("tests.") or m in ("tiny_models", "conftest"):
                    problems.append(f"{name}: imports the tests ({m})")
                if m in files and m != name:
                    graph[name].add(m)
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and "wikitext-2-raw-v1" in node.value
                    and not name.endswith(".common") and "\n" not in node.value and " " not in node.value):
                problems.append(f"{name}: locates the WikiText-2 folder itself (scripts.common.wikitext_file does)")
    return problems + import_cycles(graph)


def test_scripts_are_grouped_by_purpose_with_one_helper_module():
    top = {p.name for p in (ROOT / "scripts").iterdir() if p.name != "__pycache__"}
    assert top == {"__init__.py", *SCRIPT_GROUPS, "common.py"}
    assert script_problems(script_files()) == []


def test_the_readme_lists_every_script():
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `scripts/` |"))
    for group in SCRIPT_GROUPS:
        for f in sorted((ROOT / "scripts" / group).iterdir()):
            if f.suffix in (".py", ".sh") and f.name != "__init__.py":
                assert f"`{f.name}`" in row.split(f"`{group}/`", 1)[1].split("; ", 1)[0], f"{group}/{f.name}"


def test_the_scripts_checker_can_fail(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import sys\nsys.path.insert(0, 'x')\nfrom scripts.b import y\nD = '../shared/data/wikitext-2-raw-v1'\n")
    b.write_text("from scripts.a import z\nfrom tiny_models import save_tiny\n")
    problems = script_problems({"scripts.a": a, "scripts.b": b})
    assert len(problems) == 4 and any("cycle" in p for p in problems)


def test_moved_modules_keep_their_old_names_for_one_release():
    """``sparsekit.hf.{atomic,outlock,filemode,hostmem}`` moved to ``sparsekit.host``; the old names are
    the same module objects (so a monkeypatch through either reaches the code)."""
    import importlib

    for old, new in (("atomic", "atomic"), ("outlock", "outlock"), ("filemode", "filemode"), ("hostmem", "memory")):
        assert importlib.import_module(f"sparsekit.hf.{old}") is importlib.import_module(f"sparsekit.host.{new}")
