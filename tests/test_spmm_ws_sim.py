"""spmm_ws (issue 21, docs/kernels-notes.md "v19": TCA-BME decoded once per tile into warpgroup A registers,
on sp24_ws's warp-specialized skeleton) against a float64 reference, under Numba's CUDA simulator when there
is no GPU: the producer warp's offset window (32 steps per load, and its reload), GroupTiles with no values
(no copy), two tile rows per block with the second past the weight, M/K padding, token chunks, split-K with
the last-block sum, kept -0.0 values, and a planted bitmap-order bug that must fail. Outputs are poisoned
with NaN first."""
from __future__ import annotations

import pytest
import torch

from sparsekit.kernels.common import SIM
from sparsekit.kernels.spmm_ws import SMEM_RESERVED, max_registers, tcabme_ws_matmul, ws_plan
from sparsekit.packed.tcabme import TcaBme, encode

from tests.test_spmm_rows_sim import _weight

DEV = "cpu" if SIM else "cuda"
if not SIM and not torch.cuda.is_available():  # pragma: no cover - conftest sets the simulator
    pytest.skip("neither the CUDA simulator nor a GPU", allow_module_level=True)


def _rel_err(p, w, x, **knobs):
    m, n = w.shape[0], x.shape[0]
    out = torch.full((n, m), float("nan"), dtype=torch.float16, device=DEV)   # poisoned
    y = tcabme_ws_matmul(x.to(DEV), p.to(DEV), out=out, **knobs)
    assert y is out
    assert not torch.isnan(y).any(), "some outputs were never written"
    ref = x.double() @ w.double().t()
    return ((y.cpu().double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("m,k,n,kind,knobs", [
    (64, 128, 1, 0.5, dict(groups=1)),                         # one warpgroup, 8 tokens, 2 steps
    (130, 100, 9, 0.3, dict(groups=2, tokens=8, stages=2)),    # M/K padding; the last block's 2nd row past M;
                                                               # a 2-stage ring; 2 token chunks
    (64, 64 * 9, 1, "strips", dict(groups=1, stages=3, window=4)),  # 9 steps, offsets loaded 4 steps at a time
                                                               # (two reloads); zero, dense, 50%, 2:4 strips
    (64, 192, 9, 0.5, dict(groups=1, splits=2, tokens=8)),     # split-K (2 + 1 columns) + fixup; 2 chunks
])
def test_spmm_ws_matches_float64(m, k, n, kind, knobs):
    w, g = _weight(m, k, kind, seed=m + n, negzeros=3 if kind == 0.5 else 0)
    x = torch.randn(n, k, generator=g).half()
    p = encode(w)
    for _ in range(2 if knobs.get("splits") else 1):           # a split-K counter left set fails the second
        assert _rel_err(p, w, x, **knobs) < 1e-3


def test_spmm_ws_copies_nothing_for_an_all_zero_tile():
    w, g = _weight(64, 128, 0.5, seed=3)
    w[:, 64:] = 0
    x = torch.randn(2, 128, generator=g).half()
    p = encode(w)
    assert int(p.gtile_offsets[2] - p.gtile_offsets[1]) == 0
    assert _rel_err(p, w, x, groups=1) < 1e-3
    p0 = encode(torch.zeros(64, 64, dtype=torch.float16))      # no values at all
    out = tcabme_ws_matmul(x[:, :64].to(DEV), p0.to(DEV), groups=1)
    assert (out == 0).all()


def test_spmm_ws_catches_a_planted_bitmap_order_bug():
    """BitmapTiles bottom-left and top-right swapped in every TCTile (a column-major order read row-major)."""
    w, g = _weight(64, 128, 0.5, seed=5)
    x = torch.randn(3, 128, generator=g).half()
    p = encode(w)
    bm = p.bitmaps.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(-1)
    bad = TcaBme(bitmaps=bm, values=p.values, gtile_offsets=p.gtile_offsets, strip_offsets=p.strip_offsets,
                 shape=p.shape)
    assert _rel_err(p, w, x, groups=1) < 1e-3
    assert _rel_err(bad, w, x, groups=1) > 0.1


def test_spmm_ws_plan_fits():
    sm = 228 * 1024
    for m, gk, n in [(22016, 64, 1), (22016, 64, 64), (4096, 172, 32), (8192, 448, 128), (100, 2, 5)]:
        p, r, wg = ws_plan(m, gk, n, vbytes=4624)
        assert r == 1 and p.r == wg == 1 and p.nt >= min(n, 128) and 2 <= p.stages <= 4
        assert p.blocks == p.tiles * p.ks and p.per * p.ks >= gk > p.per * (p.ks - 1)
        fit = 65536 // (-(-max_registers(p.nt, 1) * 32 // 256) * 256 * 6)
        assert fit * (p.dyn + SMEM_RESERVED) <= sm                # the ring leaves room for every resident block
        assert p.ks == 1 or p.blocks <= fit * 132                 # a K split only fills the block slots
    assert ws_plan(22016, 64, 64)[0].ks == 1                      # tall: one block per tile row
    assert ws_plan(4096, 172, 32)[0].ks > 1                       # few tile rows: K split toward the SMs
    small, dense = ws_plan(4096, 172, 32, vbytes=4624)[0], ws_plan(4096, 172, 32)[0]
    assert small.dyn // small.stages < dense.dyn // dense.stages and small.stages > dense.stages  # room per weight
    with pytest.raises(ValueError, match="shared memory"):
        ws_plan(22016, 64, 128, tokens=128, stages=8, groups=2)


def test_default_plan_takes_spmm_ws_where_it_won():
    """The H100 sweep of session 15: spmm_ws beat spmm_warp from 32 tokens on the largest weights (22016x4096,
    8192x28672, 28672x8192) and from 64 on 4096x11008 and 12288x4096; spmm_warp kept 4096x4096 and every
    shape to 16 tokens."""
    from sparsekit.kernels.matmul import ws_wanted

    for m, k in [(22016, 4096), (8192, 28672), (28672, 8192)]:
        assert not ws_wanted(m, k, 16) and ws_wanted(m, k, 32) and ws_wanted(m, k, 128)
    for m, k in [(4096, 11008), (12288, 4096)]:
        assert not ws_wanted(m, k, 32) and ws_wanted(m, k, 64)
    assert not any(ws_wanted(4096, 4096, n) for n in (1, 16, 32, 64, 128))


def test_spmm_ws_is_self_tested_before_first_use_and_a_failure_is_said(monkeypatch):
    import warnings

    from sparsekit.errors import SparsekitWarning
    from sparsekit.kernels import matmul

    monkeypatch.delenv("SPARSEKIT_STRICT", raising=False)
    matmul.reset_kernel_choice()
    matmul.ws_self_test(torch.device(DEV))                    # the real check passes (simulator or GPU)
    monkeypatch.setattr(matmul, "ws_self_test", lambda device: (_ for _ in ()).throw(RuntimeError("off by 0.5")))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert matmul.ws_checked(torch.device(DEV)) is False
        assert matmul.ws_checked(torch.device(DEV)) is False  # checked once
    matmul.reset_kernel_choice()
    said = [str(w.message) for w in seen if issubclass(w.category, SparsekitWarning)]
    assert len(said) == 1 and "spmm_ws" in said[0] and "off by 0.5" in said[0]
