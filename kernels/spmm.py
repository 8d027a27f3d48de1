"""The TCA-BME SpMM kernel: Y[N, M] = X[N, K] @ W[M, K]^T with W packed (docs/format.md).

One thread block = 4 warps = the 4 strips (16 rows each) of one GroupTile row (64 outputs); it
walks a range of GroupTiles along K (split-K: several blocks share a row, the last one to finish
sums the fp32 partials). Per GroupTile step:

1. **Stage** (whole block, coalesced 16-byte loads): the GroupTile's values (contiguous, 16-byte
   aligned by the format) into shared memory, and this step's 64-column slice of X, permuted so
   that each lane's B fragment for a TCTile is one 8-byte shared load. The next step's loads are
   issued into registers before this step's compute (register double buffering).
2. **Decode** (SMBD, per warp = per strip): lane ``l`` loads bitmap word ``l`` of its strip (16
   bitmaps x 2 words, one coalesced 128-byte load per warp) and popcounts it; a warp scan gives every
   half-bitmap its value offset. In the m16n8k16 A fragment lane ``l = 4*gid + tig`` holds, of each
   8x8 BitmapTile, elements ``(gid, 2*tig)`` and ``(gid, 2*tig+1)``, i.e. exactly bits ``2l`` and
   ``2l+1``; their value index is ``offset + popc(word & ((1 << 2l) - 1))``. BitmapTiles TL, BL,
   TR, BR are registers a0..a3.
3. **Multiply**: tensor cores (``mma.sync.m16n8k16``, B = X^T, N padded to 8k) or, for the
   CUDA-core variant, fp32 FMAs on the same fragments with a 4-lane reduction at the end.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ._intrinsics import SCRATCH_WORDS, f2h, h2f, ldg16, mma, shfl_up, shfl_xor, syncwarp

THREADS = 128          # 4 warps: the 4 strips of a GroupTile row
VS_WORDS = 1024 + 2    # staged values, in uint64 (4 values each): a dense 64x64 tile + over-read slack
XS_STRIDE = 17         # uint64 per staged X row: 16 + 1 pad, so the B-fragment loads are conflict-free

_U32 = np.uint32(0xFFFFFFFF)
_KERNELS: dict = {}


def get_kernel(nt: int, use_mma: bool):
    """Kernel for ``nt`` token slots: a multiple of 8 up to 64 (tensor cores) or 1..8 (CUDA cores)."""
    key = (nt, use_mma)
    if key not in _KERNELS:
        _KERNELS[key] = _build(nt, use_mma)
    return _KERNELS[key]


def _build(NT: int, USE_MMA: bool):
    if USE_MMA:
        assert NT % 8 == 0 and 8 <= NT <= 64
    else:
        assert 1 <= NT <= 8
    NB = NT // 8                     # 8-token blocks (mma path)
    NACC = 4 * NB if USE_MMA else 2 * NT
    XU = (NT * 4 + THREADS - 1) // THREADS   # X staging units (32 bytes) per thread
    XUNITS = NT * 4
    XS_SIZE = NT * XS_STRIDE
    u64 = np.uint64
    u32 = np.uint32

    @cuda.jit(device=True, inline=True)
    def load_x(x, N, ldx, gk, ui):
        r = ui >> 2
        t = ui & 3
        z = u64(0)
        e0, e1, e2, e3 = z, z, z, z
        if ui < XUNITS and r < N:
            base = r * ldx + gk * 16 + 4 * t
            e0, e1 = ldg16(x, base)
            e2, e3 = ldg16(x, base + 2)
        return e0, e1, e2, e3

    @cuda.jit(device=True, inline=True)
    def store_x(xs, ui, e0, e1, e2, e3):
        # words of this unit: e0=(w0,w1) e1=(w2,w3) e2=(w4,w5) e3=(w6,w7) of X[r, 16t*? ...]; lane tig
        # needs (w_tig, w_{4+tig}) packed as one uint64 at xs[r*17 + tig*4 + t].
        if ui < XUNITS:
            r = ui >> 2
            t = ui & 3
            lo = u64(0xFFFFFFFF)
            hi = u64(0xFFFFFFFF00000000)
            o = r * XS_STRIDE + t
            xs[o] = (e0 & lo) | (e2 << u64(32))
            xs[o + 4] = (e0 >> u64(32)) | (e2 & hi)
            xs[o + 8] = (e1 & lo) | (e3 << u64(32))
            xs[o + 12] = (e1 >> u64(32)) | (e3 & hi)

    @cuda.jit(device=True, inline=True)
    def load_v(vals, vb, nch, c):
        z = u64(0)
        a, b = z, z
        if c < nch:
            a, b = ldg16(vals, vb + 2 * c)
        return a, b

    @cuda.jit(device=True, inline=True)
    def store_v(vs, nch, c, a, b):
        if c < nch:
            vs[2 * c] = a
            vs[2 * c + 1] = b

    @cuda.jit(device=True, inline=True)
    def decode(wb, vs, h, lmask, bit0, bit1):
        """A-fragment register (two fp16) of this lane for the half-bitmap entry ``wb[h]``."""
        e = wb[h]
        w = u32(e & u64(0xFFFFFFFF))
        idx = u32(e >> u64(32)) + u32(cuda.popc(w & lmask))
        q = idx >> u32(2)
        s = u64((idx & u32(3)) * u32(16))
        lo = vs[q]
        hi = vs[q + u32(1)]
        v = u32((lo >> s) & u64(0xFFFFFFFF)) | u32(((hi << u64(16)) << (u64(48) - s)) & u64(0xFFFFFFFF))
        r = u32(0)
        if w & bit0:
            r = v & u32(0xFFFF)
            if w & bit1:
                r = v
        elif w & bit1:
            r = (v & u32(0xFFFF)) << u32(16)
        return r

    @cuda.jit
    def kernel(bm, vals, goff, soff, x, y, ws, cnt, M, N, GK, ldx, kper, nsplit):
        vs = cuda.shared.array(VS_WORDS, np.uint64)
        xs = cuda.shared.array(XS_SIZE, np.uint64)
        wb = cuda.shared.array(THREADS, np.uint64)
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        flag = cuda.shared.array(1, np.int32)

        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        gid = lane >> 2
        tig = lane & 3
        hsel = lane >> 4
        p = u32(2 * (lane & 15))
        lmask = (u32(1) << p) - u32(1)
        bit0 = u32(1) << p
        bit1 = u32(2) << p

        gm = cuda.blockIdx.x
        split = cuda.blockIdx.y
        gk0 = split * kper
        gk1 = min(gk0 + kper, GK)

        acc = cuda.local.array(NACC, np.float32)
        for i in range(NACC):
            acc[i] = np.float32(0.0)

        # ---- prefetch the first step into registers
        g = gm * GK + gk0
        vbase = goff[g]
        nch = (goff[g + 1] - vbase) >> 3
        vb = vbase >> 2
        p0a, p0b = load_v(vals, vb, nch, tid)
        p1a, p1b = load_v(vals, vb, nch, tid + 128)
        p2a, p2b = load_v(vals, vb, nch, tid + 256)
        p3a, p3b = load_v(vals, vb, nch, tid + 384)
        pbm = u32(bm[g * 128 + tid])
        psrel = soff[4 * g + warp] - vbase
        x00, x01, x02, x03 = load_x(x, N, ldx, gk0, tid)
        x10, x11, x12, x13 = load_x(x, N, ldx, gk0, tid + 128)

        for gk in range(gk0, gk1):
            cuda.syncthreads()                    # everyone is done with the last step's smem
            store_v(vs, nch, tid, p0a, p0b)
            store_v(vs, nch, tid + 128, p1a, p1b)
            store_v(vs, nch, tid + 256, p2a, p2b)
            store_v(vs, nch, tid + 384, p3a, p3b)
            store_x(xs, tid, x00, x01, x02, x03)
            if XU > 1:
                store_x(xs, tid + 128, x10, x11, x12, x13)
            bmw = pbm
            srel = psrel
            cuda.syncthreads()

            if gk + 1 < gk1:                      # issue the next step's loads now
                g = gm * GK + gk + 1
                vbase = goff[g]
                nch = (goff[g + 1] - vbase) >> 3
                vb = vbase >> 2
                p0a, p0b = load_v(vals, vb, nch, tid)
                p1a, p1b = load_v(vals, vb, nch, tid + 128)
                p2a, p2b = load_v(vals, vb, nch, tid + 256)
                p3a, p3b = load_v(vals, vb, nch, tid + 384)
                pbm = u32(bm[g * 128 + tid])
                psrel = soff[4 * g + warp] - vbase
                x00, x01, x02, x03 = load_x(x, N, ldx, gk + 1, tid)
                if XU > 1:
                    x10, x11, x12, x13 = load_x(x, N, ldx, gk + 1, tid + 128)

            # ---- SMBD: offsets of the 32 half-bitmaps of this strip (inclusive warp scan)
            cnt_l = u32(cuda.popc(bmw))
            incl = cnt_l
            for d in (1, 2, 4, 8, 16):
                up = shfl_up(scr, tid, incl, d)
                if lane >= d:
                    incl += up
            wb[tid] = u64(bmw) | (u64(incl - cnt_l + u32(srel)) << u64(32))
            syncwarp()

            hb = warp * 32 + hsel
            for t in range(4):
                h = hb + 8 * t
                a0 = decode(wb, vs, h, lmask, bit0, bit1)       # top-left
                a1 = decode(wb, vs, h + 2, lmask, bit0, bit1)   # bottom-left
                a2 = decode(wb, vs, h + 4, lmask, bit0, bit1)   # top-right
                a3 = decode(wb, vs, h + 6, lmask, bit0, bit1)   # bottom-right
                if USE_MMA:
                    for j in range(NB):
                        xb = xs[(8 * j + gid) * XS_STRIDE + tig * 4 + t]
                        c0, c1, c2, c3 = mma(scr, tid, a0, a1, a2, a3,
                                             u32(xb & u64(0xFFFFFFFF)), u32(xb >> u64(32)),
                                             acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3])
                        acc[4 * j] = c0
                        acc[4 * j + 1] = c1
                        acc[4 * j + 2] = c2
                        acc[4 * j + 3] = c3
                else:
                    w00 = h2f(a0)
                    w01 = h2f(a0 >> u32(16))
                    w10 = h2f(a1)
                    w11 = h2f(a1 >> u32(16))
                    w20 = h2f(a2)
                    w21 = h2f(a2 >> u32(16))
                    w30 = h2f(a3)
                    w31 = h2f(a3 >> u32(16))
                    for n in range(NT):
                        xb = xs[n * XS_STRIDE + tig * 4 + t]
                        xl = u32(xb & u64(0xFFFFFFFF))
                        xh = u32(xb >> u64(32))
                        y0 = h2f(xl)
                        y1 = h2f(xl >> u32(16))
                        y2 = h2f(xh)
                        y3 = h2f(xh >> u32(16))
                        acc[2 * n] += w00 * y0 + w01 * y1 + w20 * y2 + w21 * y3
                        acc[2 * n + 1] += w10 * y0 + w11 * y1 + w30 * y2 + w31 * y3

        # ---- epilogue
        if not USE_MMA:                      # sum the 4 lanes (tig) that share output rows
            for i in range(NACC):
                v = acc[i]
                v += shfl_xor(scr, tid, v, 1)
                v += shfl_xor(scr, tid, v, 2)
                acc[i] = v
        mrow = gm * 64 + warp * 16 + gid
        mp = cuda.gridDim.x * 64
        for i in range(NACC):
            if USE_MMA:
                j = i >> 2
                oi = i & 3
                n = 8 * j + 2 * tig + (oi & 1)
                m = mrow + 8 * (oi >> 1)
                mine = True
            else:
                n = i >> 1
                m = mrow + 8 * (i & 1)
                mine = tig == 0
            if mine:
                if nsplit == 1:
                    if n < N and m < M:
                        y[n * M + m] = np.int16(f2h(acc[i]))
                else:
                    ws[(split * NT + n) * mp + m] = acc[i]
        if nsplit > 1:
            cuda.threadfence()
            cuda.syncthreads()
            if tid == 0:
                old = cuda.atomic.add(cnt, gm, 1)
                flag[0] = 1 if old == nsplit - 1 else 0
            cuda.syncthreads()
            if flag[0] == 1:                 # last block of this row: reduce the partials
                cuda.threadfence()
                for e in range(tid, 64 * N, THREADS):
                    n = e >> 6
                    m = gm * 64 + (e & 63)
                    s = np.float32(0.0)
                    for sp in range(nsplit):
                        s += ws[(sp * NT + n) * mp + m]
                    if m < M:
                        y[n * M + m] = np.int16(f2h(s))
                if tid == 0:
                    cnt[gm] = 0

    return kernel
