"""Issue 23: DSnoT mask refinement (``--refine dsnot``) on Wanda and SparseGPT masks.

Invariants checked against references computed here: the layer's reconstruction error (float64)
never increases, each row keeps its count, N:M groups and hybrid tiles keep their structure.
"""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.pruning.methods.dsnot import dsnot_refine
from sparsekit.pruning.methods.sparsegpt import sparsegpt_prune
from sparsekit.pruning.methods.wanda import wanda_mask
from sparsekit.pruning.patterns import Pattern

from test_admm import error
from tiny_models import make_workdir

runner = CliRunner()


def layer_with_inputs(seed: int, out: int = 64, inp: int = 128, tokens: int = 512):
    """A weight, its inputs' column sums of squares and Hessian; inputs with a non-zero mean (DSnoT's case)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, inp, generator=g) * torch.exp(torch.randn(inp, generator=g)) + torch.randn(inp, generator=g)
    return torch.randn(out, inp, generator=g), (x * x).sum(0), 2 * x.T @ x / tokens


def check_structure(before: torch.Tensor, after: torch.Tensor, w: torch.Tensor, pattern: Pattern) -> None:
    assert bool(((w == 0) | after).all())
    assert torch.equal(before.sum(1), after.sum(1))  # each row keeps its count
    if pattern.is_nm or pattern.is_hybrid:
        m = pattern.m
        assert torch.equal(before.reshape(before.shape[0], -1, m).sum(-1), after.reshape(after.shape[0], -1, m).sum(-1))
    if pattern.is_hybrid:  # so dense tiles stay dense and 2:4 tiles 2:4
        t = pattern.tile
        r, c = after.shape
        g = (~after).reshape(r // t, t, c // t, t).permute(0, 2, 1, 3).reshape(r // t, c // t, -1, 4).sum(-1)
        assert bool(((g == 0).flatten(2).all(-1) | (g == 2).flatten(2).all(-1)).all())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("pattern,sparsity", [("unstructured", 0.5), ("unstructured", 0.7), ("2:4", 0.5),
                                              ("4:8", 0.5), ("hybrid:32", 0.3)])
@pytest.mark.parametrize("base", ["wanda", "sparsegpt"])
def test_refinement_never_increases_the_error_and_keeps_the_pattern(seed, pattern, sparsity, base):
    w, colsq, h = layer_with_inputs(seed)
    p = Pattern.parse(pattern)
    if base == "wanda":
        keep = wanda_mask(w, colsq, sparsity, p)
        pruned = w * keep
    else:
        pruned, keep, _ = sparsegpt_prune(w, h, sparsity, p)
    new, k, info = dsnot_refine(w, pruned, keep, h, p)
    check_structure(keep, k, new, p)
    before, after = error(w, pruned, h), error(w, new, h)
    assert after <= before
    assert info["dsnot_error"] == pytest.approx(after / before, rel=1e-3)
    if base == "wanda":
        assert info["dsnot_swaps"] > 0 and after < 0.95 * before  # it does something


def test_zero_cycles_change_nothing():
    w, colsq, h = layer_with_inputs(3)
    keep = wanda_mask(w, colsq, 0.5, Pattern.parse("unstructured"))
    new, k, info = dsnot_refine(w, w * keep, keep, h, "unstructured", cycles=0)
    assert torch.equal(k, keep) and torch.equal(new, w * keep) and info["dsnot_swaps"] == 0


def test_dead_inputs_are_never_revived():
    w, colsq, h = layer_with_inputs(4, out=16, inp=32)
    h[:, 5] = 0
    h[5, :] = 0
    keep = wanda_mask(w, colsq, 0.5, Pattern.parse("unstructured"))
    keep[:, 5] = False
    new, k, _ = dsnot_refine(w, w * keep, keep, h, "unstructured")
    assert not k[:, 5].any() and torch.isfinite(new).all()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("dsnot"))


def test_cli_refine(work, tmp_path):
    res = runner.invoke(app, ["prune", str(work / "llama"), "--method", "wanda", "--pattern", "2:4", "--refine", "dsnot",
                              "--dsnot-cycles", "10", "--calib", str(work / "calib.txt"), "--nsamples", "4",
                              "--seqlen", "32", "--device", "cpu", "-o", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "r" / "sparsekit.json").read_text())
    assert meta["refine"] == {"kind": "dsnot", "cycles": 10}
    assert all(v["sparsity"] == pytest.approx(0.5) for v in meta["layers"].values())
    bad = runner.invoke(app, ["prune", str(work / "llama"), "--refine", "swap", "--device", "cpu", "-o", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "dsnot" in bad.output
