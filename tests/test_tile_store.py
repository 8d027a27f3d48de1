"""The Hopper tile kernels' accumulator store (``sp24_wg.make_tile_ops``'s ``acc_store``, shared by sp24_wg, sp24_ws,
spmm_pf and spmm_ws, and generated with constant indices by ``block.unrolled``) against the PTX ISA's layout of a
warpgroup MMA's fp32 accumulators (m64nN: value i of lane 4g + t of warp w is row 16w + g + 8 (i % 4 >= 2), column
8 (i // 4) + 2t + i % 2): every value of every warp lands once, at its row and token of the block's token-major tile."""
from __future__ import annotations

import numpy as np
import pytest

from sparsekit.kernels.common import SIM

if not SIM:  # pragma: no cover - conftest sets the simulator
    pytest.skip("acc_store is called as plain Python under the simulator only", allow_module_level=True)

from sparsekit.kernels.sp24_wg import make_tile_ops  # noqa: E402


def _fragments(nt: int, r: int, wg: int, w: int, ww: int, lane: int) -> list[tuple]:
    """Warp ``ww`` of warpgroup ``w``: each of its ``r`` tile rows' accumulators, value = where it belongs in the
    block's ``[nt, 64 r wg]`` tile (token-major)."""
    rows = 64 * r * wg
    g, t = lane >> 2, lane & 3
    out = []
    for tr in range(r):
        vals = []
        for i in range(nt // 2):
            row = (w * r + tr) * 64 + 16 * ww + g + 8 * ((i % 4) >> 1)
            tok = 8 * (i // 4) + 2 * t + (i % 2)
            vals.append(np.float32(tok * rows + row))
        out.append(tuple(vals))
    return out


@pytest.mark.parametrize("nt,r,wg", [(8, 1, 1), (64, 2, 2), (128, 2, 1), (256, 1, 2)])
def test_acc_store_puts_every_accumulator_at_its_row_and_token(nt, r, wg):
    acc_store = make_tile_ops(nt, r, wg)[4]
    df = np.full(nt * 64 * r * wg, -1.0, np.float32)
    for w in range(wg):
        for ww in range(4):
            for lane in range(32):
                accs = _fragments(nt, r, wg, w, ww, lane)
                acc_store(df, accs[0], accs[-1], w, ww, lane >> 2, lane & 3)
    assert np.array_equal(df, np.arange(df.size, dtype=np.float32))
