"""The Hopper tile kernels' accumulator store (``sp24_wg.make_tile_ops``'s ``acc_store``, shared by sp24_wg, sp24_ws,
spmm_pf and spmm_ws, and generated with constant indices by ``block.unrolled``) against the PTX ISA's layout of a
warpgroup MMA's fp32 accumulators (m64nN: value i of lane 4g + t of warp w is row 16w + g + 8 (i % 4 >= 2), column
8 (i // 4) + 2t + i % 2): every value of every warp lands once, at its row and token of the block's token-major tile
(tokens ``block.tile_ld`` words apart), and no store of a warp puts two lanes in one shared-memory bank."""
from __future__ import annotations

import numpy as np
import pytest

from sparsekit.kernels.common import SIM

if not SIM:  # pragma: no cover - conftest sets the simulator
    pytest.skip("acc_store is called as plain Python under the simulator only", allow_module_level=True)

from sparsekit.kernels.block import tile_ld  # noqa: E402
from sparsekit.kernels.sp24_wg import acc_offsets, make_tile_ops  # noqa: E402


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
            vals.append(np.float32(tok * tile_ld(rows) + row))
        out.append(tuple(vals))
    return out


@pytest.mark.parametrize("nt,r,wg", [(8, 1, 1), (64, 2, 2), (128, 2, 1), (256, 1, 2)])
def test_acc_store_puts_every_accumulator_at_its_row_and_token(nt, r, wg):
    acc_store = make_tile_ops(nt, r, wg)[4]
    rows, ld = 64 * r * wg, tile_ld(64 * r * wg)
    df = np.full(nt * ld, -1.0, np.float32)
    for w in range(wg):
        for ww in range(4):
            for lane in range(32):
                accs = _fragments(nt, r, wg, w, ww, lane)
                acc_store(df, accs[0], accs[-1], w, ww, lane >> 2, lane & 3)
    want = np.full((nt, ld), -1.0, np.float32)        # the padding after each token's row is left alone
    want[:, :rows] = np.arange(nt * ld, dtype=np.float32).reshape(nt, ld)[:, :rows]
    assert np.array_equal(df, want.reshape(-1))


@pytest.mark.parametrize("rows", [64, 128, 256])
def test_each_store_of_a_warp_hits_32_banks(rows):
    """Lane 4g + t stores at ``2 t ld + g + offset`` (``acc_store``'s first line): at the padded stride the 32 lanes
    of every store fall in 32 different 4-byte banks; at the bare stride (a multiple of 32) four lanes share each."""
    def banks(ld, off):
        return {(2 * t * ld + g + off) % 32 for g in range(8) for t in range(4)}

    for off, _ in acc_offsets(256, tile_ld(rows)):
        assert len(banks(tile_ld(rows), off)) == 32
    assert len(banks(rows, acc_offsets(256, rows)[0][0])) == 8
