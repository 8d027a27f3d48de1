"""The ``down`` kernel of the CATS gated MLP (helpers in ``cats_kernels.py``, host side ``cats.py``).

``y = h @ down^T``, split over the neurons: block ``(c, s)`` owns a slice of output columns and the
neurons of chunk ``s``. It stages ``h[:, chunk]`` in shared memory, compacts the chunk's active
neurons (nonzero for some token) into a list with a warp scan, and its warps split that list:
for each active ``j`` only, row ``j`` of ``down^T`` times ``h[:, j]``. Dense rows (``down_dense``:
``down^T`` tiled as [column block, neuron, 128 v columns], so a block streams one contiguous tile
and a neuron's bytes in each tile are skipped together; v 8-byte words per lane) or row-packed ones
(``down_rows``: a block owns 4 groups of 256 columns, 8 columns per lane in each). The warps sum in
shared memory; the chunks' fp32 partials are summed by the last block of each column slice to
arrive (an arrival counter it resets), so one launch writes ``y``.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from . import kcache
from ._intrinsics import SCRATCH_WORDS, SIM, f2h, h2f, shfl_idx
from .cats_kernels import load_quad, pair_prefix, scan_incl

DOWN_WARPS_MAX = 8  # warps per dense down block at most (shared partials)
DOWN_UNROLL = 8     # neurons per warp in flight in down_dense
ROWS_WARPS = 4      # warps per row-packed down block


def jmax(nt: int) -> int:
    """Neurons per down chunk at most (its shared-memory list and staged activations); 64 under the
    simulator, whose every shared-memory pass runs in Python."""
    if SIM:
        return 64
    return 1024 if nt <= 2 else 512 if nt <= 4 else 256


@functools.lru_cache(maxsize=None)
def get_down(nt: int, rows: bool, unroll: int = 0, regs: int = 0, v: int = 1):
    """The ``down`` kernel for up to ``nt`` tokens; ``rows``: row-packed ``down^T``, else dense with
    ``v`` 8-byte words per lane and neuron (tiles of ``128 v`` columns); ``unroll``: neurons per
    warp in flight, ``regs``: a register cap (0: the defaults)."""
    NT = nt
    V = v
    TWW = 32 * V
    DU = unroll or max(1, DOWN_UNROLL // V)
    DUV = DU * V
    JMAX = jmax(nt)
    HS = JMAX * NT
    ROWS = rows
    NACC = NT * (32 if rows else 4 * V)
    PER = NACC // NT     # output columns per lane and token
    RED = (ROWS_WARPS if rows else DOWN_WARPS_MAX) * NACC * 32

    @cuda.jit(device=True, inline=True)
    def stage(scr, tid, h, hs, lst, I, N, j0, JC):
        """h[:, j0:j0+JC] into ``hs`` (fp32), the active neurons' chunk indices into ``lst``; their count."""
        lane = tid & 31
        for e in range(tid, HS, cuda.blockDim.x):
            jj = e // NT
            n = e - jj * NT
            v = np.float32(0.0)
            if n < N and jj < JC and j0 + jj < I:
                v = h2f(h[n * I + j0 + jj])
            hs[e] = v
        cuda.syncthreads()
        count = np.uint32(0)
        for c0 in range(0, JMAX, 32):
            jj = c0 + lane
            f = np.uint32(0)
            for n in range(NT):
                if hs[jj * NT + n] != 0:
                    f = np.uint32(1)
            v = scan_incl(scr, tid, f)
            if f != 0 and tid < 32:
                lst[count + v - 1] = jj
            count += shfl_idx(scr, tid, v, 31)
        cuda.syncthreads()
        return count

    @cuda.jit(device=True, inline=True)
    def colof(c0, lane, q):
        """Output column of a lane's accumulator ``q`` (per token): dense, 4 consecutive columns per
        lane; row-packed, 8 columns per lane in each of the block's 4 groups of 256."""
        if ROWS:
            return c0 + (q >> 3) * 256 + lane * 8 + (q & 7)
        return c0 + ((q >> 2) * 32 + lane) * 4 + (q & 3)

    @cuda.jit(device=True, inline=True)
    def chunk_sum(ws, base, stride, S):
        """sum over sp < S of ws[base + sp * stride], 8 loads in flight."""
        v0 = np.float32(0.0)
        v1 = np.float32(0.0)
        v2 = np.float32(0.0)
        v3 = np.float32(0.0)
        sp = 0
        while sp + 7 < S:
            a = base + sp * stride
            v0 += ws[a] + ws[a + 4 * stride]
            v1 += ws[a + stride] + ws[a + 5 * stride]
            v2 += ws[a + 2 * stride] + ws[a + 6 * stride]
            v3 += ws[a + 3 * stride] + ws[a + 7 * stride]
            sp += 8
        while sp < S:
            v0 += ws[base + sp * stride]
            sp += 1
        return (v0 + v1) + (v2 + v3)

    @cuda.jit(device=True, inline=True)
    def block_out(acc, red, y, ws, cnt, flag, tid, cb, s, S, N, H, c0, ncols):
        """Sum the block's warps' partials (``acc``: NACC per lane, PER per token, at columns
        ``colof``), then write them to ``y`` (one chunk) or as this chunk's fp32 partials, the last
        block of the column slice summing all chunks into ``y``."""
        lane = tid & 31
        wpb = cuda.blockDim.x >> 5
        for q in range(NACC):
            red[((tid >> 5) * NACC + q) * 32 + lane] = acc[q]
        cuda.syncthreads()
        for e in range(tid, NACC * 32, cuda.blockDim.x):
            q = e >> 5
            n = q // PER
            col = colof(c0, e & 31, q - n * PER)
            v = np.float32(0.0)
            for wi in range(wpb):
                v += red[(wi * NACC + q) * 32 + (e & 31)]
            if n < N and col < ncols:
                if S == 1:
                    y[n * H + col] = np.int16(f2h(v))
                else:
                    ws[(s * NT + n) * H + col] = v
        if S > 1:
            cuda.threadfence()
            cuda.syncthreads()
            if tid == 0:
                old = cuda.atomic.add(cnt, cb, 1)
                flag[0] = 1 if old == S - 1 else 0
            cuda.syncthreads()
            if flag[0] == 1:
                cuda.threadfence()
                for e in range(tid, NACC * 32, cuda.blockDim.x):
                    q = e >> 5
                    n = q // PER
                    col = colof(c0, e & 31, q - n * PER)
                    if n < N and col < ncols:
                        y[n * H + col] = np.int16(f2h(chunk_sum(ws, n * H + col, NT * H, S)))
                if tid == 0:
                    cnt[cb] = 0

    @cuda.jit(**({} if SIM or not regs else {"max_registers": regs}))
    def down_dense(h, w, y, ws, cnt, I, H4, N, JC, S, CB):
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        hs = cuda.shared.array(HS, np.float32)
        lst = cuda.shared.array(JMAX, np.int32)
        red = cuda.shared.array(RED, np.float32)
        flag = cuda.shared.array(1, np.int32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        wpb = cuda.blockDim.x >> 5
        cb = cuda.blockIdx.x % CB
        s = cuda.blockIdx.x // CB
        j0 = s * JC
        count = stage(scr, tid, h, hs, lst, I, N, j0, JC)
        tile = cb * I * TWW + lane  # down^T tiled: [column block, neuron, TWW words]; lane: words lane + 32 v
        acc = cuda.local.array(NACC, np.float32)
        for i in range(NACC):
            acc[i] = np.float32(0.0)
        jv = cuda.local.array(DU, np.int32)
        wv = cuda.local.array(DUV, np.int64)
        i = warp                    # the warps split the active neurons, DU at a time each
        while i + (DU - 1) * wpb < count:
            for u in range(DU):
                jv[u] = lst[i + u * wpb]
            for u in range(DU):
                for v in range(V):
                    wv[u * V + v] = w[tile + (j0 + jv[u]) * TWW + 32 * v]
            for u in range(DU):
                for v in range(V):
                    for q in range(4):
                        f = h2f((wv[u * V + v] >> (16 * q)) & 0xFFFF)
                        for n in range(NT):
                            acc[n * PER + 4 * v + q] += hs[jv[u] * NT + n] * f
            i += DU * wpb
        while i < count:
            ja = lst[i]
            for v in range(V):
                wa = w[tile + (j0 + ja) * TWW + 32 * v]
                for q in range(4):
                    fa = h2f((wa >> (16 * q)) & 0xFFFF)
                    for n in range(NT):
                        acc[n * PER + 4 * v + q] += hs[ja * NT + n] * fa
            i += wpb
        block_out(acc, red, y, ws, cnt, flag, tid, cb, s, S, N, H4 * 4, cb * 128 * V, H4 * 4)

    @cuda.jit(**({} if SIM or not regs else {"max_registers": regs}))
    def down_rows(h, masks, vals, goff, y, ws, cnt, I, H, N, JC, S, G, CB):
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        hs = cuda.shared.array(HS, np.float32)
        lst = cuda.shared.array(JMAX, np.int32)
        red = cuda.shared.array(RED, np.float32)
        flag = cuda.shared.array(1, np.int32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        wpb = cuda.blockDim.x >> 5
        cb = cuda.blockIdx.x % CB     # 4 groups: 1024 output columns
        s = cuda.blockIdx.x // CB
        j0 = s * JC
        count = stage(scr, tid, h, hs, lst, I, N, j0, JC)
        GQ = G >> 2
        acc = cuda.local.array(NACC, np.float32)
        for i in range(NACC):
            acc[i] = np.float32(0.0)
        vf = cuda.local.array(32, np.float32)
        trips = (count + wpb - 1) // wpb   # the same for every warp: the scans stay uniform
        for t in range(trips):            # the warps split the active neurons
            i = t * wpb + warp
            jj = lst[i] if i < count else 0
            mw = np.uint32(masks[((j0 + jj) * GQ + cb) * 32 + lane]) if i < count else np.uint32(0)
            ea, eb = pair_prefix(scr, tid, mw)
            if mw != 0:
                load_quad(vals, goff, (j0 + jj) * G + cb * 4, mw, ea, eb, vf)
                for n in range(NT):
                    hv = hs[jj * NT + n]
                    for q in range(32):
                        acc[n * 32 + q] += hv * vf[q]
        block_out(acc, red, y, ws, cnt, flag, tid, cb, s, S, N, H, cb * 1024, H)

    return kcache.tag(down_rows if rows else down_dense, "cats_down", (nt, rows, unroll, regs, v))
