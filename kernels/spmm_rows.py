"""TCA-BME tile rows (issue 21, runtime v3): sp24_rows' block around spmm_warp's decode.

spmm_warp gives every warp its own X slice for a 16-row strip: at N tokens the launch reads
(M / 16) x N x K x 2 bytes of X from L2 (720 MB at N = 64 on 22016x4096), and its shared memory caps
it at 2 blocks per SM. Here the 4 warps of a block share the X slice of one GroupTile row:

- **Block** = 4 warps = one GroupTile row (64 outputs; warp ``w`` decodes strip ``w``) and ``NT`` tokens
  (8, 16, 32 or 64) per output tile. Its share of the work (``kernels/work.py``): one K split of one
  output tile (the splits of a tile are neighbours in the grid). A block starts its split at
  ``rb mod steps`` (row blocks do not ask L2 for the same X slice at once).
- **Step** (one GroupTile column): one block-wide ``cp.async`` commit group into a ``STAGES``-deep
  ring: the X slice ``[NT, 64]`` (all 128 threads; rows past N are never copied, and zeroed once in
  the last token chunk; 144-byte rows, so ``ldmatrix`` is conflict-free) and each warp's strip: its
  values, copied from the 16-byte floor of their start (spmm_warp's ``step_issue``; a slot has room
  for a dense strip, 2064 B) and its 16 bitmaps (128 B). The lane that holds the step's offsets writes the start mod 8 to the stage
  header. Lane ``l`` holds the value range of step ``32q + l`` (window ``q``); the next window's is
  loaded 32 steps ahead. One block barrier per step.
- **Decode once per strip and step**: lane ``h`` pops half-bitmap word ``h``; a 5-step warp scan
  gives its value offset; a 256-byte table hands each lane the words of its fragment positions; one
  ``popc``, two 16-bit loads and a ``prmt`` per A register (``decode_at``): 4 TCTiles x 4 A registers.
  Its cost does not grow with N.
- **Multiply**: per 32 columns, the ``NB = NT / 8`` ``ldmatrix.x4`` of the shared X slice into distinct
  registers first (B fragments of both TCTiles), then the ``2 NB`` ``mma.m16n8k16`` back to back (no
  branch between a load and its mma: sp24_rows' lesson).
- **End** (``block.make_tile_end``): the 4 warps' fp32 tile ``[NT, 64]`` goes through shared memory; a
  whole tile is written as fp16, a split's partial to the block's workspace slot, and the last of the
  tile's blocks to arrive (an atomic counter, reset by that block) sums the slots and writes fp16.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from . import kcache
from ._intrinsics import SCRATCH_WORDS, SIM, cp_wait0, cp_wait1, cp_wait2, mma, ptr_of, syncwarp
from ._sp_intrinsics import cp_wait3, cp_wait4, cp_wait5, cp_wait6, ldmatrix_x4
from ._rows_intrinsics import make_x_issue
from ._warp_intrinsics import byte_addr, decode_at, lds32b, lds128b, make_step_issue, scan_counts, sts64b
from .block import dynamic_smem, make_tile_end, split_piece, split_sharers, thread_ids
from .plan import ROWS_HEADER_BYTES, ROWS_STRIP_BYTES, ROWS_TABLE_BYTES, ROWS_VALUE_BYTES, XROW_BYTES
from .plan import rows_smem_bytes as smem_bytes  # noqa: F401 - the kernel's shared layout
from .plan import rows_stage_bytes

THREADS = 128
XS = XROW_BYTES
_KERNELS: dict = {}


def compiled_kernels() -> dict:
    """The kernels built so far, by their ``get_kernel`` key (for resource reports)."""
    return dict(_KERNELS)


def get_kernel(nt: int, stages: int, cmax: int = 5, maxreg: int = 128):
    """Kernel for chunks of ``nt`` tokens (8, 16, 32, 64), a ring of ``stages`` (2-8) and ``cmax`` (1-5)
    16-byte value copies per lane and strip (5: any strip); one K split per block (``kernels/work.py``)."""
    key = (nt, stages, cmax, maxreg)
    if key not in _KERNELS:
        _KERNELS[key] = kcache.tag(_build(nt, stages, cmax, maxreg), "spmm_rows", key)
    return _KERNELS[key]


def _build(NT: int, STAGES: int, CMAX: int, MAXREG: int):
    assert NT in (8, 16, 32, 64) and 2 <= STAGES <= 8 and 1 <= CMAX <= 5
    NB = NT // 8
    NACC = 4 * NB
    XIT = NT * 8 // THREADS or 1          # 16-byte X copies per thread and step (16 rows per round)
    XSLOT = NT * XS                       # the X slice at the start of each stage
    STAGE = rows_stage_bytes(NT)
    RING = STAGES * STAGE
    HDR = RING + 4 * ROWS_TABLE_BYTES     # the stage headers (one word per warp) after the 4 tables
    TILE = NT * 64
    # all but the newest STAGES - 2 copy groups have landed
    wait = (cp_wait0, cp_wait1, cp_wait2, cp_wait3, cp_wait4, cp_wait5, cp_wait6)[STAGES - 2]
    step_issue = make_step_issue(CMAX, 0, 8)   # a strip's values and bitmaps, then the commit
    x_issue = make_x_issue(XIT, THREADS, 16 * XS)
    tile_end = make_tile_end(TILE, 64, THREADS)
    u32 = np.uint32
    u64 = np.uint64

    @cuda.jit(device=True, inline="always")
    def step_col(j, rot, nst, k0):
        """The GroupTile column of step ``j`` of a range of ``nst`` columns from ``k0``, rotated by ``rot``."""
        jj = j + rot
        return k0 + (jj - nst if jj >= nst else jj)

    @cuda.jit(device=True, inline="always")
    def offsets(soff, goff, g0, s, j, nst, rot, k0):
        """Where strip ``s`` of step ``j``'s GroupTile (row base ``g0``) starts and ends in the values;
        (0, 0) past the last step."""
        st = u32(0)
        en = u32(0)
        if j < nst:
            g = g0 + step_col(j, rot, nst, k0)
            st = u32(soff[4 * g + s])
            en = u32(soff[4 * g + s + 1]) if s < 3 else u32(goff[g + 1])
        return st, en

    @cuda.jit(device=True, inline="always")
    def segment(bm, vals, goff, soff, x, df, d64, d32, scr, tid, warp, lane, g, t, GK, N, ldxb, rb, n0, k0, nst):
        """GroupTile columns ``k0 .. k0+nst-1`` of output tile (row block ``rb``, tokens from ``n0``): the ring,
        the steps, and the block's fp32 tile [NT, 64] in ``df`` (all threads past a barrier). At most 30
        arguments: CPython passes more as one tuple (``*args``), which numba cannot inline."""
        p = u32(2 * (lane & 15))
        lmask = (u32(1) << p) - u32(1)
        ring = byte_addr(d64, 0)
        xlm = ring + u32((lane & 7) * XS + (lane >> 3) * 16)   # ldmatrix row address: row l%8 of matrix l//8
        soff_w = u32(XSLOT + warp * ROWS_STRIP_BYTES)           # this warp's strip in a stage
        vdst = ring + soff_w + u32(lane * 16)                   # its first value copy
        bdst = ring + soff_w + u32(ROWS_VALUE_BYTES + lane * 16)   # its bitmap copy (lanes 0-7)
        bmo = ring + soff_w + u32(ROWS_VALUE_BYTES + lane * 4)     # its half-bitmap word
        hdr = HDR // 4 + warp                                   # its header word of stage 0 (a d32 index)
        tab = ring + u32(RING + warp * ROWS_TABLE_BYTES)
        # half-bitmap h (= lane) goes to entry (h & 1) * 16 + (h >> 3) * 4 + ((h >> 1) & 3), so the four
        # a lane decodes for TCTile t are 32 contiguous bytes (spmm_warp's table)
        tab_w = tab + u32(((lane & 1) * 16 + (lane >> 3) * 4 + ((lane >> 1) & 3)) * 8)
        tab_r = tab + u32((lane >> 4) * 128)
        vp = ptr_of(vals)
        bbase = ptr_of(bm) + u64(16 * warp * 8 + lane * 16)
        rot = rb % nst
        g0 = rb * GK                        # this tile row's first GroupTile

        nst_u = u32(nst)
        # X: thread tid copies 16-byte chunk tid + 128c (row tid / 8 + 16c, part tid % 8) of the slice;
        # rows past N are never copied (zeroed once below)
        ntok = min(NT, N - n0)
        xdst = ring + u32((tid >> 3) * XS + (tid & 7) * 16)
        xsrc = ptr_of(x) + u64((n0 + (tid >> 3)) * ldxb + (tid & 7) * 16)
        xrem = np.int32(8 * ntok - tid)
        xstride = u64(16 * ldxb)
        if ntok < NT:                       # the last token chunk: its missing rows read as zeros
            for e in range(tid, STAGES * STAGE // 8, THREADS):
                sts64b(d64, ring + u32(8 * e), u64(0))
            cuda.syncthreads()

        # lane l: the value range of step 32q + l (window q being issued), and of window q + 1
        lstart, lend = offsets(soff, goff, g0, warp, lane, nst, rot, k0)
        nstart, nend = offsets(soff, goff, g0, warp, lane + 32, nst, rot, k0)

        acc = cuda.local.array(NACC, np.float32)
        for e in range(NACC):
            acc[e] = np.float32(0.0)
        a = cuda.local.array(16, np.uint32)
        bs = cuda.local.array(NACC, np.uint32)      # the B fragments of one 32-column half of a step

        ist = 0                                     # stage of the next issue
        for j in range(STAGES - 1):
            if j < nst:
                gk = step_col(j, rot, nst, k0)
                x_issue(d64, x, xdst + u32(j * STAGE), xsrc + u64(128 * gk), xrem, xstride)
                if lane == j:
                    d32[hdr + j * (ROWS_HEADER_BYTES // 4)] = lstart & u32(7)
                step_issue(scr, tid, d64, lstart, lend, u32(j), nst_u, lane, vdst + u32(j * STAGE), vals, vp, bm,
                           bdst + u32(j * STAGE), bbase + u64(512 * (g0 + gk)), x, u32(0), u64(0), np.int32(0),
                           u64(0))
            else:
                step_issue(scr, tid, d64, lstart, lend, u32(j), nst_u, lane, vdst, vals, vp, bm, bdst, bbase, x,
                           u32(0), u64(0), np.int32(0), u64(0))          # nothing to copy: an empty group
            ist += 1

        dst = 0                                     # stage of the step decoded next
        i = 0
        while i < nst:
            wait()                          # this thread's copies of step i have landed ...
            cuda.syncthreads()              # ... and everyone's; nobody reads step i-1's stage any more
            j = i + STAGES - 1
            if (j & 31) == 0:               # the issue enters window j / 32: its offsets were loaded 32 steps ago
                lstart = nstart
                lend = nend
                nstart, nend = offsets(soff, goff, g0, warp, j + 32 + lane, nst, rot, k0)
            if ist == STAGES:
                ist = 0
            sto = u32(ist * STAGE)
            if j < nst:
                gk = step_col(j, rot, nst, k0)
                x_issue(d64, x, xdst + sto, xsrc + u64(128 * gk), xrem, xstride)
                if lane == (j & 31):
                    d32[hdr + ist * (ROWS_HEADER_BYTES // 4)] = lstart & u32(7)
                bsrc = bbase + u64(512 * (g0 + gk))
            else:
                bsrc = bbase
            step_issue(scr, tid, d64, lstart, lend, u32(j), nst_u, lane, vdst + sto, vals, vp, bm, bdst + sto,
                       bsrc, x, u32(0), u64(0), np.int32(0), u64(0))
            ist += 1

            # ---- decode this warp's strip of step i: one popc + scan, the table, 16 A registers
            sdo = u32(dst * STAGE)
            bw = lds32b(d32, bmo + sdo)
            ex = scan_counts(scr, tid, u32(cuda.popc(bw)))
            off = d32[hdr + dst * (ROWS_HEADER_BYTES // 4)]
            vbase = ring + sdo + soff_w
            sts64b(d64, tab_w, u64(bw) | (u64(vbase + u32(2) * (ex + off)) << u64(32)))
            syncwarp()
            for tt in range(4):
                e01 = lds128b(d64, tab_r + u32(32 * tt))
                e23 = lds128b(d64, tab_r + u32(32 * tt + 16))
                a[4 * tt] = decode_at(d32, e01[0], lmask, p)       # top-left
                a[4 * tt + 1] = decode_at(d32, e01[1], lmask, p)   # bottom-left
                a[4 * tt + 2] = decode_at(d32, e23[0], lmask, p)   # top-right
                a[4 * tt + 3] = decode_at(d32, e23[1], lmask, p)   # bottom-right

            # ---- multiply: per 32 columns every B fragment first, then the mma back to back
            xb = xlm + sdo
            for c in range(2):
                for jb in range(NB):
                    b0, b1, b2, b3 = ldmatrix_x4(scr, tid, d32, xb + u32(jb * 8 * XS + c * 64))
                    bs[4 * jb] = b0
                    bs[4 * jb + 1] = b1
                    bs[4 * jb + 2] = b2
                    bs[4 * jb + 3] = b3
                for h in range(2):
                    k = 4 * (2 * c + h)
                    for jb in range(NB):
                        q = 4 * jb
                        d0, d1, d2, d3 = mma(scr, tid, a[k], a[k + 1], a[k + 2], a[k + 3], bs[q + 2 * h],
                                             bs[q + 2 * h + 1], acc[q], acc[q + 1], acc[q + 2], acc[q + 3])
                        acc[q] = d0
                        acc[q + 1] = d1
                        acc[q + 2] = d2
                        acc[q + 3] = d3
            dst += 1
            if dst == STAGES:
                dst = 0
            i += 1

        # ---- the block's fp32 tile [NT, 64] in shared memory (the ring is free once every copy landed)
        cp_wait0()
        cuda.syncthreads()
        for jb in range(NB):
            for oi in range(4):
                n = 8 * jb + 2 * t + (oi & 1)
                df[n * 64 + warp * 16 + g + 8 * (oi >> 1)] = acc[4 * jb + oi]
        cuda.syncthreads()

    @cuda.jit(**({} if SIM else {"max_registers": MAXREG}))
    def kernel(bm, vals, goff, soff, x, y, ws, cnt, M, N, GK, ldxb, nch, PER):
        d64, d32, df = dynamic_smem()
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        flag = cuda.shared.array(1, np.int32)
        tid, warp, lane, g, t, _ = thread_ids()
        b = cuda.blockIdx.x
        tt, k0, nst, rb, n0 = split_piece(b, GK, PER, nch, NT)
        segment(bm, vals, goff, soff, x, df, d64, d32, scr, tid, warp, lane, g, t, GK, N, ldxb, rb, n0, k0, nst)
        q0, q1 = split_sharers(tt, GK, PER)
        tile_end(df, y, ws, cnt, flag, tid, M, N, rb * 64, n0, tt, GK, b, nst, q0, q1)

    return kernel
