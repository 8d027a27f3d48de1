"""Device helpers shared by the activation-sparse (CATS) gated-MLP kernels: warp sums and scans,
the thresholded SiLU of a gate value, and the value loads of the row-packed layout
(``sparsekit.packed.rowpack``). The kernels: ``cats_up.py`` and ``cats_down.py``; host side ``cats.py``.

Every warp exchange is made by all warps of a block the same number of times except in
``cats_up``'s ``up_rows``, whose scans run only for active rows: under the simulator (which emulates
exchanges block-wide) it is launched with one warp per block.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ._intrinsics import f2h, h2f, shfl_up, shfl_xor

ROWS_MAX_TOKENS = 2  # tokens the row-packed kernels take (their accumulators grow with N)


@cuda.jit(device=True, inline=True)
def warp_sum(scr, tid, v):
    """Sum of the float ``v`` over the warp (every lane gets it)."""
    v += shfl_xor(scr, tid, v, 16)
    v += shfl_xor(scr, tid, v, 8)
    v += shfl_xor(scr, tid, v, 4)
    v += shfl_xor(scr, tid, v, 2)
    v += shfl_xor(scr, tid, v, 1)
    return v


@cuda.jit(device=True, inline=True)
def scan_incl(scr, tid, v):
    """Inclusive warp prefix sum of the uint32 ``v``."""
    lane = tid & 31
    for d in (1, 2, 4, 8, 16):
        t = shfl_up(scr, tid, v, d)
        if lane >= d:
            v += t
    return v


@cuda.jit(device=True, inline=True)
def gate_act(g, lane, j, I, N, t):
    """Lane ``n < N``'s thresholded activation of neuron ``j`` (0 elsewhere), SiLU in fp32, rounded to fp16."""
    a = np.float32(0.0)
    if lane < N and j < I:
        gv = h2f(g[lane * I + j])
        av = h2f(f2h(gv / (np.float32(1.0) + math.exp(-gv))))
        if abs(av) >= t:
            a = av
    return a


@cuda.jit(device=True, inline=True)
def pair_prefix(scr, tid, mw):
    """This lane's exclusive warp prefix of the popcounts of the 4 mask bytes of ``mw``, as two
    uint32 words holding 16-bit fields (groups 0, 1 and groups 2, 3): two scans for four groups."""
    a = np.uint32(cuda.popc(mw & np.uint32(0xFF))) | (np.uint32(cuda.popc((mw >> np.uint32(8)) & np.uint32(0xFF))) << np.uint32(16))
    b = np.uint32(cuda.popc((mw >> np.uint32(16)) & np.uint32(0xFF))) | (np.uint32(cuda.popc(mw >> np.uint32(24))) << np.uint32(16))
    return scan_incl(scr, tid, a) - a, scan_incl(scr, tid, b) - b


@cuda.jit(device=True, inline=True)
def load_quad(vals, goff, gb, mw, ea, eb, vf):
    """This lane's values of 4 groups (first group ``gb`` of ``goff``) into ``vf[8 i + b]`` (zero where
    mask bit ``b`` of group ``i``, byte ``i`` of ``mw``, is clear); ``ea``, ``eb``: ``pair_prefix``."""
    for i in range(4):
        m = (mw >> np.uint32(8 * i)) & np.uint32(0xFF)
        e = ea if i < 2 else eb
        o = goff[gb + i] + np.int32((e >> np.uint32(16 * (i & 1))) & np.uint32(0xFFFF))
        for b in range(8):
            vf[8 * i + b] = np.float32(0.0)
            if (m >> np.uint32(b)) & np.uint32(1):
                vf[8 * i + b] = h2f(vals[o])
                o += 1
