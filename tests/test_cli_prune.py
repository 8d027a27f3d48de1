"""End to end through the CLI: sparsekit prune (recipe + overriding flags) then sparsekit eval --ppl."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparsekit.cli.app import app
from tiny_models import save_tiny, write_corpus

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
runner = CliRunner()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    save_tiny("llama", d / "tiny")
    write_corpus(d / "calib.txt")
    return d


def _json(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_prune_with_recipe_then_eval_ppl(workdir):
    out = workdir / "pruned"
    res = runner.invoke(app, ["prune", str(workdir / "tiny"), "--recipe", str(RECIPES / "sparsegpt-2of4.yaml"),
                              "--calib", str(workdir / "calib.txt"), "--nsamples", "4", "--seqlen", "64",
                              "--device", "cpu", "-o", str(out), "--json"])
    rep = _json(res)
    assert (rep["method"], rep["pattern"], rep["sparsity"]) == ("sparsegpt", "2:4", 0.5)  # from the recipe
    assert rep["calibration"]["nsamples"] == 4 and rep["calibration"]["seqlen"] == 64  # flags override it
    assert all(v["sparsity"] == 0.5 for v in rep["layers"].values()) and len(rep["layers"]) == 21
    assert json.loads((out / "sparsekit.json").read_text())["layers"] == rep["layers"]

    evals = {}
    for name, path in (("dense", workdir / "tiny"), ("pruned", out)):
        res = runner.invoke(app, ["eval", str(path), "--ppl", "--dataset", str(workdir / "calib.txt"),
                                  "--seqlen", "64", "--max-windows", "4", "--device", "cpu", "--json"])
        evals[name] = _json(res)["ppl"]
    for r in evals.values():
        assert r["windows"] == 4 and math.isfinite(r["ppl"]) and r["ppl"] > 1
    assert evals["pruned"]["ppl"] != evals["dense"]["ppl"]  # the eval really read the pruned weights


def test_prune_table_output_and_refusals(workdir):
    out = workdir / "mag"
    res = runner.invoke(app, ["prune", str(workdir / "tiny"), "--method", "magnitude", "--pattern", "4:8",
                              "--skip", "lm_head", "--skip", "*.o_proj", "-o", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "sparsity by module type" in res.stdout and "mlp.down_proj" in res.stdout
    assert "o_proj" not in res.stdout  # skipped
    res = runner.invoke(app, ["prune", str(workdir / "tiny"), "--method", "magnitude", "-o", str(out)])
    assert res.exit_code == 2 and "--overwrite" in res.stderr and res.stdout == ""
    res = runner.invoke(app, ["prune", str(workdir / "tiny"), "--sparsity", "1.5", "-o", str(workdir / "bad")])
    assert res.exit_code == 2 and "out of range" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = runner.invoke(app, ["prune", str(workdir / "tiny"), "--recipe", "nope.yaml", "-o", str(workdir / "bad")])
    assert res.exit_code == 2 and "nope.yaml" in res.stderr
    assert not (workdir / "bad").exists()


def test_prune_help_lists_every_option():
    res = runner.invoke(app, ["prune", "--help"])
    assert res.exit_code == 0
    for opt in ("--method", "--sparsity", "--pattern", "--calib", "--nsamples", "--seqlen", "--seed", "--skip",
                "--recipe", "--output", "--overwrite", "--device", "--dtype", "--blocksize", "--damp", "--json"):
        assert opt in res.stdout, opt


def test_the_sparsity_help_states_the_defaults_that_apply():
    """Issue 25 item 11: --help said the default sparsity is 0.5, and --pattern hybrid without
    --sparsity pruned to 0.25."""
    import typer

    from sparsekit.pruning.recipes import resolve_settings

    (option,) = [p for p in typer.main.get_command(app).commands["prune"].params if p.name == "sparsity"]
    for pattern, words in (("unstructured", "default: {:g}"), ("hybrid", "hybrid {:g}")):
        assert words.format(resolve_settings(pattern=pattern).sparsity) in option.help, (pattern, option.help)
    assert "implied by N:M" in option.help


def test_a_missing_calibration_file_is_reported_before_the_model_loads(workdir, monkeypatch):
    """Issue 25 item 12: `--calib nosuch.txt` was reported only after the model had loaded."""
    from sparsekit.hf import models

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the calibration path was checked")
    monkeypatch.setattr(models, "load_model", no_loading)
    monkeypatch.setattr(models, "resolve_model", no_loading)
    for calib in ("nosuch.txt", str(workdir / "nosuch.jsonl"), str(workdir)):
        res = runner.invoke(app, ["prune", str(workdir / "tiny"), "--calib", calib, "-o", str(workdir / "never")])
        assert res.exit_code == 2, res.output
        assert len(res.stderr.strip().splitlines()) == 1 and calib in res.stderr, res.stderr
    assert not (workdir / "never").exists()
