"""Recipes by name: the bundled recipes are installed as sparsekit.recipes, `--recipe NAME` works
from any folder, a file path still works (and wins), unknown names list the bundled ones,
`sparsekit recipes` lists them, and `sparsekit prune --help` says where methods and recipes are."""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.errors import SparsekitError
from sparsekit.pruning.recipes import bundled_recipes, find_recipe, load_recipe, resolve_settings
from tiny_models import save_tiny

runner = CliRunner()
SOURCE = Path(__file__).resolve().parents[1] / "recipes"


def test_the_installed_data_package_holds_every_source_recipe():
    installed = {f.name for f in resources.files("sparsekit.recipes").iterdir() if f.name.endswith(".yaml")}
    assert installed == {p.name for p in SOURCE.glob("*.yaml")}
    assert [r.name for r in bundled_recipes()] == sorted(p.stem for p in SOURCE.glob("*.yaml"))
    assert all(r.description for r in bundled_recipes())


def test_a_name_works_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = resolve_settings("wanda-2of4")
    assert (s.method, s.pattern, s.sparsity, s.recipe) == ("wanda", "2:4", 0.5, "wanda-2of4")
    assert load_recipe("sparsegpt-4of8.yaml") == load_recipe(SOURCE / "sparsegpt-4of8.yaml")  # .yaml optional


def test_a_path_still_works_and_an_existing_file_wins(tmp_path, monkeypatch):
    assert resolve_settings(SOURCE / "magnitude-hybrid.yaml").method == "magnitude"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "wanda-2of4").write_text('method: magnitude\npattern: "4:8"\n')  # a file shadowing a bundled name
    assert find_recipe("wanda-2of4") == Path("wanda-2of4")
    assert resolve_settings("wanda-2of4").method == "magnitude"
    (tmp_path / "mine.yaml").write_text("method: sparsegpt\n")
    assert resolve_settings("mine.yaml").method == "sparsegpt"


@pytest.mark.parametrize("ref,match", [
    ("wanda-3of4", "one of the bundled recipes: admm-2of4, admm-4of8"),
    ("elsewhere/wanda-2of4.yaml", "the bundled recipe of that name is --recipe wanda-2of4"),
    ("missing/r.yaml", "not found"),
])
def test_unknown_names_and_missing_files_are_one_line_errors(tmp_path, monkeypatch, ref, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SparsekitError, match=match) as e:
        resolve_settings(ref)
    assert "\n" not in str(e.value)
    with pytest.raises(SparsekitError, match="directory"):
        find_recipe(tmp_path)


def test_prune_by_recipe_name_from_another_folder(tmp_path, monkeypatch):
    model = save_tiny("llama", tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["prune", str(model), "--recipe", "magnitude-2of4", "--device", "cpu",
                              "-o", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert (rep["method"], rep["pattern"], rep["sparsity"]) == ("magnitude", "2:4", 0.5)

    res = runner.invoke(app, ["prune", str(model), "--recipe", "wanda-3of4", "--device", "cpu", "-o", str(tmp_path / "x")])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "wanda-2of4" in res.stderr and "sparsekit recipes" in res.stderr


def test_recipes_command_lists_one_line_each_and_json():
    res = runner.invoke(app, ["recipes"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    names = sorted(p.stem for p in SOURCE.glob("*.yaml"))
    assert [line.split()[0] for line in lines] == names
    assert any(line.split()[:4] == ["wanda-2of4", "wanda", "2:4", "0.5"] for line in lines)

    res = runner.invoke(app, ["recipes", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert [r["name"] for r in rows] == names
    r = next(r for r in rows if r["name"] == "sparsegpt-hybrid")
    assert (r["method"], r["pattern"], r["sparsity"]) == ("sparsegpt", "hybrid", 0.25) and r["description"]
    assert Path(r["path"]).read_text() == (SOURCE / "sparsegpt-hybrid.yaml").read_text()


def test_prune_help_says_where_methods_patterns_and_recipes_are():
    res = runner.invoke(app, ["prune", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 0
    text = " ".join(res.stdout.split())
    for needle in ("magnitude, wanda, sparsegpt, admm, cats", "unstructured", "N:M", "hybrid[:T]", "sparsekit recipes",
                   "wanda-2of4"):
        assert needle in text, needle
