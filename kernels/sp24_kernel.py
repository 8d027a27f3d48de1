"""The tile-mosaic kernel for 2:4 and hybrid weights (layout: ``sparsekit.packed.sp24``).

``y[N, M] = x[N, K] @ W^T`` with W a mosaic of 64x64 tiles, each 2:4 (``mma.sp`` m16n8k32, selector
0) or dense (``mma.sync`` m16n8k16): no software decode, the A fragments come from global memory as
they are stored (one 16-byte load per lane per 32 columns of a 2:4 strip, per 16 of a dense one).

- **Block** = ``R`` strip rows (16 outputs each: R = 1, 2, 4) x ``nw`` warps, and one chunk of ``NT``
  tokens (8, 16, 32 or 64; rows past N are zeros; the chunks of a row block are neighbours in the grid). Warp ``w`` takes tile columns ``w, w + nw, ...``
  starting at step ``block mod steps`` (as spmm_warp: blocks do not all read the same X slice at
  once); the warps' fp32 sums meet in shared memory at the end (split-K inside the block).
- **Step** (one tile column): the tile's ``slot << 1 | kind`` word; the warp's 16-byte loads of its
  R strips' A registers (and 2:4 metadata, one word per lane) and of the X slice (NT rows x 64
  columns) are issued together; X goes to the warp's shared slot (144-byte rows: conflict-free
  ``ldmatrix``); per 32 columns and 8 tokens one ``ldmatrix.x4`` gives the 4 B registers that one
  ``mma.sp`` or two ``mma.sync`` take. Chunk 1's metadata comes from lane ^ 2 (one shuffle per strip).

Under the simulator every warp runs the same number of steps (its exchanges are block barriers);
a warp past its last step multiplies zeros.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from . import kcache
from ._intrinsics import SCRATCH_WORDS, SIM, shfl_idx, syncwarp
from ._sp_intrinsics import ldg128, ldmatrix_x4, mma_k32, sts128
from ._warp_intrinsics import byte_addr
from .block import dynamic_smem, make_warp_sums, thread_ids
from .sp24_plan import XS
from sparsekit.packed.sp24 import DENSE_STRIP_WORDS, DENSE_TILE_WORDS, SP_STRIP_WORDS, SP_TILE_WORDS, SP_VALUE_WORDS

_KERNELS: dict = {}


def compiled_kernels() -> dict:
    """The kernels built so far, by their ``get_kernel`` key (for resource reports)."""
    return dict(_KERNELS)


def get_kernel(nt: int, r: int, maxreg: int = 128):
    """Kernel for chunks of ``nt`` tokens (8, 16, 32, 64) and ``r`` strip rows per block (1, 2, 4)."""
    key = (nt, r, maxreg)
    if key not in _KERNELS:
        _KERNELS[key] = kcache.tag(_build(nt, r, maxreg), "sp24_kernel", key)
    return _KERNELS[key]


def _build(NT: int, R: int, MAXREG: int):
    assert NT in (8, 16, 32, 64) and R in (1, 2, 4)
    NB = NT // 8
    NACC = 4 * NB
    XCH = NT * 8                  # 16-byte chunks of a step's X slice
    XIT = (XCH + 31) // 32
    SLOT = NT * XS                # bytes of a warp's X slot
    RACC = R * NACC               # accumulators per thread
    RA = R * 16                   # A registers per thread (16 per strip: 4 k16 chunks dense, 2 k32 chunks 2:4)
    u32 = np.uint32
    warp_sums = make_warp_sums(R, NB, NT)

    @cuda.jit(device=True, inline="always")
    def stage_x(d32, x, xs, lane, n0, N, gk, ldx, valid):
        """The X slice of tile column ``gk`` (rows n0 .. n0+NT-1, zeros past N) to the warp's slot."""
        for c in range(XIT):
            ch = lane + 32 * c
            if ch < XCH:
                row = ch >> 3
                part = ch & 7
                w0 = w1 = w2 = w3 = u32(0)
                if valid and n0 + row < N:
                    w0, w1, w2, w3 = ldg128(x, (n0 + row) * ldx + gk * 32 + part * 4)
                sts128(d32, xs + u32(row * XS + part * 16), w0, w1, w2, w3)

    @cuda.jit(device=True, inline="always")
    def load16(areg, k, src, i):
        """``areg[k .. k+3]`` = the 16 bytes at word ``i`` of ``src``."""
        w0, w1, w2, w3 = ldg128(src, i)
        areg[k] = w0
        areg[k + 1] = w1
        areg[k + 2] = w2
        areg[k + 3] = w3

    @cuda.jit(device=True, inline="always")
    def load_a(dense, sp, areg, meta, r, sp_tile, base, lane, valid):
        """Strip ``r``'s A registers (and metadata) at word ``base`` of its tile: a 2:4 strip's chunk c
        goes to registers 16r + 8c .. +3 (the first half of a dense strip's chunks 2c, 2c + 1)."""
        if valid and sp_tile:
            for c in range(2):
                load16(areg, 16 * r + 8 * c, sp, base + c * 128 + lane * 4)
            meta[r] = u32(sp[base + SP_VALUE_WORDS + lane])
        elif valid:
            for q in range(4):
                load16(areg, 16 * r + 4 * q, dense, base + q * 128 + lane * 4)
        else:
            for e in range(16):
                areg[16 * r + e] = u32(0)
            meta[r] = u32(0)

    @cuda.jit(**({} if SIM else {"max_registers": MAXREG}))
    def kernel(dense, sp, tiles, x, y, M, N, GK, ldx, nch):
        d64, d32, df = dynamic_smem()
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)

        tid, warp, lane, _, _, nw = thread_ids()
        rb = cuda.blockIdx.x // nch   # row block; its token chunks are neighbours in the grid
        n0 = (cuda.blockIdx.x - rb * nch) * NT
        sr = rb * R                   # first strip row: tile row gm, strip s0
        gm = sr >> 2
        s0 = sr & 3
        nsw = (GK - warp + nw - 1) // nw if warp < GK else 0
        nloop = (GK + nw - 1) // nw if SIM else nsw
        rot = rb % nsw if nsw > 0 else 0
        xs = byte_addr(d64, warp * (SLOT // 8))
        # ldmatrix row addresses: lane l gives row l % 8 of matrix l // 8 (8 columns each)
        xlm = xs + u32((lane & 7) * XS + (lane >> 3) * 16)

        acc = cuda.local.array(RACC, np.float32)
        for e in range(RACC):
            acc[e] = np.float32(0.0)
        areg = cuda.local.array(RA, np.uint32)
        meta = cuda.local.array(R, np.uint32)
        meta1 = cuda.local.array(R, np.uint32)

        # each step's tile word is loaded one step ahead: the step's A loads wait on it (their address is its slot),
        # so loaded in the step itself it put two round trips to memory in every step (docs/kernels-notes.md "v42")
        tnext = tiles[gm * GK + warp + nw * rot] if nsw > 0 else 0
        i = 0
        while i < nloop:
            valid = i < nsw
            j = i + rot
            if j >= nsw:
                j -= nsw
            gk = warp + nw * j
            tref = tnext if valid else 0
            if i + 1 < nsw:
                j1 = j + 1
                if j1 >= nsw:
                    j1 -= nsw
                tnext = tiles[gm * GK + warp + nw * j1]
            sp_tile = (tref & 1) == 1
            slot = tref >> 1
            stage_x(d32, x, xs, lane, n0, N, gk, ldx, valid)
            for r in range(R):
                if sp_tile:
                    base = slot * SP_TILE_WORDS + (s0 + r) * SP_STRIP_WORDS
                else:
                    base = slot * DENSE_TILE_WORDS + (s0 + r) * DENSE_STRIP_WORDS
                load_a(dense, sp, areg, meta, r, sp_tile, base, lane, valid)
            for r in range(R):
                meta1[r] = shfl_idx(scr, tid, meta[r], lane ^ 2)   # chunk 1's metadata to lanes t = 0, 1
            syncwarp()
            for c in range(2):
                for jb in range(NB):
                    b0, b1, b2, b3 = ldmatrix_x4(scr, tid, d32, xlm + u32(jb * 8 * XS + c * 64))
                    for r in range(R):
                        q = r * NACC + 4 * jb
                        m = meta[r] if c == 0 else meta1[r]
                        k = 16 * r + 8 * c
                        d0, d1, d2, d3 = mma_k32(scr, tid, sp_tile, areg[k], areg[k + 1], areg[k + 2], areg[k + 3],
                                                 areg[k + 4], areg[k + 5], areg[k + 6], areg[k + 7],
                                                 b0, b1, b2, b3, acc[q], acc[q + 1], acc[q + 2], acc[q + 3], m)
                        acc[q] = d0
                        acc[q + 1] = d1
                        acc[q + 2] = d2
                        acc[q + 3] = d3
            syncwarp()                # every lane's ldmatrix is done before the slot is rewritten
            i += 1

        # ---- the warps' partial sums meet in shared memory (the X slots are free now)
        warp_sums(df, acc, y, tid, warp, lane, nw, sr, M, n0, N)

    return kernel
