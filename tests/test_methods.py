"""Pruning methods against the papers' definitions, on random matrices.

- magnitude / Wanda: equal to brute-force references written straight from the definitions.
- SparseGPT: equal to a slow reference that applies the OBS formula of the paper column by column
  with explicitly inverted Hessians of the not-yet-swept columns (no Cholesky trick, no lazy
  batching); independent of the block size; reconstruction error below Wanda's, itself below
  magnitude's; the Cholesky retry.
"""
from __future__ import annotations

import pytest
import torch

from sparsekit.errors import SparsekitError
from sparsekit.pruning.methods import METHODS, WEIGHT_METHODS, Method, Observes, PruneResult, get_method, prune_weight
from sparsekit.pruning.patterns import n_pruned
from sparsekit.pruning.methods.sparsegpt import inverse_hessian_cholesky
from sparsekit.pruning.stats import InputStats


def realistic_inputs(n_tokens: int, in_f: int, seed: int) -> torch.Tensor:
    """Activations [tokens, in] with heavy-tailed per-feature scales (a few outlier features) and
    correlated features, like LLM hidden states."""
    g = torch.Generator().manual_seed(seed)
    k = max(4, in_f // 8)  # low-dimensional shared factors -> strong correlations
    factors = torch.randn(n_tokens, k, generator=g) @ torch.randn(k, in_f, generator=g)
    x = factors + 0.5 * torch.randn(n_tokens, in_f, generator=g)
    scales = torch.exp(torch.randn(in_f, generator=g))  # log-normal
    scales[torch.randperm(in_f, generator=g)[: max(1, in_f // 32)]] *= 20  # outlier features
    return x * scales


def stats_for(x: torch.Tensor, hessian: bool = True, chunks: int = 3) -> InputStats:
    st = InputStats(x.shape[-1], hessian=hessian)
    for part in x.chunk(chunks):
        st.add(part)
    return st


def recon_error(w: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> float:
    return ((w.double() - w2.double()) @ x.double().T).norm().item()


# ----------------------------------------------------------------------------- stats
def test_input_stats_match_direct_computation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 37, 24, generator=g) * torch.rand(24, generator=g) * 3
    st = InputStats(24, hessian=True)
    st.add(x[:2])  # [2, 37, 24] batch
    st.add(x[2].reshape(37, 24))  # 2-D batch
    st.add(x[3:].half().float())  # another batch
    flat = torch.cat([x[:3].reshape(-1, 24), x[3:].half().float().reshape(-1, 24)]).double()
    assert st.nsamples == 5 * 37
    torch.testing.assert_close(st.col_sq_sum.double(), (flat**2).sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st.hessian.double(), 2 / flat.shape[0] * flat.T @ flat, rtol=1e-5, atol=1e-5)
    assert st.hessian.dtype == torch.float32
    assert InputStats(24).hessian is None
    with pytest.raises(ValueError):
        st.add(torch.randn(3, 23))


def test_method_registry():
    assert WEIGHT_METHODS == ("magnitude", "wanda", "sparsegpt", "admm")
    assert tuple(METHODS) == WEIGHT_METHODS + ("cats",)
    assert all(isinstance(m, Method) and m.name == name and get_method(name) is m for name, m in METHODS.items())
    assert [m.needs_stats for m in METHODS.values()] == [False, True, True, True, False]
    assert [m.needs_hessian for m in METHODS.values()] == [False, False, True, True, False]
    assert [m.needs_calibration for m in METHODS.values()] == [False, True, True, True, True]
    assert [m.changes_weights for m in METHODS.values()] == [True, True, True, True, False]
    assert [m.observes for m in METHODS.values()] == [Observes.NOTHING, Observes.INPUT_COLUMNS, Observes.HESSIAN,
                                                      Observes.HESSIAN, Observes.GATED_MLP_ACTIVATIONS]
    with pytest.raises(SparsekitError, match="unknown pruning method"):
        get_method("obc")
    with pytest.raises(SparsekitError, match="changes no weight"):  # CATS thresholds activations
        prune_weight(torch.randn(8, 8), "cats", 0.5, "unstructured")


# ----------------------------------------------------------------------------- brute-force references
def brute_force_mask(scores: torch.Tensor, sparsity: float, group: str, nm=None) -> torch.Tensor:
    """Straight from the definitions, with Python loops: prune the lowest scores of each group."""
    rows, cols = scores.shape
    keep = torch.ones(rows, cols, dtype=torch.bool)
    s = scores.tolist()
    if nm is not None:
        n, m = nm
        for r in range(rows):
            for c0 in range(0, cols, m):
                order = sorted(range(c0, c0 + m), key=lambda c: s[r][c])
                for c in order[: m - n]:
                    keep[r, c] = False
    elif group == "row":
        for r in range(rows):
            for c in sorted(range(cols), key=lambda c: s[r][c])[: int(cols * sparsity + 1e-6)]:
                keep[r, c] = False
    else:  # the whole layer
        cells = sorted(((r, c) for r in range(rows) for c in range(cols)), key=lambda rc: s[rc[0]][rc[1]])
        for r, c in cells[: int(rows * cols * sparsity + 1e-6)]:
            keep[r, c] = False
    return keep


@pytest.mark.parametrize("pattern, sparsity", [("unstructured", 0.5), ("unstructured", 0.3), ("unstructured", 0.85), ("2:4", None), ("4:8", None), ("1:4", None)])
def test_magnitude_and_wanda_match_brute_force(pattern, sparsity):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(10, 24, generator=g)
    x = realistic_inputs(50, 24, seed=2)
    st = stats_for(x, hessian=False)
    nm = tuple(int(v) for v in pattern.split(":")) if ":" in pattern else None
    s = sparsity if sparsity is not None else 1 - nm[0] / nm[1]

    mag = prune_weight(w, "magnitude", sparsity, pattern)
    ref = brute_force_mask(w.abs(), s, "layer", nm)
    assert torch.equal(mag.mask, ref)
    assert torch.equal(mag.weight, w * ref)

    xnorm = x.double().norm(dim=0)  # ||X_j||_2 over all tokens
    wanda = prune_weight(w, "wanda", sparsity, pattern, st)
    ref = brute_force_mask((w.double().abs() * xnorm).float(), s, "row", nm)
    assert torch.equal(wanda.mask, ref)
    assert torch.equal(wanda.weight, w * ref)
    for r in (mag, wanda):
        assert isinstance(r, PruneResult)
        assert r.info["sparsity"] == pytest.approx((~r.mask).float().mean().item())


def test_exact_counts_per_comparison_group():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(13, 40, generator=g)
    st = stats_for(realistic_inputs(64, 40, seed=5))
    for s in (0.1, 0.37, 0.5, 0.9):
        mag = prune_weight(w, "magnitude", s, "unstructured")
        assert (~mag.mask).sum() == n_pruned(13 * 40, s)  # whole layer is the group
        wanda = prune_weight(w, "wanda", s, "unstructured", st)
        assert ((~wanda.mask).sum(1) == n_pruned(40, s)).all()  # each output row is a group
        sgpt = prune_weight(w, "sparsegpt", s, "unstructured", st, blocksize=16)
        assert (~sgpt.mask).sum() == n_pruned(13 * 40, s)  # block budgets add up to the layer's
        assert ((sgpt.weight == 0) == ~sgpt.mask).all()


# ----------------------------------------------------------------------------- SparseGPT reference
def reference_sparsegpt(w, hessian, sparsity, nm=None, blocksize=None, percdamp=0.01):
    """SparseGPT from the paper's OBS formulas, in float64, without the Cholesky/lazy-batch tricks.

    Sweeping column c with F = {c, c+1, ...} still free: a pruned weight w_rc is removed with the
    OBS update w_r,F -= w_rc / [H_F^-1]_cc * [H_F^-1]_c,F. The saliency of column j is
    w_j^2 / [H_{F_j}^-1]_jj. N:M selects at the start of each group of M; unstructured selects
    the block's share of the budget at the start of each block.
    """
    w = w.double().clone()
    h = hessian.double().clone()
    rows, cols = w.shape
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += percdamp * h.diagonal().mean() * torch.eye(cols, dtype=h.dtype)
    hf_inv = [torch.linalg.inv(h[c:, c:]) for c in range(cols)]
    sal_den = torch.tensor([hf_inv[c][0, 0].item() for c in range(cols)], dtype=h.dtype)
    prune = torch.zeros(rows, cols, dtype=torch.bool)
    done = 0
    for c in range(cols):
        if nm is not None and c % nm[1] == 0:
            n, m = nm
            sal = w[:, c : c + m] ** 2 / sal_den[c : c + m]
            for r in range(rows):
                for j in sorted(range(m), key=lambda j: sal[r, j].item())[: m - n]:
                    prune[r, c + j] = True
        if nm is None and c % blocksize == 0:
            c2 = min(c + blocksize, cols)
            budget = int(rows * c2 * sparsity + 1e-6) - done
            done += budget
            sal = (w[:, c:c2] ** 2 / sal_den[c:c2]).flatten()
            for i in sorted(range(sal.numel()), key=lambda i: sal[i].item())[:budget]:
                prune[i // (c2 - c), c + i % (c2 - c)] = True
        hinv = hf_inv[c]
        for r in range(rows):
            if prune[r, c]:
                w[r, c:] -= w[r, c] / hinv[0, 0] * hinv[0, :]
                w[r, c] = 0.0
    return w, ~prune


@pytest.mark.parametrize("pattern, blocksize", [("2:4", 8), ("4:8", 16), ("unstructured", 8), ("unstructured", 32)])
def test_sparsegpt_matches_paper_reference(pattern, blocksize):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(6, 32, generator=g, dtype=torch.float64)
    x = realistic_inputs(200, 32, seed=8).double()
    h = 2 / x.shape[0] * x.T @ x
    st = InputStats(32, hessian=True)
    st.hessian = h  # float64 weights are pruned in float64
    nm = tuple(int(v) for v in pattern.split(":")) if ":" in pattern else None
    res = prune_weight(w, "sparsegpt", 0.5, pattern, st, blocksize=blocksize)
    ref_w, ref_keep = reference_sparsegpt(w, h, 0.5, nm=nm, blocksize=blocksize)
    assert torch.equal(res.mask, ref_keep)
    torch.testing.assert_close(res.weight, ref_w, rtol=1e-9, atol=1e-9)
    assert res.weight.dtype == torch.float64


@pytest.mark.parametrize("pattern", ["2:4", "4:8", "hybrid:8"])
def test_sparsegpt_structured_is_independent_of_blocksize(pattern):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(32, 64, generator=g)
    st = stats_for(realistic_inputs(512, 64, seed=12))
    s = 0.25 if pattern.startswith("hybrid") else None
    results = [prune_weight(w, "sparsegpt", s, pattern, st, blocksize=bs) for bs in (4, 8, 128)]
    for r in results[1:]:
        assert torch.equal(r.mask, results[0].mask)
        torch.testing.assert_close(r.weight, results[0].weight, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pattern", ["unstructured", "2:4"])
def test_sparsegpt_updates_kept_weights_and_zeroes_pruned(pattern):
    g = torch.Generator().manual_seed(13)
    w = torch.randn(16, 64, generator=g)
    x = realistic_inputs(512, 64, seed=14)
    res = prune_weight(w, "sparsegpt", 0.5, pattern, stats_for(x), blocksize=16)
    assert (res.weight[~res.mask] == 0).all()
    assert (res.weight[res.mask] != 0).all()
    changed = (res.weight != w) & res.mask
    assert changed[:, 1:].any(0).all()  # every column after the first receives OBS updates
    assert not changed[:, 0].any()  # nothing is left of column 0 to update it
    # the updates pay off: better than the same mask without them
    assert recon_error(w, res.weight, x) < 0.9 * recon_error(w, w * res.mask, x)


# ----------------------------------------------------------------------------- error ordering
@pytest.mark.parametrize("pattern", ["unstructured", "2:4"])
def test_reconstruction_error_ordering(pattern):
    """||WX - W'X||_F at 50%: admm <= sparsegpt < wanda < magnitude, with a margin, on several seeds."""
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        w = torch.randn(64, 128, generator=g)
        x = realistic_inputs(1024, 128, seed=200 + seed)
        st = stats_for(x)
        err = {m: recon_error(w, prune_weight(w, m, 0.5, pattern, st).weight, x) for m in WEIGHT_METHODS}
        assert err["admm"] <= err["sparsegpt"], (seed, err)
        assert err["sparsegpt"] < 0.9 * err["wanda"], (seed, err)
        assert err["wanda"] < 0.9 * err["magnitude"], (seed, err)


# ----------------------------------------------------------------------------- Cholesky retry
def test_cholesky_failure_retries_with_more_damping():
    x = realistic_inputs(16, 48, seed=21)  # fewer tokens than features: H is singular
    h = 2 / 16 * x.T @ x
    h -= 0.05 * h.diagonal().mean() * torch.eye(48)  # and now indefinite: 1% dampening cannot fix it
    st = InputStats(48, hessian=True)
    st.hessian = h.clone()
    warnings = []
    w = torch.randn(8, 48)
    res = prune_weight(w, "sparsegpt", 0.5, "2:4", st, warn=warnings.append)
    assert torch.equal(st.hessian, h)  # the statistics are left as they were
    assert res.info["damp"] == pytest.approx(0.1)
    assert len(warnings) == 1 and "Cholesky failed" in warnings[0] and "0.1" in warnings[0]
    assert (res.weight.reshape(8, -1, 4) == 0).sum(-1).ge(2).all()
    # without trouble: no warning, the requested dampening
    quiet = []
    ok = prune_weight(w, "sparsegpt", 0.5, "2:4", stats_for(realistic_inputs(256, 48, seed=22)), warn=quiet.append)
    assert ok.info["damp"] == 0.01 and quiet == []
    # a singular H with no dampening at all gets 1%
    _, pd = inverse_hessian_cholesky(2 / 16 * x.T @ x, percdamp=0.0, warn=quiet.append)
    assert pd == 0.01 and len(quiet) == 1
    bad = InputStats(48, hessian=True)
    bad.hessian = torch.full((48, 48), float("nan"))
    with pytest.raises(SparsekitError, match="input Hessian is not finite .* calibrate in fp32/bf16 or with other data"):
        prune_weight(w, "sparsegpt", 0.5, "2:4", bad)


def test_sparsegpt_dead_inputs():
    x = realistic_inputs(256, 32, seed=31)
    x[:, [3, 17]] = 0  # two inputs that never fire
    w = torch.randn(8, 32)
    res = prune_weight(w, "sparsegpt", 0.5, "unstructured", stats_for(x))
    assert res.info["dead"] == 2
    assert (res.weight[:, [3, 17]] == 0).all() and not res.mask[:, [3, 17]].any()
    assert (~res.mask).sum() == 8 * 16


# ----------------------------------------------------------------------------- API behaviour
@pytest.mark.parametrize("method", WEIGHT_METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtype_is_preserved_and_input_untouched(method, dtype):
    w = torch.randn(16, 32).to(dtype)
    before = w.clone()
    st = stats_for(realistic_inputs(128, 32, seed=41))
    for pattern, s in (("unstructured", 0.6), ("2:4", None), ("hybrid:16", 0.25)):
        res = prune_weight(w, method, s, pattern, st if get_method(method).needs_stats else None)
        assert res.weight.dtype == dtype and res.mask.dtype == torch.bool and res.weight.shape == w.shape
        assert ((res.weight == 0) | res.mask).all() and (res.weight[~res.mask] == 0).all()
        assert res.info["method"] == method and res.info["pattern"] == pattern
        if pattern == "hybrid:16":
            assert res.info["tiles"] == 2 and res.info["sparse_tiles"] == 1
    assert torch.equal(w, before)


def test_zero_sparsity_keeps_everything():
    w = torch.randn(8, 16)
    st = stats_for(realistic_inputs(64, 16, seed=51))
    for method in WEIGHT_METHODS:
        for pattern in ("unstructured", "hybrid:8"):
            res = prune_weight(w, method, 0.0, pattern, st)
            assert res.mask.all() and torch.equal(res.weight, w)


def test_prune_weight_errors():
    w = torch.randn(8, 18)
    st = stats_for(realistic_inputs(64, 18, seed=61))
    with pytest.raises(SparsekitError, match="divisible by 4"):
        prune_weight(w, "magnitude", None, "2:4")
    with pytest.raises(SparsekitError, match="out of range"):
        prune_weight(w, "magnitude", 1.0, "unstructured")
    with pytest.raises(SparsekitError, match="fixes the sparsity"):
        prune_weight(torch.randn(8, 16), "magnitude", 0.7, "2:4")
    with pytest.raises(SparsekitError, match="needs calibration statistics"):
        prune_weight(w, "wanda", 0.5, "unstructured")
    with pytest.raises(SparsekitError, match="Hessian"):
        prune_weight(w, "sparsegpt", 0.5, "unstructured", stats_for(realistic_inputs(64, 18, seed=62), hessian=False))
    with pytest.raises(SparsekitError, match="unknown pruning method"):
        prune_weight(w, "random", 0.5, "unstructured", st)
    with pytest.raises(SparsekitError, match="features"):
        prune_weight(torch.randn(8, 16), "wanda", 0.5, "unstructured", st)


@pytest.mark.parametrize("method", WEIGHT_METHODS)
def test_hybrid_tiles_dense_or_2of4(method):
    """Every 8x8 tile is dense or 2:4, with round(s / 0.5 * n_tiles) 2:4 tiles; s = 0.5 is plain 2:4."""
    g = torch.Generator().manual_seed(81)
    w = torch.randn(24, 32, generator=g) * (1 + 3 * torch.rand(24, 1, generator=g))
    st = stats_for(realistic_inputs(256, 32, seed=82))
    for s in (0.125, 0.25, 0.4):
        res = prune_weight(w, method, s, "hybrid:8", st)
        tiles = res.mask.reshape(3, 8, 4, 8).permute(0, 2, 1, 3).reshape(12, 8, 2, 4)
        dense = tiles.all(dim=(1, 2, 3))
        two_four = (tiles.sum(-1) == 2).all(dim=(1, 2))
        assert (dense | two_four).all()
        assert int(two_four.sum()) == round(s / 0.5 * 12) == res.info["sparse_tiles"]
        assert ((res.weight == 0) == ~res.mask).all()
    full = prune_weight(w, method, 0.5, "hybrid:8", st)
    nm = prune_weight(w, method, None, "2:4", st)
    assert torch.equal(full.mask, nm.mask)
    torch.testing.assert_close(full.weight, nm.weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    w = torch.randn(64, 256)
    x = realistic_inputs(1024, 256, seed=71)
    st_cpu = stats_for(x)
    st_gpu = InputStats(256, hessian=True, device="cuda")
    for part in x.chunk(3):
        st_gpu.add(part.cuda())
    for method in WEIGHT_METHODS:
        for pattern in ("unstructured", "2:4"):
            a = prune_weight(w, method, 0.5, pattern, st_cpu)
            b = prune_weight(w.cuda(), method, 0.5, pattern, st_gpu)
            assert b.weight.is_cuda and b.mask.is_cuda
            agree = (a.mask == b.mask.cpu()).float().mean().item()
            assert agree > 0.98, (method, pattern, agree)
            h = prune_weight(w.cuda().half(), method, 0.5, pattern, st_gpu)
            assert h.weight.dtype == torch.float16 and (h.weight[~h.mask] == 0).all()
            assert (~h.mask).sum().item() == 64 * 128


@pytest.mark.parametrize("method", WEIGHT_METHODS)
def test_transposed_parameter_views(method):
    """GPT-2's Conv1D stores [in, out]: the engine hands over a transposed view of a Parameter."""
    g = torch.Generator().manual_seed(91)
    stored = torch.nn.Parameter(torch.randn(32, 16, generator=g))  # [in, out]
    st = stats_for(realistic_inputs(128, 32, seed=92))
    for pattern in ("unstructured", "2:4"):
        res = prune_weight(stored.t(), method, 0.5, pattern, st)
        ref = prune_weight(stored.detach().t().contiguous(), method, 0.5, pattern, st)
        assert torch.equal(res.mask, ref.mask) and torch.equal(res.weight, ref.weight)
        assert not res.weight.requires_grad


# ----------------------------------------------------------------------------- staged / CUDA-graph sweep
def _staged_vs_eager(device: str):
    """The staged sweep (static per-shape buffers; captured and replayed as a CUDA graph on CUDA)
    gives what the eager sweep gives, for every pattern, a short last block, and a second weight of
    the same shape (the cached buffers/graph reused with other numbers)."""
    from sparsekit.pruning.patterns import Pattern
    from sparsekit.pruning.methods.sparsegpt import GRAPH_CACHE, clear_graph_cache, sparsegpt_prune

    clear_graph_cache()
    cases = [("unstructured", 0.5, 16), ("unstructured", 0.3, 128), ("2:4", 0.5, 16), ("4:8", 0.5, 24), ("hybrid:8", 0.25, 16)]
    for seed in range(2):
        g = torch.Generator().manual_seed(300 + seed)
        w = torch.randn(16, 72, generator=g).to(device)  # 72 columns: blocks of 16 + a last one of 8
        x = realistic_inputs(256, 72, seed=400 + seed)
        h = (2 / 256 * x.T @ x).to(device)
        for pattern, s, bs in cases:
            warned = []
            args = (w, h, s, Pattern.parse(pattern))
            ew, ekeep, einfo = sparsegpt_prune(*args, blocksize=bs, cuda_graph=False)
            gw, gkeep, ginfo = sparsegpt_prune(*args, blocksize=bs, cuda_graph=True, warn=warned.append)
            assert warned == [], warned
            assert torch.equal(gkeep, ekeep), (pattern, seed)
            torch.testing.assert_close(gw, ew, rtol=1e-6, atol=1e-6)
            assert ginfo["loss"] == pytest.approx(einfo["loss"], rel=1e-6)
            assert ((gw == 0) == ~gkeep).all()
    shapes = {key[:2] for key in GRAPH_CACHE}
    assert {(16, 16), (16, 8), (16, 24)} <= shapes  # one entry per block shape, reused across blocks
    return list(GRAPH_CACHE.values())


def test_staged_sweep_matches_eager_on_cpu():
    _staged_vs_eager("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_sweep_matches_eager():
    staged = _staged_vs_eager("cuda")
    assert all(st.graph is not None for st in staged)  # every block shape was captured, then replayed
    # the default on CUDA is the graph path: prune_weight agrees with the eager sweep
    from sparsekit.pruning.patterns import Pattern
    from sparsekit.pruning.methods.sparsegpt import sparsegpt_prune

    w = torch.randn(64, 256).cuda()
    st = stats_for(realistic_inputs(512, 256, seed=77))
    h = st.hessian.cuda()
    res = prune_weight(w, "sparsegpt", 0.5, "2:4", st)
    ew, ekeep, _ = sparsegpt_prune(w, h, 0.5, Pattern.parse("2:4"), cuda_graph=False)
    assert torch.equal(res.mask, ekeep)
    torch.testing.assert_close(res.weight, ew, rtol=1e-6, atol=1e-6)
