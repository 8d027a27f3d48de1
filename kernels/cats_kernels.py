"""Device code of the activation-sparse (CATS) gated-MLP kernels; host side in ``cats.py``.

Two kernels per decode step of a gated MLP, after ``g = gate(x)`` (any linear):

``up`` (one warp per intermediate neuron ``j``): lanes ``n < N`` compute token ``n``'s
``a = act(g[n, j])`` in fp32, round it to fp16 (as torch does) and zero it when ``|a| < t``; if no
token keeps neuron ``j`` the warp writes zeros and reads nothing more, else it computes
``u = up[j, :] . x[n, :]`` for every token (fp32) and writes ``h[n, j] = a * u`` (fp16). Up's row
``j`` is read only for active neurons: dense rows (``up_dense``: lanes stride over 8-byte words) or
row-packed ones (``up_rows``, ``sparsekit.packed.rowpack``: lane ``l`` takes segment ``l`` of each
256-column group, finds its values from a warp scan of the segments' popcounts, and walks its 8
mask bits).

``down`` (``y = h @ down^T``, split over neurons): block ``(c, s)`` owns a slice of output columns
and the neurons of chunk ``s``. It stages ``h[:, chunk]`` in shared memory, compacts the chunk's
active neurons (nonzero for some token) into a list with a warp scan, and accumulates, for each
active ``j`` only, row ``j`` of ``down^T`` times ``h[:, j]``: dense rows (``down_dense``: ``down^T`` tiled as [128-column block,
neuron, 128 columns], so a block streams one contiguous tile and a neuron's 256 bytes in each tile
are skipped together; one 8-byte word, 4 columns, per lane; the block's warps split the neurons) or row-packed ones
(``down_rows``: one 256-column group per warp, 8 columns per lane). Chunks' fp32 partials are summed
by the last block of each column slice to arrive (an arrival counter it resets), so one launch
writes ``y``.

Every warp exchange is made by all warps of a block the same number of times except in
``up_rows``, whose scans run only for active rows: under the simulator (which emulates exchanges
block-wide) it is launched with one warp per block.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ._intrinsics import SCRATCH_WORDS, SIM, f2h, h2f, shfl_idx, shfl_up, shfl_xor

UP_ROWS = 1       # neurons per warp in up_dense (x converted once for all of them)
UP_UNROLL = 8     # 8-byte words per lane and neuron in flight in up_dense
DOWN_WARPS_MAX = 8  # warps per dense down block at most (shared partials)
DOWN_UNROLL = 8     # neurons per warp in flight in down_dense
ROWS_WARPS = 4      # warps per row-packed down block
ROWS_MAX_TOKENS = 2 # tokens the row-packed kernels take (their accumulators grow with N)
def jmax(nt: int) -> int:
    """Neurons per down chunk at most (its shared-memory list and staged activations); 64 under the
    simulator, whose every shared-memory pass runs in Python."""
    if SIM:
        return 64
    return 1024 if nt <= 2 else 512 if nt <= 4 else 256
ACTS = ("silu",)  # activations computed inside ``up``; others run torch's path


def _any_lanes():
    @cuda.jit(device=True, inline=True)
    def any_lanes(scr, tid, v):
        """Sum of the float ``v`` over the warp (every lane gets it)."""
        v += shfl_xor(scr, tid, v, 16)
        v += shfl_xor(scr, tid, v, 8)
        v += shfl_xor(scr, tid, v, 4)
        v += shfl_xor(scr, tid, v, 2)
        v += shfl_xor(scr, tid, v, 1)
        return v

    return any_lanes


warp_sum = _any_lanes()


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
def dot4(wv, xv):
    """Dot product of two words of 4 fp16 each (fp32)."""
    s = h2f(wv & 0xFFFF) * h2f(xv & 0xFFFF)
    s += h2f((wv >> 16) & 0xFFFF) * h2f((xv >> 16) & 0xFFFF)
    s += h2f((wv >> 32) & 0xFFFF) * h2f((xv >> 32) & 0xFFFF)
    s += h2f((wv >> 48) & 0xFFFF) * h2f((xv >> 48) & 0xFFFF)
    return s


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

    return up_rows if rows else up_dense


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

    return down_rows if rows else down_dense
