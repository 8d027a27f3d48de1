"""The tile-row kernel for 2:4 and hybrid weights (layout: ``sparsekit.packed.sp24``), issue 22's
second design: the block shares the X slice, warps own rows, and K splits across blocks.

``sp24_kernel`` (the first design) splits K over the warps of a block, so each warp copies its own X
slice for one strip: at N tokens a 1 KB strip costs N x 128 bytes of X, which overtakes the weight
from N = 16 on. Here:

- **Block** = 4 warps x ``R`` tile rows (64R outputs; warp ``w`` takes strip ``w`` of each: ``R`` strips
  per warp share every B fragment) and ``NT`` tokens (8, 16, 32 or 64) per output tile, and one **K
  split** of that output tile: ``PER`` tile columns (the last split fewer; ``PER`` = the tile columns:
  the whole tile), the splits of one tile neighbours in the grid (``kernels/work.py``).
- **Step** (one tile column, shared by the 4 warps: one tile, one kind): a ``STAGES``-deep ring of
  16-byte ``cp.async`` copies, one commit group per step: the X slice ``[NT, 64]`` (copied by all 128
  threads; rows past N are written as zeros by the copies themselves) and each warp's strips (2:4: 1152
  bytes with its metadata, dense: 2048; a strip's slot is ``ASLOT`` bytes: 1152 when the weight has no
  dense tile), so ``STAGES - 1`` steps of weights are in flight per warp.
  The A registers then come from shared memory in fragment order (16-byte loads, conflict-free). One
  block barrier per step. Blocks start their split at ``rb mod steps`` (different row blocks do not
  ask L2 for the same X slice at once).
- **Multiply**: per 32 columns and 8 tokens one ``ldmatrix.x4`` and one ``mma.sp`` (2:4 tile) or two
  ``mma.sync`` (dense tile), as ``sp24_kernel``.
- **End** (``block.make_tile_end``): the 4 warps' fp32 tile ``[NT, 64R]`` goes through shared memory; a
  whole tile is written as fp16. A split's partial goes to the block's workspace slot, and the last of
  the tile's blocks to arrive (an atomic counter per tile, reset by that block) sums the slots of all of
  them, which it knows from ``PER``, and writes fp16.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from . import kcache
from ._intrinsics import SCRATCH_WORDS, SIM, cp_wait0, cp_wait1, cp_wait2, shfl_idx
from ._sp_intrinsics import cp16, cp_commit, cp_wait3, cp_wait4, cp_wait5, cp_wait6, ldmatrix_x4, mma_k32, mma_sp
from ._warp_intrinsics import byte_addr, lds128b, lds32b
from .block import dynamic_smem, make_tile_end, split_piece, split_sharers, thread_ids
from .sp24_plan import SLOTS, XS, stage_bytes
from .sp24_plan import rows_smem_bytes as smem_bytes  # noqa: F401 - the kernel's shared layout
from sparsekit.packed.sp24 import DENSE_STRIP_WORDS, DENSE_TILE_WORDS, SP_STRIP_WORDS, SP_TILE_WORDS, SP_VALUE_WORDS

THREADS = 128
_KERNELS: dict = {}


def compiled_kernels() -> dict:
    """The kernels built so far, by their ``get_kernel`` key (for resource reports)."""
    return dict(_KERNELS)


def get_kernel(nt: int, stages: int, r: int = 1, aslot: int = 2048, maxreg: int = 128):
    """Kernel for chunks of ``nt`` tokens (8, 16, 32, 64), a ring of ``stages`` (2-8), ``r`` (1, 2) tile
    rows per block and ``aslot`` (1152: all tiles 2:4, or 2048) bytes per staged strip; every block runs
    one K split of ``per`` tile columns of one output tile."""
    key = (nt, stages, r, aslot, maxreg)
    if key not in _KERNELS:
        _KERNELS[key] = kcache.tag(_build(nt, stages, r, aslot, maxreg), "sp24_rows", key)
    return _KERNELS[key]


def _build(NT: int, STAGES: int, R: int, ASLOT: int, MAXREG: int):
    assert NT in (8, 16, 32, 64) and 2 <= STAGES <= 8 and R in (1, 2) and ASLOT in SLOTS
    NB = NT // 8
    NACC = 4 * NB
    NBW = 4 * NB                          # B registers of one 32-column half of a step
    XCH = NT * 8                          # 16-byte chunks of one X slice
    XIT = (XCH + THREADS - 1) // THREADS
    SLOT = NT * XS                        # the X slice at the start of each stage
    STAGE = stage_bytes(NT, R, ASLOT)
    ROWS = 64 * R
    TILE = NT * ROWS
    RACC = R * NACC                       # fp32 accumulators per thread
    RA = R * 16                           # A registers per thread
    SPONLY = ASLOT == SLOTS[0]            # every tile 2:4 (the layout has no dense tile): no kind branch
    # all but the newest STAGES - 2 copy groups have landed
    wait = (cp_wait0, cp_wait1, cp_wait2, cp_wait3, cp_wait4, cp_wait5, cp_wait6)[STAGES - 2]
    tile_end = make_tile_end(TILE, ROWS, THREADS)
    u32 = np.uint32
    LO = np.uint64(0xFFFFFFFF)
    HI = np.uint64(32)

    @cuda.jit(device=True, inline="always")
    def x_issue(d32, x, stage, gk, tid, n0, N, ldx):
        """The copies of tile column ``gk``'s X slice (rows n0 .. n0+NT-1; zeros past N) to ``stage``."""
        for c in range(XIT):
            ch = tid + THREADS * c
            if ch < XCH:
                row = ch >> 3
                part = ch & 7
                ok = n0 + row < N
                src = (n0 + row) * ldx + gk * 32 + part * 4 if ok else 0
                cp16(d32, stage + u32(row * XS + part * 16), x, src, 16 if ok else 0)

    @cuda.jit(device=True, inline="always")
    def a_issue(d32, dense, sp, tiles, t0, gk, s, lane, dst):
        """The copies of strip ``s`` of tile ``t0 + gk`` to ``dst``: as stored (fragment order)."""
        tref = tiles[t0 + gk]
        slot = tref >> 1
        if SPONLY or (tref & 1) == 1:
            base = slot * SP_TILE_WORDS + s * SP_STRIP_WORDS
            cp16(d32, dst + u32(lane * 16), sp, base + lane * 4, 16)
            cp16(d32, dst + u32(512 + lane * 16), sp, base + 128 + lane * 4, 16)
            if lane < 8:
                cp16(d32, dst + u32(1024 + lane * 16), sp, base + SP_VALUE_WORDS + lane * 4, 16)
        else:
            base = slot * DENSE_TILE_WORDS + s * DENSE_STRIP_WORDS
            for q in range(4):
                cp16(d32, dst + u32(q * 512 + lane * 16), dense, base + q * 128 + lane * 4, 16)

    @cuda.jit(device=True, inline="always")
    def load4(d64, a, k, src):
        """``a[k .. k+3]`` = the four words at shared byte address ``src`` (one 16-byte load)."""
        e0, e1 = lds128b(d64, src)
        a[k] = u32(e0 & LO)
        a[k + 1] = u32(e0 >> HI)
        a[k + 2] = u32(e1 & LO)
        a[k + 3] = u32(e1 >> HI)

    @cuda.jit(device=True, inline="always")
    def a_load(d64, d32, a, k0, sp_tile, src, lane):
        """A registers from a staged strip: a 2:4 strip's 32-column chunk c to registers k0 + 8c .. +3 (and
        the metadata word, returned), a dense strip's 16-column chunk q to k0 + 4q .. +3."""
        if sp_tile:
            load4(d64, a, k0, src + u32(lane * 16))
            load4(d64, a, k0 + 8, src + u32(512 + lane * 16))
            return lds32b(d32, src + u32(1024 + lane * 4))
        for q in range(4):
            load4(d64, a, k0 + 4 * q, src + u32(q * 512 + lane * 16))
        return u32(0)

    @cuda.jit(device=True, inline="always")
    def step_col(i, rot, nst, k0):
        """The tile column of step ``i`` of a range of ``nst`` columns from ``k0``, rotated by ``rot``."""
        jj = i + rot
        return k0 + (jj - nst if jj >= nst else jj)

    @cuda.jit(device=True, inline="always")
    def segment(dense, sp, tiles, x, df, d64, d32, scr, tid, warp, lane, g, t, ring, xlm, aoff, M, N, GK, ldx,
                rb, n0, k0, nst):
        """Tile columns ``k0 .. k0+nst-1`` of output tile (row block ``rb``, tokens from ``n0``): the ring,
        the steps, and the block's fp32 tile [NT, 64R] in ``df`` (all threads past a barrier)."""
        rot = rb % nst
        nr = min(R, (M + 63) // 64 - rb * R)   # tile rows of this block inside the weight (block-uniform)
        acc = cuda.local.array(RACC, np.float32)
        a = cuda.local.array(RA, np.uint32)
        sps = cuda.local.array(R, np.bool_)
        m0s = cuda.local.array(R, np.uint32)
        m1s = cuda.local.array(R, np.uint32)
        bs = cuda.local.array(NBW, np.uint32)      # the B fragments of one 32-column half of a step
        for e in range(RACC):
            acc[e] = np.float32(0.0)
        for j in range(STAGES - 1):
            if j < nst:
                gk = step_col(j, rot, nst, k0)
                x_issue(d32, x, ring + u32(j * STAGE), gk, tid, n0, N, ldx)
                for r in range(R):
                    if r < nr:
                        a_issue(d32, dense, sp, tiles, (rb * R + r) * GK, gk, warp, lane,
                                ring + u32(j * STAGE) + aoff + u32(r * ASLOT))
            cp_commit()

        i = 0
        while i < nst:
            wait()                          # this thread's copies of step i have landed ...
            cuda.syncthreads()              # ... and everyone's; nobody reads step i-1's stage any more
            j = i + STAGES - 1
            if j < nst:
                gk = step_col(j, rot, nst, k0)
                st = ring + u32((j % STAGES) * STAGE)
                x_issue(d32, x, st, gk, tid, n0, N, ldx)
                for r in range(R):
                    if r < nr:
                        a_issue(d32, dense, sp, tiles, (rb * R + r) * GK, gk, warp, lane, st + aoff + u32(r * ASLOT))
            cp_commit()
            sb = ring + u32((i % STAGES) * STAGE)
            gk = step_col(i, rot, nst, k0)
            for r in range(R):
                if R == 1 or r < nr:
                    sps[r] = SPONLY or (tiles[(rb * R + r) * GK + gk] & 1) == 1
                    m0s[r] = a_load(d64, d32, a, 16 * r, sps[r], sb + aoff + u32(r * ASLOT), lane)
                    m1s[r] = shfl_idx(scr, tid, m0s[r], lane ^ 2)   # chunk 1's metadata to lanes t = 0, 1
            xb = xlm + u32((i % STAGES) * STAGE)
            for c in range(2):
                # every B fragment of these 32 columns first (straight-line ldmatrix into distinct
                # registers, so they overlap), then the mma of each strip: no branch between an ldmatrix
                # and its mma (one per tile kind and strip, block-uniform).
                for jb in range(NB):
                    b0, b1, b2, b3 = ldmatrix_x4(scr, tid, d32, xb + u32(jb * 8 * XS + c * 64))
                    bs[4 * jb] = b0
                    bs[4 * jb + 1] = b1
                    bs[4 * jb + 2] = b2
                    bs[4 * jb + 3] = b3
                for r in range(R):
                    if R == 1 or r < nr:
                        k = 16 * r + 8 * c
                        if SPONLY or sps[r]:
                            meta = m0s[r] if c == 0 else m1s[r]
                            for jb in range(NB):
                                q = r * NACC + 4 * jb
                                d0, d1, d2, d3 = mma_sp(scr, tid, a[k], a[k + 1], a[k + 2], a[k + 3],
                                                        bs[4 * jb], bs[4 * jb + 1], bs[4 * jb + 2], bs[4 * jb + 3],
                                                        acc[q], acc[q + 1], acc[q + 2], acc[q + 3], meta)
                                acc[q] = d0
                                acc[q + 1] = d1
                                acc[q + 2] = d2
                                acc[q + 3] = d3
                        else:
                            for jb in range(NB):
                                q = r * NACC + 4 * jb
                                d0, d1, d2, d3 = mma_k32(scr, tid, False, a[k], a[k + 1], a[k + 2], a[k + 3],
                                                         a[k + 4], a[k + 5], a[k + 6], a[k + 7],
                                                         bs[4 * jb], bs[4 * jb + 1], bs[4 * jb + 2], bs[4 * jb + 3],
                                                         acc[q], acc[q + 1], acc[q + 2], acc[q + 3], u32(0))
                                acc[q] = d0
                                acc[q + 1] = d1
                                acc[q + 2] = d2
                                acc[q + 3] = d3
            i += 1

        # ---- the block's fp32 tile [NT, 64R] in shared memory (the ring is free once every copy landed)
        cp_wait0()
        cuda.syncthreads()
        for r in range(R):
            for jb in range(NB):
                for oi in range(4):
                    n = 8 * jb + 2 * t + (oi & 1)
                    df[n * ROWS + r * 64 + warp * 16 + g + 8 * (oi >> 1)] = acc[r * NACC + 4 * jb + oi]
        cuda.syncthreads()

    @cuda.jit(**({} if SIM else {"max_registers": MAXREG}))
    def kernel(dense, sp, tiles, x, y, ws, cnt, M, N, GK, ldx, nch, PER):
        d64, d32, df = dynamic_smem()
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        flag = cuda.shared.array(1, np.int32)
        tid, warp, lane, g, t, _ = thread_ids()
        ring = byte_addr(d64, 0)
        xlm = ring + u32((lane & 7) * XS + (lane >> 3) * 16)   # ldmatrix row address: row l%8 of matrix l//8
        aoff = u32(SLOT + warp * R * ASLOT)                     # this warp's strips in a stage
        b = cuda.blockIdx.x
        tt, k0, nst, rb, n0 = split_piece(b, GK, PER, nch, NT)
        segment(dense, sp, tiles, x, df, d64, d32, scr, tid, warp, lane, g, t, ring, xlm, aoff, M, N, GK,
                ldx, rb, n0, k0, nst)
        q0, q1 = split_sharers(tt, GK, PER)
        tile_end(df, y, ws, cnt, flag, tid, M, N, rb * ROWS, n0, tt, GK, b, nst, q0, q1)

    return kernel
