"""The end of a K split (``kernels/block.make_split_sum``): the last block of an output tile sums its blocks' fp32
partials in order of q and writes fp16. Run per thread as plain Python under the simulator, against the sum in q
order in float32 (bit for bit: the generated rounds must keep that order) and the output's bounds (rows past M,
tokens past N and units past the tile untouched).
"""
from __future__ import annotations

import numpy as np
import pytest

from sparsekit.kernels.common import SIM

if not SIM:  # pragma: no cover - conftest sets the simulator
    pytest.skip("runs the device function as Python under the simulator", allow_module_level=True)

from sparsekit.kernels.block import make_split_sum  # noqa: E402

POISON = np.int16(0x7E00)   # an fp16 NaN


def _run(tile_rows, nt, threads, ks, m_out, n_out, m0=0, n0=0, most=32, seed=0):
    rng = np.random.default_rng(seed)
    tile = nt * tile_rows
    ws = np.full(2 * (ks + 2) * tile, np.nan, dtype=np.float32)
    q0 = 1                                            # the tile's blocks 1 .. ks (slot 0 and the last spare)
    parts = rng.standard_normal((ks, tile)).astype(np.float32) * np.float32(3.0)
    for i in range(ks):
        ws[2 * (q0 + i) * tile: 2 * (q0 + i) * tile + tile] = parts[i]
    y = np.full(m_out * n_out, POISON, dtype=np.int16)
    split_sum = make_split_sum(tile, tile_rows, threads, most)
    for tid in range(threads):
        split_sum(ws, y, tid, m_out, n_out, m0, n0, q0, q0 + ks - 1)
    want = np.zeros(tile, dtype=np.float32)
    for i in range(ks):                               # the order the kernels always summed in
        want += parts[i]
    want = want.astype(np.float16).reshape(nt, tile_rows)
    got = y.view(np.float16).reshape(n_out, m_out)
    rows, toks = min(tile_rows, m_out - m0), min(nt, n_out - n0)
    inside = got[n0:n0 + toks, m0:m0 + rows]
    assert np.array_equal(inside.view(np.int16), want[:toks, :rows].view(np.int16))
    outside = np.ones(got.shape, dtype=bool)
    outside[n0:n0 + toks, m0:m0 + rows] = False
    assert (got.view(np.int16)[outside] == POISON).all()


@pytest.mark.parametrize("ks", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("tile_rows,nt,threads", [
    (64, 8, 128),      # one unit a thread, four partials a round (sp24_rows at a few tokens)
    (64, 64, 160),     # seven units a thread: eight at once with the last clamped, one partial a round (sp24_ws)
    (128, 16, 96),     # six units, one partial a round, the last group partial
    (256, 128, 288),   # many units: several groups a thread
])
def test_split_sum_is_the_ordered_fp32_sum(tile_rows, nt, threads, ks):
    _run(tile_rows, nt, threads, ks, m_out=tile_rows, n_out=nt)


def test_split_sum_keeps_to_the_outputs_bounds():
    """A tile at row 64 and token 8 of an output with 100 rows (the tile's last 28 rows past M) and 13 tokens."""
    _run(64, 16, 128, 3, m_out=100, n_out=13, m0=64, n0=8)
    _run(64, 16, 128, 5, m_out=128, n_out=24, m0=64, n0=8, most=8)   # one unit, two partials a round
