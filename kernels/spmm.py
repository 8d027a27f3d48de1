"""The TCA-BME SpMM kernel: Y[N, M] = X[N, K] @ W[M, K]^T with W packed (docs/format.md).

One thread block = 4 warps = the 4 strips (16 rows each) of one GroupTile row (64 outputs); it
walks a range of GroupTiles along K (split-K: several blocks share a row, the last one to finish
sums the fp32 partials). Per GroupTile step:

1. **Stage** (Hopper bulk copies, ``cp.async.bulk`` completing on an ``mbarrier``, ``STAGES``-deep
   ring in dynamic shared memory): one copy for the GroupTile's values (contiguous, 16-byte
   aligned by the format), one for its 64 bitmaps, one per token row of this step's 64-column
   slice of X (rows padded to 144 bytes: conflict-free B-fragment loads; rows past N are zeroed
   once). Warp 0 issues them; everyone else only waits on the stage's barrier. The block's GroupTile/strip offsets are read once
   into shared memory first, so no step waits on a dependent offset load; ``STAGES - 1`` steps
   are in flight while one is decoded.
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

from . import kcache
from ._intrinsics import (SCRATCH_WORDS, SIM, bulk_copy, decode_pair, f2h, fence_proxy_async, h2f, lds32,
                          mbar_expect, mbar_init, mbar_wait, mma, shfl_up, shfl_xor, smem_base, syncwarp)
from .plan import KPER_MAX, XROW

THREADS = 128          # 4 warps: the 4 strips of a GroupTile row
_GOFFS = KPER_MAX + 1
_SOFFS = 4 * KPER_MAX
BM_WORDS = 64          # uint64 bitmaps per GroupTile

_KERNELS: dict = {}
# the simulator sizes dynamic shared arrays from a numpy dtype instance
_SIM_U64 = np.dtype(np.uint64) if SIM else np.uint64
_SIM_U32 = np.dtype(np.uint32) if SIM else np.uint32


def slot_words(vcap: int, nt: int) -> int:
    """uint64 words of one pipeline stage: values (vcap) + bitmaps + X rows."""
    return vcap + BM_WORDS + nt * XROW


def compiled_kernels() -> dict:
    """The kernels built so far, by their ``get_kernel`` key (for resource reports)."""
    return dict(_KERNELS)


def get_kernel(nt: int, use_mma: bool, stages: int):
    """Kernel for ``nt`` token slots (multiple of 8 up to 64 on tensor cores, 1..8 on CUDA cores)."""
    key = (nt, use_mma, stages)
    if key not in _KERNELS:
        _KERNELS[key] = kcache.tag(_build(nt, use_mma, stages), "spmm", key)
    return _KERNELS[key]


def _build(NT: int, USE_MMA: bool, STAGES: int):
    if USE_MMA:
        assert NT % 8 == 0 and 8 <= NT <= 64
    else:
        assert 1 <= NT <= 8
    assert 2 <= STAGES <= 4
    NB = NT // 8                     # 8-token blocks (mma path)
    NACC = 4 * NB if USE_MMA else 2 * NT
    XCHUNKS = NT * 8                 # 16-byte chunks of one step's X slice
    u64 = np.uint64
    u32 = np.uint32

    @cuda.jit(device=True, inline=True)
    def issue(d64, mbar, bm, vals, x, goffs, i, g, gk, N, ldx, vcap, slot, lane):
        """Warp 0: start the bulk copies of step ``i`` (GroupTile ``g``, column block ``gk``)."""
        st = i % STAGES
        sb = st * slot
        fence_proxy_async()
        vbase = goffs[i]
        vbytes = (goffs[i + 1] - vbase) * 2
        if lane == 0:
            mbar_expect(mbar, st, vbytes + BM_WORDS * 8 + N * 128)
            if vbytes > 0:
                bulk_copy(d64, sb, vals, vbase >> 2, vbytes, mbar, st)
            bulk_copy(d64, sb + vcap, bm, g * BM_WORDS, BM_WORDS * 8, mbar, st)
        xb = sb + vcap + BM_WORDS
        for r in range(lane, N, 32):
            bulk_copy(d64, xb + r * XROW, x, r * ldx + gk * 16, 128, mbar, st)

    @cuda.jit
    def kernel(bm, vals, goff, soff, x, y, ws, cnt, M, N, GK, ldx, kper, nsplit, vcap, slot):
        if SIM:
            d64 = cuda.shared.array(0, _SIM_U64)
            d32 = cuda.shared.array(0, _SIM_U32)
        else:
            d64 = cuda.shared.array(0, np.uint64, alignment=16)
            d32 = cuda.shared.array(0, np.uint32, alignment=16)
        goffs = cuda.shared.array(_GOFFS, np.int32)
        soffs = cuda.shared.array(_SOFFS, np.int32)
        wb = cuda.shared.array(THREADS, np.uint64)
        mbar = cuda.shared.array(STAGES, np.uint64)
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

        gm = cuda.blockIdx.x
        split = cuda.blockIdx.y
        gk0 = split * kper
        nsteps = min(kper, GK - gk0)
        g0 = gm * GK + gk0

        acc = cuda.local.array(NACC, np.float32)
        for i in range(NACC):
            acc[i] = np.float32(0.0)

        # ---- this block's offsets, once
        for e in range(tid, nsteps + 1, THREADS):
            goffs[e] = goff[g0 + e]
        for e in range(tid, 4 * nsteps, THREADS):
            soffs[e] = soff[4 * g0 + e]
        if tid == 0:
            for st in range(STAGES):
                mbar_init(mbar, st, 1)
        # X rows past N stay zero in every stage (no copy writes them)
        for e in range(tid, STAGES * XROW * (NT - N), THREADS):
            st = e // (XROW * (NT - N))
            r = e - st * (XROW * (NT - N))
            d64[st * slot + vcap + BM_WORDS + N * XROW + r] = u64(0)
        cuda.syncthreads()

        # ---- pipeline: STAGES - 1 steps in flight while one is decoded
        if warp == 0:
            for i in range(STAGES - 1):
                if i < nsteps:
                    issue(d64, mbar, bm, vals, x, goffs, i, g0 + i, gk0 + i, N, ldx, vcap, slot, lane)

        for i in range(nsteps):
            mbar_wait(mbar, i % STAGES, (i // STAGES) & 1)   # step i has landed
            cuda.syncthreads()            # and everyone is done with step i-1's slot
            nxt = i + STAGES - 1
            if warp == 0 and nxt < nsteps:
                issue(d64, mbar, bm, vals, x, goffs, nxt, g0 + nxt, gk0 + nxt, N, ldx, vcap, slot, lane)

            sb = (i % STAGES) * slot
            # SMBD: offsets of the 32 half-bitmaps of this strip (inclusive warp scan)
            bmw = d32[2 * (sb + vcap) + 32 * warp + lane]
            cnt_l = u32(cuda.popc(bmw))
            incl = cnt_l
            for d in (1, 2, 4, 8, 16):
                up = shfl_up(scr, tid, incl, d)
                if lane >= d:
                    incl += up
            srel = soffs[4 * i + warp] - goffs[i]
            wb[tid] = u64(bmw) | (u64(incl - cnt_l + u32(srel)) << u64(32))
            syncwarp()

            hb = warp * 32 + hsel
            vbase = smem_base(d64, sb)
            xbase = smem_base(d64, sb + vcap + BM_WORDS)
            for t in range(4):
                h = hb + 8 * t
                # SMBD decode (inline PTX on the GPU: popc, 2 x ld.shared, funnel shift, selects)
                a0 = decode_pair(d32, wb[h], lmask, p, vbase)       # top-left
                a1 = decode_pair(d32, wb[h + 2], lmask, p, vbase)   # bottom-left
                a2 = decode_pair(d32, wb[h + 4], lmask, p, vbase)   # top-right
                a3 = decode_pair(d32, wb[h + 6], lmask, p, vbase)   # bottom-right
                if USE_MMA:
                    for j in range(NB):
                        xo = (8 * j + gid) * (2 * XROW) + 8 * t + tig
                        c0, c1, c2, c3 = mma(scr, tid, a0, a1, a2, a3, lds32(d32, xbase, xo),
                                             lds32(d32, xbase, xo + 4),
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
                        xo = n * (2 * XROW) + 8 * t + tig
                        xl = lds32(d32, xbase, xo)
                        xh = lds32(d32, xbase, xo + 4)
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
