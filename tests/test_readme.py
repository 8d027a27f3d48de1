"""The README's examples run as written (issue 25 item 16: its "From Python" block needed the network,
no calib=, and load_packed defaulted to device="cuda", failing on a CPU machine where load works).

The block runs with two names swapped for test-sized ones: the demo model for a tiny Llama, and the
WikiText-2 file for a tiny corpus. Everything else (arguments, defaults, output paths) is the README's.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from tiny_models import save_tiny, write_corpus

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CALIB = "../shared/data/wikitext-2-raw-v1/validation.stripped-nonblank-lines.txt"


def python_block(after: str) -> str:
    """The first ```python block after the line ``after``."""
    text = README.read_text()
    start = text.index(after)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_the_from_python_block_runs_on_a_cpu_without_network(tmp_path, monkeypatch):
    code = python_block("From Python:")
    assert '"smollm2-135m"' in code and f'"{CALIB}"' in code   # the two names swapped below
    tiny = save_tiny("llama", tmp_path / "tiny")
    corpus = write_corpus(tmp_path / "calib.txt")
    code = code.replace('"smollm2-135m"', repr(str(tiny))).replace(f'"{CALIB}"', repr(str(corpus)))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    assert scope["report"]["output"].endswith("wanda50") and (tmp_path / "out" / "wanda50.tcabme").is_dir()
    assert next(scope["model"].parameters()).device.type == "cpu" and scope["tokenizer"] is not None
    exec(compile(code, str(README), "exec"), {})   # again: it says overwrite=True


def test_the_readme_calib_file_is_the_shared_data(wikitext_dir):
    """The name swapped above is the real file beside the checkout (skipped without ../shared)."""
    assert (README.parent / CALIB).resolve() == (wikitext_dir / Path(CALIB).name).resolve()


def _string_constants():
    """(file:line, text) of every string in the package's code."""
    for folder in ("sparsekit", "cli", "kernels"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    yield f"{f.relative_to(ROOT)}:{node.lineno}", node.value


def test_every_environment_variable_is_in_the_readme_table():
    """Issue 25 item 25: the SPARSEKIT_* variables were documented here and there, or not at all."""
    used = {v for _, text in _string_constants() for v in re.findall(r"SPARSEKIT_[A-Z0-9_]+", text)}
    table = README.read_text().split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(SPARSEKIT_[A-Z0-9_]+)` \|", table, re.M))
    assert used and used == documented


def test_every_flag_a_message_names_exists():
    """A message told users to pass --no-cuda-graphs, which no command has."""
    import typer

    from sparsekit.cli.app import app

    flags = {"--help", "--version"}
    for cmd in typer.main.get_command(app).commands.values():
        for p in cmd.params:
            flags.update(getattr(p, "opts", ()), getattr(p, "secondary_opts", ()))
    named = [(where, m) for where, text in _string_constants()
             for m in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)]
    assert named and [(w, m) for w, m in named if m not in flags | {"--no-deps"}] == []   # (--no-deps: pip's)


def test_every_script_the_docs_and_code_name_exists():
    """scripts/ was regrouped (bench/, checks/, demos/): no page or message may name a script that is gone."""
    texts = [README, *sorted((ROOT / "docs").glob("*.md"))]
    named = {(str(f.relative_to(ROOT)), m) for f in texts for m in re.findall(r"scripts/[\w/]+\.(?:py|sh)", f.read_text())}
    named |= {(where, m) for where, text in _string_constants() for m in re.findall(r"scripts/[\w/]+\.(?:py|sh)", text)}
    assert named and sorted((w, m) for w, m in named if not (ROOT / m).is_file()) == []
