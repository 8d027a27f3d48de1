"""The 2:4 tile-mosaic kernel and its mma.sp twin against float64 references, under Numba's CUDA
simulator (or on a GPU when there is one).

What the simulator covers: the twin of ``mma.sp`` m16n8k32 (selector 0) with the fragment and metadata
layouts of docs/kernels-notes.md "v13-sp", the ``ldmatrix.x4`` exchange, and the whole kernel source
(tile kinds, strip addressing, the X slot, the metadata shuffle, split-K over warps, token chunks,
padding). Not covered: the PTX itself (scripts/gpu_check_sp24.py runs these on the device). Sizes are
tiny: the simulator runs every thread in Python.
"""
from __future__ import annotations

import pytest
import torch

from sparsekit.kernels.common import SIM
from sparsekit.kernels.sp24 import sp24_matmul
from sparsekit.kernels.sp24_probe import mma_sp_once
from sparsekit.packed import sp24
from sparsekit.pruning.patterns import hybrid_mask, nm_mask

DEV = "cpu" if SIM else "cuda"
if not SIM and not torch.cuda.is_available():  # pragma: no cover - conftest sets the simulator
    pytest.skip("neither the CUDA simulator nor a GPU", allow_module_level=True)


def _pack(lo: float, hi: float) -> int:
    b = torch.tensor([lo, hi], dtype=torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    return int(b[0] | (b[1] << 16))


def _i32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


def _operands(seed: int):
    """Random 2:4 A [16, 32], B [32, 8], C [16, 8] and every lane's registers as the notes give them."""
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(16, 32, dtype=torch.float16)
    comp = torch.randn(16, 16, generator=g).half()
    idx = torch.zeros(16, 8, 2, dtype=torch.int64)
    for r in range(16):
        for j in range(8):
            i0, i1 = sorted(torch.randperm(4, generator=g)[:2].tolist())
            idx[r, j] = torch.tensor([i0, i1])
            a[r, 4 * j + i0], a[r, 4 * j + i1] = comp[r, 2 * j], comp[r, 2 * j + 1]
    b = torch.randn(32, 8, generator=g).half()
    c = torch.randn(16, 8, generator=g)
    ar, br, cr, meta = [], [], [], []
    for lane in range(32):
        gg, t = lane >> 2, lane & 3
        ar.append([_pack(comp[gg + 8 * (i & 1), 2 * t + 8 * (i >> 1)], comp[gg + 8 * (i & 1), 2 * t + 8 * (i >> 1) + 1])
                   for i in range(4)])
        br.append([_pack(b[2 * (t + 4 * i), gg], b[2 * (t + 4 * i) + 1, gg]) for i in range(4)])
        cr.append([c[gg, 2 * t], c[gg, 2 * t + 1], c[gg + 8, 2 * t], c[gg + 8, 2 * t + 1]])
        word = 0
        if t < 2:
            for rh in range(2):
                for jj in range(4):
                    i0, i1 = idx[gg + 8 * rh, 4 * t + jj].tolist()
                    word |= (i0 | i1 << 2) << (16 * rh + 4 * jj)
        else:
            word = int(torch.randint(0, 1 << 32, (1,), generator=g))   # selector 0: never read
        meta.append(word)
    regs = (torch.tensor([[_i32(v) for v in r] for r in ar], dtype=torch.int32),
            torch.tensor([[_i32(v) for v in r] for r in br], dtype=torch.int32),
            torch.tensor([_i32(v) for v in meta], dtype=torch.int32), torch.tensor(cr))
    return a, b, c, regs


def _lanes(d: torch.Tensor) -> torch.Tensor:
    """The C/D fragment of a [16, 8] matrix, [32 lanes, 4]."""
    return torch.stack([torch.stack([d[ln >> 2, 2 * (ln & 3)], d[ln >> 2, 2 * (ln & 3) + 1],
                                     d[(ln >> 2) + 8, 2 * (ln & 3)], d[(ln >> 2) + 8, 2 * (ln & 3) + 1]])
                        for ln in range(32)])


def _swap_halves(words: torch.Tensor) -> torch.Tensor:
    v = words.to(torch.int64) & 0xFFFFFFFF
    v = (v >> 16) | ((v & 0xFFFF) << 16)
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)


@pytest.mark.parametrize("seed", [0, 1])
def test_mma_sp_twin_matches_float64(seed):
    a, b, c, (ar, br, meta, cr) = _operands(seed)
    d = mma_sp_once(ar.to(DEV), br.to(DEV), meta.to(DEV), cr.to(DEV)).cpu().double()
    ref = _lanes(a.double() @ b.double() + c.double())
    assert (d - ref).abs().max() < 1e-5 * ref.abs().max()


def test_mma_sp_twin_catches_swapped_row_halves():
    a, b, c, (ar, br, meta, cr) = _operands(2)
    d = mma_sp_once(ar.to(DEV), br.to(DEV), _swap_halves(meta).to(DEV), cr.to(DEV)).cpu().double()
    ref = _lanes(a.double() @ b.double() + c.double())
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
])
def test_kernel_matches_float64(m, k, n, kind, tuning):
    g = torch.Generator().manual_seed(m * 7 + n)
    w = _weight(m, k, kind, g)
    x = torch.randn(n, k, generator=g).half()
    lay = sp24.transcode(w)
    if kind in ("hybrid", "halves"):
        assert 0 < int(lay.kinds.sum()) < lay.kinds.numel()
    assert _rel_err(lay, w, x, **tuning) < 1e-3       # fp16 output rounding is ~2e-4


def test_kernel_catches_a_planted_metadata_bug():
    """The same layout with each metadata word's row halves swapped must fail the check above."""
    g = torch.Generator().manual_seed(11)
    w = _weight(64, 64, "2:4", g)
    x = torch.randn(2, 64, generator=g).half()
    lay = sp24.transcode(w)
    sp = lay.sp.clone().reshape(-1, sp24.SP_STRIP_WORDS)
    sp[:, sp24.SP_VALUE_WORDS:] = _swap_halves(sp[:, sp24.SP_VALUE_WORDS:])
    bad = sp24.Sp24Layout(dense=lay.dense, sp=sp.reshape(-1), tiles=lay.tiles, shape=lay.shape)
    assert _rel_err(lay, w, x) < 1e-3
    assert _rel_err(bad, w, x) > 0.1
