"""spmm_pf (issue 21 item 2, docs/kernels-notes.md "v29": TCA-BME prefill, each GroupTile decoded once per block into
a dense A tile in shared memory, the warpgroup MMA reading both operands from shared memory) against a float64
reference, under Numba's CUDA simulator when there is no GPU: rings that wrap, a block whose second tile row is
past the weight, M/K padding, token chunks, GroupTiles with no values, kept -0.0 values, and a planted
bitmap-order bug that must fail. Outputs are poisoned with NaN first."""
from __future__ import annotations

import pytest
import torch

from sparsekit.kernels.common import SIM
from sparsekit.kernels.spmm_pf import pf_plan, pf_stamps, smem_bytes, tcabme_pf_matmul
from sparsekit.packed.tcabme import TcaBme, encode

from tests.test_spmm_rows_sim import _weight

DEV = "cpu" if SIM else "cuda"
pytestmark = pytest.mark.warpgroup_sim   # conftest: the switch interval of the warpgroup kernels
if not SIM and not torch.cuda.is_available():  # pragma: no cover - conftest sets the simulator
    pytest.skip("neither the CUDA simulator nor a GPU", allow_module_level=True)


def _rel_err(p, w, x, **knobs):
    m, n = w.shape[0], x.shape[0]
    out = torch.full((n, m), float("nan"), dtype=torch.float16, device=DEV)   # poisoned
    y = tcabme_pf_matmul(x.to(DEV), p.to(DEV), out=out, **knobs)
    assert y is out
    assert not torch.isnan(y).any(), "some outputs were never written"
    ref = x.double() @ w.double().t()
    return ((y.cpu().double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("m,k,n,kind,zero_row,knobs", [
    (130, 128, 9, 0.5, True, dict(tokens=64, stages=2)),     # the second block's second tile row past M; a
                                                              # GroupTile row with no values
    (64, 64 * 4, 9, "strips", False, dict(tokens=64, stages=3)),   # zero, dense, 50% and 2:4 strips; 4 steps on a
                                                              # ring of 3
    (100, 100, 3, 0.3, False, dict(tokens=128, stages=2)),   # M and K padding, a wider tile
    (64, 64, 70, 0.5, False, dict(tokens=64, stages=2)),     # 2 token chunks (the second of 6 tokens)
])
def test_spmm_pf_matches_float64(m, k, n, kind, zero_row, knobs):
    w, g = _weight(m, k, kind, seed=m + n, negzeros=3 if kind == 0.5 else 0)
    if zero_row:
        w[64:128] = 0
    x = torch.randn(n, k, generator=g).half()
    assert _rel_err(encode(w), w, x, **knobs) < 1e-3


def test_spmm_pf_catches_a_planted_bitmap_order_bug():
    """BitmapTiles bottom-left and top-right swapped in every TCTile (a column-major order read row-major)."""
    w, g = _weight(64, 128, 0.5, seed=5)
    x = torch.randn(3, 128, generator=g).half()
    p = encode(w)
    bm = p.bitmaps.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(-1)
    bad = TcaBme(bitmaps=bm, values=p.values, gtile_offsets=p.gtile_offsets, strip_offsets=p.strip_offsets,
                 shape=p.shape)
    assert _rel_err(p, w, x, tokens=64, stages=2) < 1e-3
    assert _rel_err(bad, w, x, tokens=64, stages=2) > 0.1


def test_spmm_pf_plan_fits_shared_memory_and_refuses_what_does_not():
    for nt in (64, 128, 192, 256):
        t, st = pf_plan(nt, None, 4624)
        assert t == nt and 2 <= st <= 4 and smem_bytes(nt, st, 4624) <= 227 * 1024 - 2048
    assert pf_plan(256, None, 4624)[1] == 4 and pf_plan(256, None, 8208)[1] == 3   # denser tiles: a shallower ring
    with pytest.raises(ValueError, match="shared memory"):
        pf_plan(256, 6, 8208)
    with pytest.raises(ValueError, match="tokens a tile"):
        pf_plan(96, None, 4624)


def test_time_stamp_probe_gives_the_product_and_ordered_stamps():
    """The stamped build (a diagnostic) computes the same product; within each step the consumer's stamps follow
    its order (begin, "full", stored, issued, retired), the copy warp's too, and every role stamped every step."""
    w, g = _weight(64, 64 * 3, 0.5, seed=7)
    x = torch.randn(5, 64 * 3, generator=g).half()
    y, st, plan = pf_stamps(x.to(DEV), encode(w).to(DEV), tokens=64, stages=2)
    ref = x.double() @ w.double().t()
    assert ((y.cpu().double() - ref).norm() / ref.norm()).item() < 1e-3
    assert plan["blocks"] == 1 and plan["steps"] == 3 and st.shape == (1, 3, 8)
    st = st.cpu()
    for order in ([0, 2, 3, 4, 1], [5, 6]):
        assert (st[:, :, order].diff(dim=2) >= 0).all()
    assert (st[:, 1:, 0] > 0).all() and (st[:, :, 7] > 0).all() and (st[:, :, 6] > 0).all()
    assert ((plan["end_ns"] - plan["start_ns"]) & 0xFFFFFFFF > 0).all()
    with pytest.raises(ValueError, match="N > 0"):
        pf_stamps(x[:0].to(DEV), encode(w).to(DEV))
