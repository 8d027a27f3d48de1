"""Issue 23: the ADMM weight update (Boža 2024): ``--update admm`` on any mask, ``--method admm``.

References: the reconstruction error tr((W'-W) H (W'-W)^T) computed here in float64, SparseGPT's
result on the same layer, and a float64 closed-form least-squares solve per row on the kept weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.pruning.methods.admm import admm_prune
from sparsekit.pruning.methods.sparsegpt import sparsegpt_prune
from sparsekit.pruning.methods.steps import with_steps
from sparsekit.pruning.methods import METHODS
from sparsekit.pruning.methods.wanda import wanda_mask
from sparsekit.pruning.patterns import Pattern
from sparsekit.pruning.stats import InputStats

from tiny_models import make_workdir

runner = CliRunner()
PATTERNS = [("unstructured", 0.5), ("unstructured", 0.7), ("2:4", 0.5), ("hybrid:32", 0.3)]


def random_layer(seed: int, out: int = 64, inp: int = 128, tokens: int = 1024, dtype=torch.float32):
    """A weight and the Hessian 2/n X^T X of correlated inputs with feature scales spread over e^+-2."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(inp, generator=g))
    mix = torch.eye(inp) + 0.3 * torch.randn(inp, inp, generator=g) / inp ** 0.5
    x = (torch.randn(tokens, inp, generator=g) @ mix) * scale
    w = torch.randn(out, inp, generator=g)
    return w.to(dtype), (2 * x.T @ x / tokens).to(dtype)


def error(dense, new, h) -> float:
    d = new.double() - dense.double()
    return float(((d @ h.double()) * d).sum())


def closed_form(w: torch.Tensor, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """argmin over W' zero outside ``keep`` of tr((W'-W) H (W'-W)^T), row by row, in float64."""
    w, h = w.double(), h.double()
    out = torch.zeros_like(w)
    for r in range(w.shape[0]):
        k = keep[r].nonzero().squeeze(1)
        out[r, k] = torch.linalg.solve(h[k][:, k], (w[r] @ h)[k])
    return out


def check_pattern(w: torch.Tensor, keep: torch.Tensor, pattern: Pattern, sparsity: float, pruned: int | None = None) -> None:
    """Zeros outside ``keep``, and ``keep`` obeys the pattern (unstructured: ``pruned`` weights, by
    default floor(numel * sparsity), the per-layer count)."""
    assert bool(((w == 0) | keep).all())
    if pattern.is_nm:
        assert bool((keep.reshape(keep.shape[0], -1, pattern.m).sum(-1) == pattern.n).all())
    elif pattern.is_hybrid:
        t = pattern.tile
        r, c = keep.shape
        g = (~keep).reshape(r // t, t, c // t, t).permute(0, 2, 1, 3).reshape(r // t, c // t, t, t // 4, 4).sum(-1)
        assert bool(((g == 0).flatten(2).all(-1) | (g == 2).flatten(2).all(-1)).all())
    else:
        assert int((~keep).sum()) == (int(keep.numel() * sparsity + 1e-6) if pruned is None else pruned)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("pattern,sparsity", PATTERNS)
def test_admm_error_at_most_sparsegpt(seed, pattern, sparsity):
    w, h = random_layer(seed)
    p = Pattern.parse(pattern)
    ws, ks, _ = sparsegpt_prune(w, h, sparsity, p)
    wa, ka, _ = admm_prune(w, h, sparsity, p)  # --method admm: its own (gradual) mask
    check_pattern(wa, ka, p, sparsity)
    assert error(w, wa, h) <= error(w, ws, h)
    wu, ku, info = admm_prune(w, h, sparsity, p, keep=ks, init=ws)  # --update admm on SparseGPT's mask
    assert torch.equal(ku, ks) and info["admm_kept"]
    assert error(w, wu, h) <= error(w, ws, h)


@pytest.mark.parametrize("dtype,iters,tol", [(torch.float64, 200, 1e-9), (torch.float32, 200, 1e-4)])
def test_fixed_mask_converges_to_the_least_squares_optimum(dtype, iters, tol):
    w, h = random_layer(3, out=16, inp=32, tokens=256, dtype=dtype)
    keep = torch.rand(w.shape, generator=torch.Generator().manual_seed(4)) > 0.6
    ref = closed_form(w, h, keep)
    new, k, _ = admm_prune(w, h, 0.0, "unstructured", keep=keep, iters=iters, damp=0.0)
    assert torch.equal(k, keep)
    assert (new.double() - ref).abs().max() <= tol * ref.abs().max()
    assert error(w, new, h) == pytest.approx(error(w, ref, h), rel=tol)


def test_default_damping_converges_to_the_damped_optimum():
    # damp d in the normalized space: the objective's H becomes H + d * diag(H)
    w, h = random_layer(5, out=16, inp=32, tokens=256, dtype=torch.float64)
    keep = torch.rand(w.shape, generator=torch.Generator().manual_seed(6)) > 0.5
    ref = closed_form(w, h + 0.1 * torch.diag(h.diagonal()), keep)
    new, _, _ = admm_prune(w, h, 0.0, "unstructured", keep=keep, iters=300)
    assert (new - ref).abs().max() <= 1e-8 * ref.abs().max()


@pytest.mark.parametrize("pattern,sparsity", PATTERNS)
def test_update_keeps_any_mask_and_never_loses_to_its_init(pattern, sparsity):
    w, h = random_layer(7)
    p = Pattern.parse(pattern)
    stats = InputStats(w.shape[1], hessian=True)
    stats.hessian.copy_(h)
    stats.col_sq_sum.copy_(h.diagonal() / 2 * 1024)
    keep = wanda_mask(w, stats.col_sq_sum, sparsity, p)
    meth = with_steps(METHODS["wanda"], update="admm", admm_iters=20)
    res = meth.prune(w, sparsity, p, stats, blocksize=128, percdamp=0.01, warn=print)
    assert torch.equal(res.mask, keep)  # the method's mask, untouched
    check_pattern(res.weight, res.mask, p, sparsity, int((~keep).sum()))
    assert error(w, res.weight, h) < error(w, w * keep, h)
    # a hopeless update (one iteration from the dense weights) loses to a near-optimal init: the init is kept
    best = closed_form(w, h, keep).float()
    new, _, info = admm_prune(w, h, sparsity, p, keep=keep, init=best, iters=1)
    assert not info["admm_kept"] and torch.equal(new, best * keep)


def test_dead_inputs_are_pruned():
    w, h = random_layer(8, out=8, inp=16, tokens=64)
    h[:, 3] = 0
    h[3, :] = 0
    new, keep, _ = admm_prune(w, h, 0.5, "unstructured")
    assert not keep[:, 3].any() and (new[:, 3] == 0).all() and torch.isfinite(new).all()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("admm"))


def test_cli_method_and_update_streamed_like_in_memory(work, tmp_path):
    base = ["prune", str(work / "llama"), "--calib", str(work / "calib.txt"), "--nsamples", "4", "--seqlen", "32",
            "--device", "cpu", "--json"]
    outs = {}
    for name, extra in {"m-mem": ["--method", "admm", "--offload", "memory", "--admm-iters", "6"],
                        "m-disk": ["--method", "admm", "--offload", "disk", "--admm-iters", "6"],
                        "u": ["--method", "wanda", "--pattern", "2:4", "--update", "admm"]}.items():
        res = runner.invoke(app, [*base, *extra, "-o", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
        outs[name] = json.loads((tmp_path / name / "sparsekit.json").read_text())
    assert outs["m-mem"]["method"] == "admm" and outs["m-mem"]["layers"] == outs["m-disk"]["layers"]
    assert outs["u"]["update"] == {"kind": "admm", "iters": 20} and outs["u"]["method"] == "wanda"
    from safetensors.torch import load_file

    a, b = (load_file(str(next((tmp_path / n).glob("*.safetensors")))) for n in ("m-mem", "m-disk"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("args,words", [
    (["--method", "admm", "--update", "admm"], "already"),
    (["--update", "sgd"], "admm"),
    (["--update", "admm", "--admm-iters", "0"], "admm iters"),
    (["--method", "cats", "--update", "admm"], "cats"),
])
def test_bad_update_input_is_a_one_line_error(work, tmp_path, args, words):
    res = runner.invoke(app, ["prune", str(work / "llama"), "--device", "cpu", "-o", str(tmp_path / "x"), *args])
    assert res.exit_code == 2, res.output
    assert words in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_learned_mask_gets_the_admm_update(work, tmp_path):
    from sparsekit.pruning.api import prune

    rep = prune(str(work / "llama"), method="sparsegpt", pattern="2:4", learn={"steps": 2, "batch_size": 2},
                update="admm", admm_iters=5, calib=str(work / "calib.txt"), nsamples=4, seqlen=32, device="cpu",
                output=tmp_path / "l", warn=lambda m: None)
    assert rep["learning"]["update"] == "admm" and rep["learning"]["admm_iters"] == 5
    assert rep["overall_sparsity"] == pytest.approx(0.5, abs=1e-3)
