"""What a command imports (issue 20: the first token in about a second). ``import sparsekit`` and
``sparsekit --help`` import none of torch, transformers, torch._dynamo, numba or datasets; each command
imports what it needs when it needs it; the from_pretrained hook still registers once transformers'
quantizers are imported. Each case runs in a fresh interpreter (this process has imported everything)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "torch._dynamo", "numba", "datasets", "accelerate", "lm_eval")
REPORT = f"print('MODULES', __import__('json').dumps(sorted(m for m in {HEAVY!r} if m in __import__('sys').modules)))"


def fresh(code: str) -> tuple[list[str], str]:
    """(the heavy modules imported, the output) after running ``code`` in a new interpreter."""
    res = subprocess.run([sys.executable, "-c", f"{code}\n{REPORT}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    line = next(line for line in res.stdout.splitlines() if line.startswith("MODULES "))
    return json.loads(line.split(" ", 1)[1]), res.stdout + res.stderr


def cli(*args: str) -> str:
    """Code that runs the console script's ``main`` with ``args`` and goes on after its exit."""
    return (f"import sys\nfrom sparsekit.cli.app import main\nsys.argv = ['sparsekit', *{list(args)!r}]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass")


def test_import_sparsekit_imports_nothing_heavy():
    mods, _ = fresh("import sparsekit, sparsekit.autoregister as a\nassert a.installed() and sparsekit.__version__")
    assert mods == []


def test_the_public_names_still_load_on_first_use():
    mods, out = fresh("import sparsekit\nprint(sparsekit.load.__module__, sparsekit.load_packed.__name__)")
    assert "sparsekit.runtime.loader load_packed" in out and "torch" in mods


@pytest.mark.parametrize("args", [("--help",), ("generate", "--help"), ("prune", "--help"), ("eval", "--help"),
                                  ("--version",)])
def test_help_and_version_import_nothing_heavy(args):
    mods, out = fresh(cli(*args))
    assert mods == [] and ("Usage" in out or "sparsekit 0." in out)


def test_recipes_reads_yaml_without_transformers():
    mods, out = fresh(cli("recipes", "--json"))
    assert "wanda-2of4" in out
    assert not {"transformers", "torch._dynamo", "numba", "datasets"} & set(mods)


def test_generate_checks_its_arguments_before_the_model_stack(tmp_path):
    mods, out = fresh(cli("generate", str(tmp_path), "--prompt", " "))
    assert "the prompt is empty" in out
    assert not {"transformers", "torch._dynamo", "numba", "datasets"} & set(mods)


def test_from_pretrained_registration_waits_for_transformers_quantizers():
    mods, out = fresh("import sparsekit\nimport transformers.quantizers.auto as q\n"
                      "print('REGISTERED', 'sparsekit' in q.AUTO_QUANTIZER_MAPPING)")
    assert "REGISTERED True" in out and "transformers" in mods


@pytest.mark.parametrize("cwd, first_entry", [("root", None), ("/", "root")], ids=["python -c at the root", "-m style"])
def test_the_tree_root_does_not_lend_its_folders_bare_names(cwd, first_entry):
    """From the source tree's root (``""`` first on the path) or with the root's absolute path first (``python -m``),
    ``kernels``, ``cli`` and ``recipes`` do not resolve to sparsekit's folders (``sparsekit.source_tree``):
    transformers probes for the Hub's ``kernels`` package at import and took the folder for it, mapping every
    installed distribution's files and importing the folder a second time. The mapped packages still import."""
    root = str(ROOT)
    code = (f"import sys, importlib.util\n"
            + (f"sys.path.insert(0, {root!r})\n" if first_entry else "")
            + "import sparsekit, sparsekit.kernels, sparsekit.cli.app\n"
            + "names = ('kernels', 'cli', 'recipes')\n"
            + "found = {n: str(getattr(importlib.util.find_spec(n), 'origin', '')) for n in names}\n"
            + f"print('FOUND', [n for n, o in found.items() if o.startswith({root!r})], 'kernels' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT if cwd == "root" else cwd, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "FOUND [] False" in res.stdout, res.stdout
