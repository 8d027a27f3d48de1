"""The 2:4 tile-mosaic kernel and its mma.sp twin against float64 references, under Numba's CUDA
simulator (or on a GPU when there is one).

What the simulator covers: the twin of ``mma.sp`` m16n8k32 (selector 0) with the fragment and metadata
layouts of docs/kernels-notes.md "v13-sp", the ``ldmatrix.x4`` exchange, and the whole kernel source
(tile kinds, strip addressing, the X slot, the metadata shuffle, split-K over warps, token chunks,
padding). Not covered: the PTX itself (scripts/checks/gpu_sp24.py runs these on the device). Sizes are
tiny: the simulator runs every thread in Python.
"""
from __future__ import annotations

import time

import pytest
import torch

from sparsekit.kernels.common import SIM
from sparsekit.kernels.sp24 import sp24_matmul
from sparsekit.kernels.sp24_probe import c_fragment, mma_sp_once, random_operands, swap_halves
from sparsekit.packed import sp24
from sparsekit.pruning.patterns import hybrid_mask, nm_mask

DEV = "cpu" if SIM else "cuda"
if not SIM and not torch.cuda.is_available():  # pragma: no cover - conftest sets the simulator
    pytest.skip("neither the CUDA simulator nor a GPU", allow_module_level=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_mma_sp_twin_matches_float64(seed):
    a, b, c, (ar, br, meta, cr) = random_operands(seed)
    d = mma_sp_once(ar.to(DEV), br.to(DEV), meta.to(DEV), cr.to(DEV)).cpu().double()
    ref = c_fragment(a.double() @ b.double() + c.double())
    assert (d - ref).abs().max() < 1e-5 * ref.abs().max()


def test_mma_sp_twin_catches_swapped_row_halves():
    a, b, c, (ar, br, meta, cr) = random_operands(2)
    d = mma_sp_once(ar.to(DEV), br.to(DEV), swap_halves(meta).to(DEV), cr.to(DEV)).cpu().double()
    ref = c_fragment(a.double() @ b.double() + c.double())
    assert (d - ref).abs().max() > 0.1 * ref.abs().max()


def _weight(m, k, kind, g):
    w = torch.randn(m, k, generator=g).half()
    s = torch.rand(m, k, generator=g)
    if kind == "2:4":
        return w * nm_mask(s, 2, 4)
    if kind == "hybrid":
        return w * hybrid_mask(s, 0.25, 64)
    if kind == "halves":                       # tile column 0 dense, the others 2:4
        w[:, 64:] *= nm_mask(s[:, 64:], 2, 4)
    return w


def _rel_err(lay, w, x, **tuning):
    m, n = w.shape[0], x.shape[0]
    out = torch.full((n, m), float("nan"), dtype=torch.float16, device=DEV)      # poisoned
    y = sp24_matmul(x.to(DEV), lay.to(DEV), out=out, **tuning)
    assert y is out
    assert not torch.isnan(y).any(), "some outputs were never written"
    ref = x.double() @ w.double().t()
    return float((y.cpu().double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("m,k,n,kind,tuning", [
    (64, 128, 1, "2:4", {}),                                # one tile row, 2 steps on one warp
    (64, 128, 3, "dense", dict(warps=2)),                   # dense tiles, split-K over 2 warps
    (128, 128, 5, "hybrid", dict(warps=2)),                 # a mixed mosaic: warps on tiles of both kinds
    (100, 136, 9, "2:4", dict(warps=3, strips=2)),          # M, K padding; odd N, 2 mma blocks; 7 strip rows
    (130, 72, 2, "2:4", dict(strips=4)),                    # 3 tile rows, the last mostly padding
    (16, 128, 37, "halves", {}),                            # 64-token chunk, rows past N; mixed kinds
    (16, 64, 70, "2:4", dict(warps=1)),                     # two token chunks (grid blocks 0 and 1)
    (64, 512, 2, "hybrid", dict(warps=2)),                  # 4 steps a warp from rotated starts: the tile word
])                                                          # loaded a step ahead, wrapping past the last column
def test_kernel_matches_float64(m, k, n, kind, tuning):
    g = torch.Generator().manual_seed(m * 7 + n)
    w = _weight(m, k, kind, g)
    x = torch.randn(n, k, generator=g).half()
    lay = sp24.transcode(w)
    if kind in ("hybrid", "halves"):
        assert 0 < int(lay.kinds.sum()) < lay.kinds.numel()
    assert _rel_err(lay, w, x, **tuning) < 1e-3       # fp16 output rounding is ~2e-4


@pytest.mark.parametrize("seed,k,n,tuning", [
    (11, 64, 2, {}),                                   # sp24_kernel (auto at this size)
    (12, 128, 3, dict(kernel="rows", splits=2)),       # sp24_rows, split-K across 2 blocks
])
def test_kernels_catch_a_planted_metadata_bug(seed, k, n, tuning):
    """The same layout with each metadata word's row halves swapped must fail the checks above."""
    g = torch.Generator().manual_seed(seed)
    w = _weight(64, k, "2:4", g)
    x = torch.randn(n, k, generator=g).half()
    lay = sp24.transcode(w)
    bad = _swapped_metadata(lay)
    assert _rel_err(lay, w, x, **tuning) < 1e-3
    assert _rel_err(bad, w, x, **tuning) > 0.1


def _swapped_metadata(lay):
    """The layout with each metadata word's row halves swapped (a planted layout bug)."""
    sp = lay.sp.clone().reshape(-1, sp24.SP_STRIP_WORDS)
    sp[:, sp24.SP_VALUE_WORDS:] = swap_halves(sp[:, sp24.SP_VALUE_WORDS:])
    return sp24.Sp24Layout(dense=lay.dense, sp=sp.reshape(-1), tiles=lay.tiles, shape=lay.shape)


@pytest.mark.parametrize("m,k,n,kind,tuning", [
    (64, 128, 1, "2:4", {}),                                    # one tile row, one split, 2 steps
    (64, 256, 3, "dense", dict(splits=2)),                      # dense tiles; split-K across 2 blocks + fixup
    (128, 320, 5, "hybrid", dict(splits=3)),                    # mixed mosaic; uneven splits (2, 2, 1 columns)
    (130, 128, 9, "halves", dict(strips=2, splits=2)),          # 2 tile rows per block, the last block half out
    (16, 64, 70, "2:4", dict(tokens=64, stages=2)),             # two 64-token chunks, rows past N zero-filled
])
def test_rows_kernel_matches_float64(m, k, n, kind, tuning):
    """sp24_rows (a tile row per block, cp.async ring for X and A, K split across blocks): every case
    twice, so a split-K arrival counter that is not reset by its last block fails the second call."""
    g = torch.Generator().manual_seed(m * 5 + n)
    w = _weight(m, k, kind, g)
    x = torch.randn(n, k, generator=g).half()
    lay = sp24.transcode(w)
    for _ in range(2):
        assert _rel_err(lay, w, x, kernel="rows", **tuning) < 1e-3



@pytest.mark.warpgroup_sim
@pytest.mark.parametrize("kernel,m,k,n,tuning", [
    ("wg", 64, 128, 1, {}),                                       # one warpgroup, 8 tokens, 2 steps
    ("wg", 128, 128, 5, dict(groups=2, tokens=16)),               # two warpgroups share the X slice
    ("wg", 130, 192, 9, dict(strips=2, splits=2, tokens=8)),      # 2 tile rows per warpgroup, the last block's
                                                                  # second row past the weight; split-K + fixup
    ("wg", 64, 320, 17, dict(tokens=32, kstep=2, splits=2, stages=3)),  # 2 tile columns per step, a (3, 2) split
    ("wg", 16, 64, 20, dict(tokens=8)),                           # three 8-token chunks, rows past N zero-filled
    ("ws", 64, 128, 1, dict(groups=1, strips=1)),                 # one consumer warpgroup and the producer warp
    ("ws", 130, 192, 5, dict(strips=2, splits=2, tokens=8, stages=2)),  # a 2-stage ring refilled through "empty";
                                                                  # the last block's second row past the weight
                                                                  # (one token chunk: chunks with split-K below)
    ("ws", 128, 320, 20, dict(groups=2, strips=1, tokens=8, splits=2)),  # two consumer warpgroups; three 8-token
                                                                  # chunks (each its own X slab); split 3 + 2
])
def test_wg_kernels_match_float64(kernel, m, k, n, tuning):
    """sp24_wg (Hopper's sparse warpgroup MMA; its simulator twin reads B through the descriptor) and sp24_ws
    (the same, warp-specialized: a producer warp's bulk copies on mbarriers, which the simulator emulates
    with their phases and transaction bytes): every case twice, so a split-K arrival counter left set
    fails the second call."""
    g = torch.Generator().manual_seed(m * 3 + n)
    w = _weight(m, k, "2:4", g)
    x = torch.randn(n, k, generator=g).half()
    lay = sp24.transcode(w)
    for _ in range(2):
        assert _rel_err(lay, w, x, kernel=kernel, **tuning) < 1e-3


@pytest.mark.warpgroup_sim
@pytest.mark.parametrize("kernel", ["wg", "ws"])
def test_wg_kernels_catch_a_planted_metadata_bug(kernel):
    g = torch.Generator().manual_seed(13)
    w = _weight(64, 128, "2:4", g)
    x = torch.randn(3, 128, generator=g).half()
    lay = sp24.transcode(w)
    kw = dict(groups=1, strips=1) if kernel == "ws" else {}
    assert _rel_err(lay, w, x, kernel=kernel, **kw) < 1e-3
    assert _rel_err(_swapped_metadata(lay), w, x, kernel=kernel, **kw) > 0.1


def test_wg_kernel_refuses_dense_tiles():
    g = torch.Generator().manual_seed(14)
    lay = sp24.transcode(_weight(64, 128, "halves", g))
    with pytest.raises(ValueError, match="all 2:4"):
        sp24_matmul(torch.zeros(2, 128, dtype=torch.float16, device=DEV), lay.to(DEV), kernel="wg")
    with pytest.raises(ValueError, match="one tile row per warpgroup"):
        sp24_matmul(torch.zeros(2, 128, dtype=torch.float16, device=DEV), lay.to(DEV), kernel="ws", strips=2)


@pytest.mark.warpgroup_sim
@pytest.mark.parametrize("m,k,n,kind,tuning", [
    (64, 192, 3, "halves", dict(groups=1)),                     # tile column 0 dense: the kinds change per step
    (128, 192, 9, "halves", dict(groups=2, tokens=8, stages=2)),  # two warpgroups; a 2-stage ring refilled
    (192, 256, 17, "hybrid", dict(groups=2, splits=2)),         # a random mosaic (3 tile rows: the last block's
                                                                # second warpgroup past the weight); split-K + fixup
    (64, 128, 20, "dense", dict(groups=1, tokens=8)),           # every tile dense; three 8-token chunks
])
def test_ws_kernel_takes_hybrid_weights(m, k, n, kind, tuning):
    """sp24_ws on weights with dense tiles: the producer reads the tile map and publishes each tile's kind,
    the consumers run a dense tile as four m64nNk16 products (``wg_mmad``). Twice each (split-K counters)."""
    g = torch.Generator().manual_seed(m + 7 * n)
    w = _weight(m, k, kind, g)
    x = torch.randn(n, k, generator=g).half()
    lay = sp24.transcode(w)
    assert lay.dense.numel()
    for _ in range(2 if tuning.get("splits") else 1):          # a split-K counter left set fails the second
        assert _rel_err(lay, w, x, kernel="ws", **tuning) < 1e-3


@pytest.mark.warpgroup_sim
def test_ws_kernel_catches_a_planted_dense_fragment_bug():
    """A dense tile's 16-column fragments in the wrong order (q and q ^ 2 swapped) must fail."""
    g = torch.Generator().manual_seed(15)
    w = _weight(64, 128, "halves", g)
    x = torch.randn(3, 128, generator=g).half()
    lay = sp24.transcode(w)
    dense = lay.dense.clone().reshape(-1, 2, 2, 32 * 4)[:, [1, 0]].reshape(-1)     # [strip, q, lane, 4]
    bad = sp24.Sp24Layout(dense=dense, sp=lay.sp, tiles=lay.tiles, shape=lay.shape)
    assert _rel_err(lay, w, x, kernel="ws", groups=1) < 1e-3
    assert _rel_err(bad, w, x, kernel="ws", groups=1) > 0.1


@pytest.mark.warpgroup_sim
def test_a_default_ws_plan_is_made_once_per_shape_and_token_count(monkeypatch):
    """An eager call's host work (issue 22: a 7B prefill at batch 1 is host-bound): sp24_ws's default plan is made
    the first time a weight shape meets a token count and reused after, a forced plan is made at every call, a
    probe build inside ``built_as`` is not served the remembered default kernel, and every answer stays right."""
    from sparsekit.kernels import sp24_plan

    made = []
    real = sp24_plan.wg_plan
    monkeypatch.setattr(sp24_plan, "wg_plan", lambda *a, **kw: made.append(a[:3]) or real(*a, **kw))
    g = torch.Generator().manual_seed(11)
    w = _weight(64, 192, "2:4", g)
    lay = sp24.transcode(w)
    x = torch.randn(6, 192, generator=g).half()
    for _ in range(2):
        assert _rel_err(lay, w, x, kernel="ws") < 1e-3
    assert made == [(64, 3, 6)]
    for _ in range(2):
        assert _rel_err(lay, w, x, kernel="ws", tokens=8) < 1e-3
    assert made == [(64, 3, 6)] * 3
    from sparsekit.kernels.sp24_ws_probe import built_as

    with built_as("no_loop"):                      # a probe build is a kernel of its own, never the remembered one
        y = sp24_matmul(x.to(DEV), lay.to(DEV), kernel="ws")
    assert torch.count_nonzero(y) == 0
    assert _rel_err(lay, w, x, kernel="ws") < 1e-3


def test_x_slabs_put_each_value_where_the_descriptor_reads_it():
    from sparsekit.kernels.sp24_ws import x_slabs

    n, kp, nt = 11, 128, 8
    x = torch.arange(n * kp, dtype=torch.float32).reshape(n, kp).half()
    flat = x_slabs(x, nt).view(torch.float16).reshape(-1)
    for tok, col in ((0, 0), (3, 9), (10, 127), (7, 64)):
        c, r = divmod(tok, nt)
        gk, kk = divmod(col, 64)
        byte = (c * (kp // 64) + gk) * nt * 128 + (kk // 8) * 128 + (r // 8) * 1024 + (r % 8) * 16 + (kk % 8) * 2
        assert flat[byte // 2] == x[tok, col]
    assert flat.numel() == 2 * nt * kp
    slabs = flat.reshape(2, kp // 64, nt // 8, 8, 8, 8)         # [chunk, gk, 8-token block, K part, token, h]
    assert (slabs[1, :, 0, :, 3:, :] == 0).all() and (slabs[1, :, 0, :, :3, :] != 0).any()   # tokens 11-15: zeros


def test_clusters_are_refused_where_they_cannot_run_in_one_line():
    """X multicast clusters (docs/kernels-notes.md "v22") take the warp-specialized kernel without a K split,
    on a GPU: any other request is one clear error, never a silent launch without them."""
    g = torch.Generator().manual_seed(3)
    w = _weight(64, 128, "2:4", g)
    lay, x = sp24.transcode(w).to(DEV), torch.randn(2, 128, generator=g).half().to(DEV)
    for tuning in (dict(kernel="rows", cluster=2), dict(kernel="auto", cluster=2), dict(kernel="ws", cluster=3),
                   dict(kernel="ws", cluster=2, splits=2)):
        with pytest.raises(ValueError, match="cluster"):
            sp24_matmul(x, lay, **tuning)
    if SIM:
        with pytest.raises(ValueError, match="simulator"):
            sp24_matmul(x, lay, kernel="ws", cluster=2)


@pytest.mark.warpgroup_sim
def test_ws_probe_builds_ablations_variants_and_only_inside_the_block():
    """The sp24_ws probe's builds (``sp24_ws_probe``, a diagnostic): without the step loop or without the products
    no product reaches the output (exact zeros); both release orders compute the product (a 2-stage ring, so
    every stage is refilled through its release); outside ``built_as`` the same launch is the default
    kernel again; an unknown name is one clear error."""
    from sparsekit.kernels.sp24_ws_probe import built_as

    g = torch.Generator().manual_seed(5)
    w = _weight(64, 320, "2:4", g)
    x = torch.randn(3, 320, generator=g).half()
    lay = sp24.transcode(w)
    kw = dict(groups=1, strips=1, stages=2)
    for mode in ("no_loop", "no_products"):
        with built_as(mode):
            y = sp24_matmul(x.to(DEV), lay.to(DEV), out=torch.full((3, 64), float("nan"), dtype=torch.float16,
                                                                    device=DEV), kernel="ws", **kw)
        assert torch.count_nonzero(y) == 0, mode   # written (no NaN left), and nothing multiplied
    for mode in ("early_release", "late_release"):   # (an 8-token tile: the default releases late)
        with built_as(mode):
            assert _rel_err(lay, w, x, kernel="ws", **kw) < 1e-3
    assert _rel_err(lay, w, x, kernel="ws", **kw) < 1e-3
    with pytest.raises(ValueError, match="unknown sp24_ws build"):
        with built_as("no_everything"):
            pass


@pytest.mark.warpgroup_sim
def test_ws_pipelined_build_computes_the_product():
    """sp24_ws's "pipelined" build (two tile rows a warpgroup taking turns, one product group kept running while
    the other row's operands load, a producer warpgroup handing its registers over): the product of the default,
    with a 2- and a 3-stage ring (every stage refilled through its release) and a last block of one tile row."""
    from sparsekit.kernels.sp24_ws_probe import built_as

    g = torch.Generator().manual_seed(7)
    w = _weight(192, 256, "2:4", g)
    x = torch.randn(3, 256, generator=g).half()
    lay = sp24.transcode(w)
    with built_as("pipelined"):
        for stages in (2, 3):
            assert _rel_err(lay, w, x, kernel="ws", groups=1, strips=2, stages=stages) < 1e-3
        assert _rel_err(lay, w, x, kernel="ws", groups=1, strips=1, stages=2) < 1e-3   # one row: the default build


@pytest.mark.warpgroup_sim
def test_ws_stamps_build_computes_the_product_and_stamps_every_step_in_order():
    """The time-stamped sp24_ws (``sp24_ws_probe.ws_stamps``, a diagnostic): the product as the shipped kernel
    computes it; per block and step the consumer's stamps in the order of its step (an 8-token tile releases
    late: begin, full, retired, loads, issued) and the producer's (free, then copies issued); the block's row."""
    from sparsekit.kernels.sp24_ws_probe import ws_stamps

    g = torch.Generator().manual_seed(6)
    w = _weight(64, 320, "2:4", g)
    x = torch.randn(3, 320, generator=g).half()
    lay = sp24.transcode(w)
    t0 = time.perf_counter_ns()
    y, st, plan = ws_stamps(x.to(DEV), lay.to(DEV), groups=1, strips=1, stages=2)
    wall = time.perf_counter_ns() - t0
    ref = x.double() @ w.double().T
    assert float((y.cpu().double() - ref).norm() / ref.norm()) < 1e-3
    assert plan["late"] and st.shape == (plan["blocks"], plan["steps"], 8) == (1, 5, 8)
    st = st.cpu()
    for order in ((0, 2, 1, 3, 4), (5, 6)):
        assert (st[:, :, list(order[1:])] >= st[:, :, list(order[:-1])]).all()
    assert (st[:, 1:, 0] >= st[:, :-1, 4]).all() and (st[:, :, 7] == 0).all()   # steps one after another
    # the block's start and end on the timer (its low 32 bits, which wrap every 4.3 s): the end after the start,
    # within the call's wall time (under the simulator a block takes ~1 s; on a GPU microseconds)
    assert wall < 2**32, "the call outlasted the timer's wrap: its start and end cannot be told apart"
    took = (plan["end_ns"] - plan["start_ns"]) & 0xFFFFFFFF
    assert ((took > 0) & (took <= wall)).all()


@pytest.mark.parametrize("m,k,kind", [
    (64, 64, "2:4"),          # one 2:4 tile
    (100, 136, "2:4"),        # M, K padding
    (128, 192, "hybrid"),     # a random mosaic of both kinds
    (100, 192, "halves"),     # tile column 0 dense, the others 2:4; M padding
    (64, 128, "dense"),       # no 2:4 tile: the 2:4 buffer is empty
])
def test_layout_decode_kernel_is_bit_exact(m, k, kind):
    """kernels/sp24_decode.py (the prefill path of a layer that keeps only its 2:4 layout) rebuilds exactly what
    ``packed.sp24.to_dense`` does, -0.0 kept, also from buffers padded past their last slot (fusion's padding)."""
    from sparsekit.kernels.sp24_decode import sp24_decode

    g = torch.Generator().manual_seed(m + k)
    w = _weight(m, k, kind, g)
    w = torch.where(w == 0, torch.zeros_like(w), w)
    w[m - 1, k - 1] = torch.where(w[m - 1, k - 1] != 0, 2.5, 0.0)   # the last real element (the mask kept)
    w[0, 1] = -0.0                                     # a -0.0: kept in a dense tile, +0.0 in a 2:4 one
    lay = sp24.transcode(w)
    want = sp24.to_dense(lay).view(torch.int16)
    got = sp24_decode(lay.to(DEV))
    assert got.shape == (m, k) and got.dtype == torch.float16
    assert torch.equal(got.cpu().view(torch.int16), want)
    pad = sp24.Sp24Layout(dense=torch.cat([lay.dense, torch.full((2048,), -1, dtype=torch.int32)]),
                          sp=torch.cat([lay.sp, torch.full((1152,), -1, dtype=torch.int32)]),
                          tiles=lay.tiles, shape=lay.shape)
    assert torch.equal(sp24_decode(pad.to(DEV)).cpu().view(torch.int16), want)
    swapped = _swapped_metadata(lay) if lay.sp.numel() else None     # a metadata bug must show
    if swapped is not None:
        assert not torch.equal(sp24_decode(swapped.to(DEV)).cpu().view(torch.int16), want)
