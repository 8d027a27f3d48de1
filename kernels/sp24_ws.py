"""The warp-specialized warpgroup kernel for 2:4 weights (issue 22, docs/kernels-notes.md "v18"): sp24_wg's
products with no block-wide barrier in the step. **Opt-in** (``sp24_matmul(kernel="ws")``) until a GPU
session has checked and timed it; written and checked in the simulator only.

- **Warps**: ``WG`` consumer warpgroups (warps 0 .. 4WG-1, each aligned on four warps as the warpgroup MMA
  needs) and one producer warp (the last).
- **Producer** (lane 0 of the last warp): per step, into ring stage ``s`` once the consumers have released
  it (its "empty" mbarrier), two kinds of Hopper bulk copies completing on the stage's "full" mbarrier:
  the X slab of this token chunk and tile column (``NT`` x 128 bytes, rewritten on the host into 8x8 core
  matrices, ``x_slabs``) and each tile of the block's ``R`` x ``WG`` tile rows (4608 contiguous bytes:
  every tile is 2:4, so tile t is slot t of the layout).
- **Consumers**: wait "full", retire their previous products (``wgmma.wait_group 0``: the A registers of
  a product in flight must not be overwritten, docs/kernels-notes.md "v17"), release the previous stage
  (one arrival per warp on its "empty"), load A and both metadata words from the stage, issue one
  ``wg_mma2`` per tile row (two m64nNk32 products) and commit.
- **End** (``block.make_tile_end``, all warps): the fp32 tile ``[NT, 64 R WG]`` through shared memory, fp16
  out or a K split's partial summed by the last block to arrive.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import cuda

from . import kcache
from ._intrinsics import SCRATCH_WORDS, SIM, bulk_copy, mbar_arrive, mbar_expect, mbar_init, mbar_wait
from ._warp_intrinsics import byte_addr
from ._wg_intrinsics import wg_commit, wg_hold, wg_wait0
from .block import dynamic_smem, make_tile_end, split_sharers, step_col, thread_ids
from .sp24_wg import NTS, SLOT, make_tile_ops

TILE_BYTES = 4 * SLOT            # one 2:4 tile: four strips of values and metadata
_KERNELS: dict = {}


def x_slabs(x: torch.Tensor, nt: int) -> torch.Tensor:
    """``x`` [N, Kp] (fp16, Kp a multiple of 64) as int64 words of slabs [chunks][Kp / 64][nt x 64]: token
    chunk c and tile column gk's slab holds tokens c nt .. c nt + nt - 1 (zeros past N) as 8x8 core matrices,
    8-token blocks 1024 bytes apart, the 8 K parts of a block 128 bytes apart, a token's 8 values (16 bytes)
    at 16 x its place in the block: the layout the descriptor reads (``sp24_wg``)."""
    n, kp = x.shape
    chunks = -(-n // nt)
    if chunks * nt != n:
        x = torch.cat([x, x.new_zeros(chunks * nt - n, kp)])
    v = x.reshape(chunks, nt // 8, 8, kp // 64, 8, 8)            # [c, blk, r8, gk, part, h]
    return v.permute(0, 3, 1, 4, 2, 5).contiguous().reshape(-1).view(torch.int64)


def stage_bytes(nt: int, r: int, wg: int) -> int:
    return nt * 128 + wg * r * TILE_BYTES


def smem_bytes(nt: int, stages: int, r: int, wg: int) -> int:
    """Dynamic shared bytes: the ring, reused for the block's fp32 tile at the end."""
    return max(stages * stage_bytes(nt, r, wg), nt * 64 * r * wg * 4)


def max_registers(nt: int, r: int, wg: int) -> int:
    """The register cap: what the consumers want (as sp24_wg), but no more than 64K registers shared by the
    block's 4 x wg + 1 warps allow (232 x 288 threads does not fit: the launch fails for want of resources)."""
    want = 232 if r * nt >= 128 else 168
    return min(want, (65536 // (32 * (4 * wg + 1))) & ~7)


def get_kernel(nt: int, stages: int, r: int = 2, wg: int = 2):
    """Kernel for ``nt`` tokens per output tile (8 .. 128), a ring of ``stages`` (2-8), ``r`` tile rows
    per warpgroup (1, 2) and ``wg`` consumer warpgroups (1, 2)."""
    key = (nt, stages, r, wg)
    if key not in _KERNELS:
        _KERNELS[key] = kcache.tag(_build(nt, stages, r, wg), "sp24_ws", key)
    return _KERNELS[key]


def _build(NT: int, STAGES: int, R: int, WG: int):
    assert NT in NTS and 2 <= STAGES <= 8 and R in (1, 2) and WG in (1, 2)
    CW = 4 * WG                           # consumer warps; the producer is warp CW
    THREADS = 32 * (CW + 1)
    NACC = NT // 2
    XBYTES = NT * 128
    STAGE = stage_bytes(NT, R, WG)
    ROWS = 64 * R * WG
    TILE = NT * ROWS
    tile_end = make_tile_end(TILE, ROWS, THREADS)
    piece, strip_offsets, operands, products, acc_store = make_tile_ops(NT, R, WG)
    ZERO = (np.float32(0.0),) * NACC
    u32 = np.uint32

    @cuda.jit(device=True, inline="always")
    def produce(d64, sp, xs, full, empty, chunk, tr0, nr, rot, nst, k0, GK):
        """Lane 0 of the producer warp: every step's bulk copies, each stage once the consumers freed it."""
        for i in range(nst):
            s = i % STAGES
            if i >= STAGES:
                mbar_wait(empty, s, ((i // STAGES) - 1) & 1)
            gk = step_col(i, rot, nst, k0)
            w0 = (s * STAGE) >> 3                  # the stage, in 8-byte words of the dynamic array
            mbar_expect(full, s, XBYTES + nr * TILE_BYTES)
            bulk_copy(d64, w0, xs, (chunk * GK + gk) * (XBYTES >> 3), XBYTES, full, s)
            for r in range(R * WG):
                if r < nr:
                    bulk_copy(d64, w0 + ((XBYTES + r * TILE_BYTES) >> 3), sp, ((tr0 + r) * GK + gk) * (TILE_BYTES >> 3),
                              TILE_BYTES, full, s)

    @cuda.jit(**({} if SIM else {"max_registers": max_registers(NT, R, WG)}))
    def kernel(sp, xs, y, ws, cnt, M, N, GK, nch, PER):
        d64, d32, df = dynamic_smem()
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        flag = cuda.shared.array(1, np.int32)
        full = cuda.shared.array(STAGES, np.uint64)
        empty = cuda.shared.array(STAGES, np.uint64)
        tid, warp, lane, g, t, _ = thread_ids()
        wg = warp >> 2
        wwarp = warp & 3
        ring = byte_addr(d64, 0)
        b = cuda.blockIdx.x
        tt, k0, nst, rb, n0, tr0, nr, rot = piece(b, M, GK, PER, nch)
        chunk = tt - rb * nch
        if tid == 0:
            for s in range(STAGES):
                mbar_init(full, s, 1)
                mbar_init(empty, s, CW)
        cuda.syncthreads()
        acc0 = ZERO
        acc1 = ZERO
        if warp == CW:
            if lane == 0:
                produce(d64, sp, xs, full, empty, chunk, tr0, nr, rot, nst, k0, GK)
        else:
            aoff, moff, moff1 = strip_offsets(XBYTES, wg, wwarp, lane)
            for i in range(nst):
                s = i % STAGES
                mbar_wait(full, s, (i // STAGES) & 1)       # step i's copies have landed
                acc0 = wg_wait0(acc0)                        # step i-1's products are done ...
                if R == 2:
                    acc1 = wg_hold(acc1)
                if i > 0 and lane == 0:
                    mbar_arrive(empty, (i - 1) % STAGES)     # ... so its stage may be refilled
                sb = ring + u32(s * STAGE)
                a0, m0, m0b = operands(d64, d32, sb, aoff, moff, moff1)
                a1, m1, m1b = a0, m0, m0b
                if R == 2:
                    a1, m1, m1b = operands(d64, d32, sb + u32(4 * SLOT), aoff, moff, moff1)
                acc0, acc1 = products(scr, tid, sb, a0, m0, m0b, a1, m1, m1b, acc0, acc1)
                wg_commit()
            acc0 = wg_wait0(acc0)
            if R == 2:
                acc1 = wg_hold(acc1)
        cuda.syncthreads()                                   # every copy consumed: the ring is free
        if warp < CW:
            acc_store(df, acc0, acc1, wg, wwarp, g, t)
        cuda.syncthreads()
        q0, q1 = split_sharers(tt, GK, PER)
        tile_end(df, y, ws, cnt, flag, tid, M, N, tr0 * 64, n0, tt, GK, b, nst, q0, q1)

    return kernel
