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
from ._intrinsics import SCRATCH_WORDS, SIM, cluster_rank, cp_wait0, cp_wait1, cp_wait2, fence_proxy_async
from ._sp_intrinsics import cp16, cp_commit, cp_wait3, cp_wait4, cp_wait5, cp_wait6
from ._warp_intrinsics import byte_addr, lds32b
from ._wg_intrinsics import lds_a8, wg_commit, wg_hold, wg_mma2, wg_wait0
from .wgmma import descriptor
from .block import (dynamic_smem, make_tile_end, split_piece, split_sharers, step_col, thread_ids, tile_bytes,
                    tile_ld, unrolled)
from sparsekit.packed.sp24 import SP_STRIP_WORDS, SP_TILE_WORDS, SP_VALUE_WORDS

NTS = (8, 16, 32, 64, 128, 256)   # 256: the warp-specialized kernels' prefill tile (forced plans)
SLOT = 1152                      # bytes of one staged 2:4 strip (values, then metadata)
K_STEP, N_STEP = 128, 1024       # core matrices: along K, along N (8 tokens), in a staged X slice
_KERNELS: dict = {}


def _device(fn):
    """A device function for the kernels of this module and sp24_ws (plain Python under the simulator,
    whose per-call swap of a device function's module globals races between threads)."""
    return fn if SIM else cuda.jit(device=True, inline="always")(fn)


_DESC = np.uint64(descriptor(K_STEP, N_STEP))
_AMASK = np.uint64(0x3FFFF)
_FOUR = np.uint64(4)


@_device
def x_desc(addr):
    """The descriptor of the staged X slice (or its K part) at shared byte address ``addr``."""
    return _DESC | ((np.uint64(addr) & _AMASK) >> _FOUR)


def acc_offsets(NT: int, LD: int) -> list[tuple[int, int]]:
    """``(offset, i)`` for each of a warp's ``NT / 2`` accumulators of one tile row: value ``i = 4 jb + oi`` is row
    ``8 (oi >> 1)`` of the warp's 16 and token ``8 jb + 2 t + (oi & 1)``, so it goes ``offset`` past the lane's first
    value (token ``2 t``, row ``g``) of a token-major fp32 tile whose tokens are ``LD`` words apart (``block.tile_ld``;
    ``acc_store``, spmm_ws's ``acc_add``)."""
    return [((8 * jb + (oi & 1)) * LD + 8 * (oi >> 1), 4 * jb + oi) for jb in range(NT // 8) for oi in range(4)]


def make_tile_ops(NT: int, R: int, WG: int):
    """``(piece, strip_offsets, operands, products, acc_store, block_piece)``, the pieces sp24_wg, sp24_ws and
    spmm_ws share:

    - ``piece(b, M, GK, PER, nch)``, ``block_piece(b, M, GK, PER, nch, CL)`` and ``strip_offsets(base, wg,
      wwarp, lane)``: see their docstrings;
    - ``operands(d64, d32, so, aoff, moff, moff1)``: a staged strip's 8 A registers and both metadata
      words (the lane's own, and lane ^ 2's: the second 32 columns'), ``so`` the tile row's strips;
    - ``products(scr, tid, xaddr, a0, m0, m0b, a1, m1, m1b, acc0, acc1)``: one tile column's products;
    - ``acc_store(df, acc0, acc1, wg, wwarp, g, t)``: the warp's accumulators of its ``R`` tile rows into
      the block's fp32 tile ``[NT, 64 R WG]``, tokens ``tile_ld(64 R WG)`` words apart."""
    ROWS = 64 * R * WG
    LD = tile_ld(ROWS)
    desc = x_desc

    @_device
    def operands(d64, d32, so, aoff, moff, moff1):
        return lds_a8(d64, so + aoff), lds32b(d32, so + moff), lds32b(d32, so + moff1)

    @_device
    def products(scr, tid, xaddr, a0, m0, m0b, a1, m1, m1b, acc0, acc1):
        """One tile column's products on the X slice at ``xaddr``: two m64nNk32 per tile row (``a1``, ``m1``,
        ``m1b``: the second row's operands, unused when R = 1)."""
        xd = desc(xaddr)
        xd1 = desc(xaddr + np.uint32(512))
        acc0 = wg_mma2(scr, tid, a0, m0, m0b, xd, xd1, acc0)
        if R == 2:
            acc1 = wg_mma2(scr, tid, a1, m1, m1b, xd, xd1, acc1)
        return acc0, acc1

    @_device
    def piece(b, M, GK, PER, nch):
        """Block ``b``'s work: ``(tt, k0, nst, rb, n0)`` of ``split_piece``, then its first tile row, its tile
        rows inside the weight and the column rotation."""
        tt, k0, nst, rb, n0 = split_piece(b, GK, PER, nch, NT)
        tr0 = rb * (R * WG)
        return tt, k0, nst, rb, n0, tr0, min(R * WG, (M + 63) // 64 - tr0), rb % nst

    @_device
    def block_piece(b, M, GK, PER, nch, CL):
        """``piece``, then the block's token chunk and its rank in its thread-block cluster. With ``CL`` > 1,
        block ``b`` is rank ``b % CL`` of cluster ``b // CL``, which takes one token chunk and all of K on
        ``CL`` neighbouring row blocks, with one rotation (the warp-specialized kernels' X multicast)."""
        if CL > 1:
            rank = cluster_rank()
            tt, k0, nst, rb, n0, tr0, nr, rot = piece(b // CL, M, GK, PER, nch)
            chunk = tt - rb * nch
            rb = rb * CL + rank
            tr0 = rb * (R * WG)
            return rb * nch + chunk, k0, nst, rb, n0, tr0, min(R * WG, (M + 63) // 64 - tr0), rot, chunk, rank
        tt, k0, nst, rb, n0, tr0, nr, rot = piece(b, M, GK, PER, nch)
        return tt, k0, nst, rb, n0, tr0, nr, rot, tt - rb * nch, np.uint32(0)

    @_device
    def strip_offsets(base, wg, wwarp, lane):
        """Byte offsets in a stage of this lane's A registers and of its two metadata words in the warp's
        strip of the warpgroup's first tile row, whose strips start at ``base``."""
        so = base + (wg * R * 4 + wwarp) * SLOT
        return np.uint32(so + lane * 16), np.uint32(so + 1024 + lane * 4), np.uint32(so + 1024 + (lane ^ 2) * 4)

    lines = [f"b = 2 * t * {LD} + wg * {64 * R} + wwarp * 16 + g"]   # written out by ``block.unrolled``
    lines += [f"df[b + {off + 64 * r}] = acc{r}[{i}]" for off, i in acc_offsets(NT, LD) for r in range(R)]
    acc_store = unrolled("acc_store", "df, acc0, acc1, wg, wwarp, g, t", lines)

    return piece, strip_offsets, operands, products, acc_store, block_piece


def stage_bytes(nt: int, r: int, wg: int, ks: int = 1) -> int:
    """One stage: ``ks`` X slices (``nt`` x 128 bytes each), then the strips of ``ks`` x ``wg`` x ``r`` tiles."""
    return ks * (nt * 128 + 4 * wg * r * SLOT)


def smem_bytes(nt: int, stages: int, r: int, wg: int, ks: int = 1) -> int:
    """Dynamic shared bytes: the ring, reused for the block's fp32 tile at the end."""
    return max(stages * stage_bytes(nt, r, wg, ks), tile_bytes(nt, 64 * r * wg))


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
    tile_end = make_tile_end(TILE, ROWS, THREADS, tile_ld(ROWS))
    piece, strip_offsets, operands, products, acc_store, _ = make_tile_ops(NT, R, WG)
    ZERO = (np.float32(0.0),) * NACC
    u32 = np.uint32

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
        tt, k0, nst, rb, n0, tr0, nr, rot = piece(b, M, GK, PER, nch)
        nsteps = (nst + KS - 1) // KS
        for j in range(STAGES - 2):
            if j < nsteps:
                issue(d32, sp, x, ring + u32(j * STAGE), j, rot, nst, k0, tid, wg, wwarp, lane, n0, N, ldx, tr0, nr, GK)
            cp_commit()
        acc0 = ZERO
        acc1 = ZERO
        aoff, moff, moff1 = strip_offsets(KS * XBYTES, wg, wwarp, lane)
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
            a00, m00, m00b = operands(d64, d32, sb, aoff, moff, moff1)
            a01, m01, m01b = a00, m00, m00b
            if R == 2:
                a01, m01, m01b = operands(d64, d32, sb + u32(4 * SLOT), aoff, moff, moff1)
            if KS == 2:
                s1 = sb + u32(STRIPS * SLOT)
                a10, m10, m10b = operands(d64, d32, s1, aoff, moff, moff1)
                a11, m11, m11b = a10, m10, m10b
                if R == 2:
                    a11, m11, m11b = operands(d64, d32, s1 + u32(4 * SLOT), aoff, moff, moff1)
            acc0, acc1 = products(scr, tid, sb, a00, m00, m00b, a01, m01, m01b, acc0, acc1)
            if two:
                acc0, acc1 = products(scr, tid, sb + u32(XBYTES), a10, m10, m10b, a11, m11, m11b, acc0, acc1)
            wg_commit()
            i += 1
        acc0 = wg_wait0(acc0)
        if R == 2:
            acc1 = wg_hold(acc1)
        # ---- the block's fp32 tile [NT, ROWS] in shared memory (the ring is free once every copy landed)
        cp_wait0()
        cuda.syncthreads()
        acc_store(df, acc0, acc1, wg, wwarp, g, t)
        cuda.syncthreads()
        q0, q1 = split_sharers(tt, GK, PER)
        tile_end(df, y, ws, cnt, flag, tid, M, N, tr0 * 64, n0, tt, GK, b, nst, q0, q1)

    return kernel
