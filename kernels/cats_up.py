"""The ``up`` kernel of the CATS gated MLP (helpers in ``cats_kernels.py``, host side ``cats.py``).

After ``g = gate(x)`` (any linear), one warp per intermediate neuron ``j``: lanes ``n < N`` compute
token ``n``'s ``a = act(g[n, j])`` in fp32, round it to fp16 (as torch does) and zero it when
``|a| < t``; if no token keeps neuron ``j`` the warp writes zeros and reads nothing more, else it
computes ``u = up[j, :] . x[n, :]`` for every token (fp32) and writes ``h[n, j] = a * u`` (fp16).
Up's row ``j`` is read only for active neurons: dense rows (``up_dense``: lanes stride over 8-byte
words, several in flight) or row-packed ones (``up_rows``, ``sparsekit.packed.rowpack``: lane ``l``
takes segment ``l`` of each 256-column group; one 4-byte mask load and two packed scans give its
value offsets in 4 groups).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from . import kcache
from ._intrinsics import SCRATCH_WORDS, f2h, h2f
from .cats_kernels import gate_act, load_quad, pair_prefix, warp_sum

UP_ROWS = 1       # neurons per warp in up_dense (x converted once for all of them)
UP_UNROLL = 8     # 8-byte words per lane and neuron in flight in up_dense


@functools.lru_cache(maxsize=None)
def get_up(nt: int, rows: bool, r: int = 0, u: int = 0):
    """The ``up`` kernel for up to ``nt`` tokens; ``rows``: row-packed weight, else dense (``r``
    neurons per warp, ``u`` words per lane and neuron in flight; 0: the defaults)."""
    NT = nt
    R = r or UP_ROWS
    U = u or UP_UNROLL
    RNT = R * NT
    RU = R * U
    U4 = 4 * U

    @cuda.jit(device=True, inline=True)
    def finish(scr, tid, acc, base, a, h, j, I, N):
        lane = tid & 31
        for n in range(NT):
            acc[base + n] = warp_sum(scr, tid, acc[base + n])
        if lane < N and j < I:
            s = np.float32(0.0)
            for n in range(NT):
                if n == lane:
                    s = acc[base + n]
            h[lane * I + j] = np.int16(f2h(a * h2f(f2h(s))))

    @cuda.jit
    def up_dense(g, x, w, thr, h, I, H4, N):
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        tid = cuda.threadIdx.x
        lane = tid & 31
        j0 = (cuda.blockIdx.x * (cuda.blockDim.x >> 5) + (tid >> 5)) * R
        t = h2f(f2h(thr[0]))
        a = cuda.local.array(R, np.float32)
        on = cuda.local.array(R, np.int32)
        acc = cuda.local.array(RNT, np.float32)
        anyon = 0
        for r in range(R):
            a[r] = gate_act(g, lane, j0 + r, I, N, t)
            on[r] = 1 if warp_sum(scr, tid, np.float32(1.0) if a[r] != 0 else np.float32(0.0)) > 0 else 0
            anyon |= on[r]
        for i in range(RNT):
            acc[i] = np.float32(0.0)
        wv = cuda.local.array(RU, np.int64)
        xf = cuda.local.array(U4, np.float32)
        k = lane if anyon else H4
        while k < H4:
            for r in range(R):       # R*U independent loads in flight; inactive rows load nothing
                for u in range(U):
                    wv[r * U + u] = 0
                    if on[r] and k + 32 * u < H4:
                        wv[r * U + u] = w[(j0 + r) * H4 + k + 32 * u]
            for n in range(NT):
                if n < N:
                    for u in range(U):
                        xw = x[n * H4 + k + 32 * u] if k + 32 * u < H4 else np.int64(0)
                        for q in range(4):
                            xf[4 * u + q] = h2f((xw >> (16 * q)) & 0xFFFF)
                    for r in range(R):
                        if on[r]:
                            sacc = np.float32(0.0)
                            for u in range(U):
                                ww = wv[r * U + u]
                                for q in range(4):
                                    sacc += h2f((ww >> (16 * q)) & 0xFFFF) * xf[4 * u + q]
                            acc[r * NT + n] += sacc
            k += 32 * U
        for r in range(R):
            finish(scr, tid, acc, r * NT, a[r], h, j0 + r, I, N)

    @cuda.jit
    def up_rows(g, x, masks, vals, goff, thr, h, I, H4, N, G):
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        tid = cuda.threadIdx.x
        lane = tid & 31
        j = cuda.blockIdx.x * (cuda.blockDim.x >> 5) + (tid >> 5)
        a = gate_act(g, lane, j, I, N, h2f(f2h(thr[0])))
        on = warp_sum(scr, tid, np.float32(1.0) if a != 0 else np.float32(0.0))
        acc = cuda.local.array(NT, np.float32)
        for n in range(NT):
            acc[n] = np.float32(0.0)
        vf = cuda.local.array(32, np.float32)
        GQ = G >> 2
        nq = GQ if on > 0 else 0
        for qd in range(nq):         # 4 groups at a time: one mask load, two scans, 32 loads in flight
            mw = np.uint32(masks[(j * GQ + qd) * 32 + lane])
            ea, eb = pair_prefix(scr, tid, mw)
            load_quad(vals, goff, (j * GQ + qd) * 4, mw, ea, eb, vf)
            for n in range(NT):
                if n < N:
                    sacc = np.float32(0.0)
                    for i in range(4):
                        if (mw >> np.uint32(8 * i)) & np.uint32(0xFF):
                            xw = n * H4 + (((qd * 4 + i) * 256 + lane * 8) >> 2)
                            xa = x[xw]
                            xb = x[xw + 1]
                            for b in range(4):
                                sacc += vf[8 * i + b] * h2f((xa >> (16 * b)) & 0xFFFF)
                                sacc += vf[8 * i + 4 + b] * h2f((xb >> (16 * b)) & 0xFFFF)
                    acc[n] += sacc
        finish(scr, tid, acc, 0, a, h, j, I, N)

    return kcache.tag(up_rows if rows else up_dense, "cats_up", (nt, rows, r, u))
