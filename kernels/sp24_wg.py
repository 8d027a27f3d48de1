"""The warpgroup kernel for 2:4 weights (layout: ``sparsekit.packed.sp24``, every tile 2:4), issue 22's
third design and issue 21's route past 32 tokens: Hopper's sparse warpgroup MMA (``wgmma.mma_async.sp``
m64nNk32, sm_90a) instead of one ``mma.sp`` m16n8k32 and one ``ldmatrix`` per warp, 16 rows and 8 tokens.
GPU only: the simulator runs a Python twin of the instruction (``_wg_intrinsics_sim``).

- **Block** = ``WG`` warpgroups (1 or 2) x ``R`` tile rows each (64 R WG output rows; warp w of a
  warpgroup supplies strip w of each of its tiles as A registers) and ``NT`` tokens (8 .. 128), and one
  K split of that output tile (``kernels/work.py``, as sp24_rows). Every tile is 2:4, so tile t's
  values sit in slot t (``Sp24Layout``: tiles of one kind are stored in tile order): no map lookup.
- **Step** (``KS`` tile columns of 64): a ``STAGES``-deep ring of 16-byte ``cp.async`` copies, one
  commit group per step: the X slices ``[NT, 64]`` laid out as 8x8 core matrices (16 bytes per token row;
  the 8 core matrices of 8 tokens along K 128 bytes apart, 8-token blocks 1024 bytes apart: the
  descriptor's leading and stride byte offsets) and every warp's strips in fragment order (1152 bytes
  each). Copies run ``STAGES - 2`` steps ahead.
- **Multiply**: per tile column and tile row, the warps load their A registers and both metadata words
  from the stage (16-byte and 4-byte shared loads; a lane reads the second 32 columns' word where lane
  ^ 2 keeps it), then one ``wg_mma2`` = two m64nNk32 products (columns 0-31, 32-63) on the X slice in
  place; one commit group per step, whose products run on through the next step's barrier and copies
  (``wgmma.wait_group 0`` before its loads: the A registers of a product in flight must not be
  overwritten, and ptxas gives every step's A the same registers). A warpgroup past the weight's last
  tile row multiplies stale shared memory into rows that are never written (no divergent
  warpgroup-wide instruction).
- **End** (``block.make_tile_end``): the fp32 tile ``[NT, 64 R WG]`` through shared memory, fp16 out or
  a split's partial summed by the last block to arrive.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from . import kcache
from ._intrinsics import SCRATCH_WORDS, SIM, cp_wait0, cp_wait1, cp_wait2, fence_proxy_async
from ._sp_intrinsics import cp16, cp_commit, cp_wait3, cp_wait4, cp_wait5, cp_wait6
from ._warp_intrinsics import byte_addr, lds32b
from ._wg_intrinsics import lds_a8, wg_commit, wg_hold, wg_mma2, wg_wait0
from .wgmma import descriptor
from .block import dynamic_smem, make_tile_end, split_piece, split_sharers, thread_ids
from sparsekit.packed.sp24 import SP_STRIP_WORDS, SP_TILE_WORDS, SP_VALUE_WORDS

NTS = (8, 16, 32, 64, 128)
SLOT = 1152                      # bytes of one staged 2:4 strip (values, then metadata)
K_STEP, N_STEP = 128, 1024       # core matrices: along K, along N (8 tokens), in a staged X slice
_KERNELS: dict = {}


def stage_bytes(nt: int, r: int, wg: int, ks: int = 1) -> int:
    """One stage: ``ks`` X slices (``nt`` x 128 bytes each), then the strips of ``ks`` x ``wg`` x ``r`` tiles."""
    return ks * (nt * 128 + 4 * wg * r * SLOT)


def smem_bytes(nt: int, stages: int, r: int, wg: int, ks: int = 1) -> int:
    """Dynamic shared bytes: the ring, reused for the block's fp32 tile at the end."""
    return max(stages * stage_bytes(nt, r, wg, ks), nt * 64 * r * wg * 4)


def compiled_kernels() -> dict:
    return dict(_KERNELS)


def get_kernel(nt: int, stages: int, r: int = 1, wg: int = 1, ks: int = 1):
    """Kernel for ``nt`` tokens per output tile (8, 16, 32, 64, 128), a ring of ``stages`` (3-8), ``r``
    tile rows per warpgroup (1, 2), ``wg`` warpgroups per block (1, 2) and ``ks`` tile columns per step
    (1, 2)."""
    key = (nt, stages, r, wg, ks)
    if key not in _KERNELS:
        _KERNELS[key] = kcache.tag(_build(nt, stages, r, wg, ks), "sp24_wg", key)
    return _KERNELS[key]


def _build(NT: int, STAGES: int, R: int, WG: int, KS: int):
    assert NT in NTS and 3 <= STAGES <= 8 and R in (1, 2) and WG in (1, 2) and KS in (1, 2)
    THREADS = 128 * WG
    NACC = NT // 2                        # fp32 accumulators per thread and tile row
    XCH = NT * 8                          # 16-byte chunks of one X slice
    XIT = (XCH + THREADS - 1) // THREADS
    XBYTES = NT * 128
    STRIPS = 4 * WG * R                   # strips of one tile column
    STAGE = stage_bytes(NT, R, WG, KS)
    ROWS = 64 * R * WG
    TILE = NT * ROWS
    # all but the newest STAGES - 3 copy groups have landed (copies run STAGES - 2 steps ahead)
    wait = (cp_wait0, cp_wait1, cp_wait2, cp_wait3, cp_wait4, cp_wait5, cp_wait6)[STAGES - 3]
    tile_end = make_tile_end(TILE, ROWS, THREADS)
    DESC = np.uint64(descriptor(K_STEP, N_STEP))
    ZERO = (np.float32(0.0),) * NACC
    u32 = np.uint32
    AMASK = np.uint64(0x3FFFF)
    FOUR = np.uint64(4)

    @cuda.jit(device=True, inline="always")
    def x_issue(d32, x, dst, gk, tid, n0, N, ldx):
        """Tile column ``gk``'s X slice (tokens n0 .. n0+NT-1, zeros past N) to ``dst`` as core matrices:
        chunk ch = (8-token block, K part, token in block) with the token fastest (32 consecutive chunks
        fill 512 consecutive bytes)."""
        for c in range(XIT):
            ch = tid + THREADS * c
            if XCH % THREADS == 0 or ch < XCH:
                r8 = ch & 7
                part = (ch >> 3) & 7
                blk = ch >> 6
                row = blk * 8 + r8
                ok = n0 + row < N
                src = (n0 + row) * ldx + gk * 32 + part * 4 if ok else 0
                cp16(d32, dst + u32(part * K_STEP + blk * N_STEP + r8 * 16), x, src, 16 if ok else 0)

    @cuda.jit(device=True, inline="always")
    def a_issue(d32, sp, t, s, lane, dst):
        """The copies of strip ``s`` of tile ``t`` (slot t: every tile 2:4) to ``dst``, in fragment order."""
        base = t * SP_TILE_WORDS + s * SP_STRIP_WORDS
        cp16(d32, dst + u32(lane * 16), sp, base + lane * 4, 16)
        cp16(d32, dst + u32(512 + lane * 16), sp, base + 128 + lane * 4, 16)
        if lane < 8:
            cp16(d32, dst + u32(1024 + lane * 16), sp, base + SP_VALUE_WORDS + lane * 4, 16)

    @cuda.jit(device=True, inline="always")
    def step_col(i, rot, nst, k0):
        jj = i + rot
        return k0 + (jj - nst if jj >= nst else jj)

    @cuda.jit(device=True, inline="always")
    def issue(d32, sp, x, st, j, rot, nst, k0, tid, wg, wwarp, lane, n0, N, ldx, tr0, nr, GK):
        """Step ``j``'s copies (its KS tile columns that exist) to stage address ``st``."""
        for c in range(KS):
            if KS == 1 or j * KS + c < nst:
                gk = step_col(j * KS + c, rot, nst, k0)
                x_issue(d32, x, st + u32(c * XBYTES), gk, tid, n0, N, ldx)
                for r in range(R):
                    if wg * R + r < nr:
                        a_issue(d32, sp, (tr0 + wg * R + r) * GK + gk, wwarp, lane,
                                st + u32(KS * XBYTES + (c * STRIPS + (wg * R + r) * 4 + wwarp) * SLOT))

    @cuda.jit(device=True, inline="always")
    def desc(addr):
        return DESC | ((np.uint64(addr) & AMASK) >> FOUR)

    @cuda.jit(**({} if SIM else {"max_registers": 232 if R * NT >= 128 else 168}))
    def kernel(sp, x, y, ws, cnt, M, N, GK, ldx, nch, PER):
        d64, d32, df = dynamic_smem()
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        flag = cuda.shared.array(1, np.int32)
        tid, warp, lane, g, t, _ = thread_ids()
        wg = warp >> 2
        wwarp = warp & 3
        ring = byte_addr(d64, 0)
        b = cuda.blockIdx.x
        tt, k0, nst, rb, n0 = split_piece(b, GK, PER, nch, NT)
        tr0 = rb * (R * WG)
        nr = min(R * WG, (M + 63) // 64 - tr0)     # tile rows of this block inside the weight
        rot = rb % nst
        nsteps = (nst + KS - 1) // KS
        for j in range(STAGES - 2):
            if j < nsteps:
                issue(d32, sp, x, ring + u32(j * STAGE), j, rot, nst, k0, tid, wg, wwarp, lane, n0, N, ldx, tr0, nr, GK)
            cp_commit()
        acc0 = ZERO
        acc1 = ZERO
        aoff = u32(KS * XBYTES + (wg * R * 4 + wwarp) * SLOT + lane * 16)
        moff = u32(KS * XBYTES + (wg * R * 4 + wwarp) * SLOT + 1024 + lane * 4)
        moff1 = u32(KS * XBYTES + (wg * R * 4 + wwarp) * SLOT + 1024 + (lane ^ 2) * 4)
        i = 0
        while i < nsteps:
            wait()                      # this thread's copies of step i have landed ...
            fence_proxy_async()         # ... are visible to the tensor cores' reads ...
            cuda.syncthreads()          # ... and so are everyone's; step i-2's products are done
            j = i + STAGES - 2
            if j < nsteps:
                issue(d32, sp, x, ring + u32((j % STAGES) * STAGE), j, rot, nst, k0, tid, wg, wwarp, lane, n0, N, ldx,
                      tr0, nr, GK)
            cp_commit()
            # step i-1's products have run during the barrier and the copies; they must be done before
            # this step's loads: the tensor cores read A registers asynchronously, and ptxas gives each
            # step's A the same registers (docs/kernels-notes.md "v17")
            acc0 = wg_wait0(acc0)
            if R == 2:
                acc1 = wg_hold(acc1)
            sb = ring + u32((i % STAGES) * STAGE)
            two = KS == 2 and i * KS + 1 < nst
            # every A register and metadata word of the step first, then the products: no load writes a
            # register while a product of this step may still read it
            s0 = sb + aoff
            a00 = lds_a8(d64, s0)
            m00 = lds32b(d32, sb + moff)
            m00b = lds32b(d32, sb + moff1)
            if R == 2:
                a01 = lds_a8(d64, s0 + u32(4 * SLOT))
                m01 = lds32b(d32, sb + moff + u32(4 * SLOT))
                m01b = lds32b(d32, sb + moff1 + u32(4 * SLOT))
            if KS == 2:
                s1 = u32(STRIPS * SLOT)
                a10 = lds_a8(d64, s0 + s1)
                m10 = lds32b(d32, sb + moff + s1)
                m10b = lds32b(d32, sb + moff1 + s1)
                if R == 2:
                    a11 = lds_a8(d64, s0 + s1 + u32(4 * SLOT))
                    m11 = lds32b(d32, sb + moff + s1 + u32(4 * SLOT))
                    m11b = lds32b(d32, sb + moff1 + s1 + u32(4 * SLOT))
            xd = desc(sb)
            xd1 = desc(sb + u32(512))
            acc0 = wg_mma2(scr, tid, a00, m00, m00b, xd, xd1, acc0)
            if R == 2:
                acc1 = wg_mma2(scr, tid, a01, m01, m01b, xd, xd1, acc1)
            if two:
                xd = desc(sb + u32(XBYTES))
                xd1 = desc(sb + u32(XBYTES + 512))
                acc0 = wg_mma2(scr, tid, a10, m10, m10b, xd, xd1, acc0)
                if R == 2:
                    acc1 = wg_mma2(scr, tid, a11, m11, m11b, xd, xd1, acc1)
            wg_commit()
            i += 1
        acc0 = wg_wait0(acc0)
        if R == 2:
            acc1 = wg_hold(acc1)
        # ---- the block's fp32 tile [NT, ROWS] in shared memory (the ring is free once every copy landed)
        cp_wait0()
        cuda.syncthreads()
        c0 = wg * 64 * R + wwarp * 16 + g
        for jb in range(NT // 8):
            for oi in range(4):
                n = 8 * jb + 2 * t + (oi & 1)
                df[n * ROWS + c0 + 8 * (oi >> 1)] = acc0[4 * jb + oi]
                if R == 2:
                    df[n * ROWS + c0 + 64 + 8 * (oi >> 1)] = acc1[4 * jb + oi]
        cuda.syncthreads()
        q0, q1 = split_sharers(tt, GK, PER)
        tile_end(df, y, ws, cnt, flag, tid, M, N, tr0 * 64, n0, tt, GK, b, nst, q0, q1)

    return kernel
