"""The warp-specialized warpgroup kernel for 2:4 and hybrid weights (issue 22, docs/kernels-notes.md "v18"
and its outcome): sp24_wg's products with no block-wide barrier in the step. ``kernel="auto"`` takes it on
Hopper where it measured fastest (``sp24_plan.kernel_for``).

- **Warps**: ``WG`` consumer warpgroups (warps 0 .. 4WG-1, each aligned on four warps as the warpgroup MMA
  needs) and one producer warp (the last).
- **Producer** (lane 0 of the last warp): per step, into ring stage ``s`` once the consumers have released
  it (its "empty" mbarrier), two kinds of Hopper bulk copies completing on the stage's "full" mbarrier:
  the X slab of this token chunk and tile column (``NT`` x 128 bytes, rewritten on the host into 8x8 core
  matrices, ``x_slabs``) and each tile of the block's ``R`` x ``WG`` tile rows (4608 contiguous bytes:
  every tile is 2:4, so tile t is slot t of the layout). **Hybrid** weights (``hybrid``, one tile row per
  warpgroup): the tile map gives each tile's kind and slot, a dense tile is one 8192-byte copy, and the
  producer writes the kinds into shared memory before the stage's "full" arrival publishes them.
- **Consumers**: retire their previous products (``wgmma.wait_group 0``: the A registers of a product in
  flight must not be overwritten, docs/kernels-notes.md "v17"), release the previous stage (one arrival per
  warp on its "empty", so the producer may refill it while this step's copies are still landing; up to 32
  tokens a tile, with a ring of 6, after waiting), wait "full", load A and both metadata words from the
  stage, issue one ``wg_mma2`` per tile row (two m64nNk32 products) and commit; a dense tile: its 16 A
  registers, one ``wg_mmad`` (four dense m64nNk16 products).
- **End** (``block.make_tile_end``, all warps): the fp32 tile ``[NT, 64 R WG]`` through shared memory, fp16
  out or a K split's partial summed by the last block to arrive.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import cuda

from . import kcache
from .common import quarter_regs
from ._intrinsics import (SCRATCH_WORDS, SIM, bulk_copy, bulk_copy_mc, clock32, cluster_sync, gtimer32,
                          mbar_arrive, mbar_arrive_remote, mbar_expect, mbar_init, mbar_wait)
from ._warp_intrinsics import byte_addr
from ._wg_intrinsics import (lds_a8, regs_dec40, regs_dec168, regs_inc168, regs_inc232, wg_commit, wg_hold, wg_keep,
                             wg_mma2, wg_mmad, wg_wait0, wg_wait1, wsync)
from .block import (block_row, dynamic_smem, make_tile_end, split_sharers, stamp, step_col, thread_ids,
                    tile_bytes, tile_ld)
from .sp24_wg import NTS, SLOT, make_tile_ops, x_desc
from sparsekit.packed.sp24 import DENSE_STRIP_WORDS, DENSE_TILE_WORDS

TILE_BYTES = 4 * SLOT            # one 2:4 tile: four strips of values and metadata
DENSE_BYTES = 4 * DENSE_TILE_WORDS   # one dense tile of a hybrid weight: four strips of A fragments
DENSE_STRIP = 4 * DENSE_STRIP_WORDS
_KERNELS: dict = {}


def x_slabs(x: torch.Tensor, nt: int) -> torch.Tensor:
    """``x`` [N, Kp] (fp16, Kp a multiple of 64) as int64 words of slabs [chunks x Kp / 64, nt x 16]: token
    chunk c and tile column gk's slab holds tokens c nt .. c nt + nt - 1 (zeros past N) as 8x8 core matrices,
    8-token blocks 1024 bytes apart, the 8 K parts of a block 128 bytes apart, a token's 8 values (16 bytes)
    at 16 x its place in the block: the layout the descriptor reads (``sp24_wg``)."""
    n, kp = x.shape
    chunks = -(-n // nt)
    if chunks * nt != n:
        x = F.pad(x, (0, 0, 0, chunks * nt - n))
    # a token's 8 values of a K part as two int64 words: the copy moves a quarter of the elements (H100: 3.8 -> 2.8
    # us at 128 tokens x 4096, 12.5 -> 5.1 at 128 x 28672, 50 -> 25 at 512 x 28672). x [c, blk, r8, gk, part, h/4]
    # read as [c, gk, blk, part, r8, h/4] through one strided view (three torch calls in all: an eager call's
    # host time, ~half that of reshape + permute + reshape)
    q = kp // 4
    v = torch.as_strided(x.contiguous().view(torch.int64), (chunks, kp // 64, nt // 8, 8, 8, 2),
                         (nt * q, 16, 8 * q, 2, q, 1))
    return v.contiguous().view(chunks * kp // 64, nt * 16)


def slabs_or_make(x: torch.Tensor, nt: int, slabs: torch.Tensor | None) -> torch.Tensor:
    """``x_slabs(x, nt)`` as one row of int64 words, or ``slabs`` where the caller made them already (int64 or
    fp16, [chunks x Kp / 64, one slab] as ``x_slabs`` lays them out: ``runtime.slabs`` makes them in a compiled
    step, where the rewrite joins the kernel that wrote X); slabs of another tile width or token count are a
    ``ValueError``."""
    if slabs is None:
        return x_slabs(x, nt).reshape(-1)
    n, kp = x.shape
    rows = -(-n // nt) * kp // 64
    if slabs.dim() != 2 or slabs.shape[0] != rows or slabs.shape[1] * slabs.element_size() != nt * 128 \
            or not slabs.is_contiguous():
        raise ValueError(f"X slabs of shape {tuple(slabs.shape)} ({slabs.dtype}) do not fit {n} tokens x {kp} in "
                         f"tiles of {nt} tokens ({rows} slabs of {nt * 128} bytes): make them at the kernel's width")
    return slabs.reshape(-1).view(torch.int64)


def stage_bytes(nt: int, r: int, wg: int, hybrid: bool = False) -> int:
    """One stage: the X slab, then a tile slot per tile row (a dense tile's size where tiles may be dense)."""
    return nt * 128 + wg * r * (DENSE_BYTES if hybrid else TILE_BYTES)


def smem_bytes(nt: int, stages: int, r: int, wg: int, hybrid: bool = False) -> int:
    """Dynamic shared bytes: the ring, reused for the block's fp32 tile at the end."""
    return max(stages * stage_bytes(nt, r, wg, hybrid), tile_bytes(nt, 64 * r * wg))


def max_registers(nt: int, r: int, wg: int, blocks: int = 1) -> int:
    """The register cap: what the consumers want (as sp24_wg), but no more than ``blocks`` blocks of 4 x wg + 1
    warps can share in each quarter of the SM (``common.quarter_regs``: 168 for one block of two warpgroups)."""
    want = 232 if r * nt >= 128 else 168
    return min(want, quarter_regs(4 * wg + 1, blocks))


# Diagnostics (``sp24_ws_probe.built_as``, docs/kernels-notes.md "v24"): the kernels built while ``probe_build``
# names one of ABLATIONS leave that part of every step out (their output is wrong: only their time means anything);
# one of VARIANTS is the whole kernel built another way (correct), to be timed beside the default:
# "early_release" retires the previous step's products and frees their stage before waiting for this step's
# copies at every tile width, "late_release" after (the default: early from 64 tokens a tile, where late was 2-7%
# slower, late below, where early was 0-3% slower; v25); "two_blocks" caps the registers so that two blocks fit
# an SM (no faster at 128 tokens, v25); "pipelined" (two tile rows a warpgroup) gives each tile row's products a
# group of their own and keeps one group running while the other row's operands load (``wg_wait1``, the operands
# kept live by ``wg_keep`` until their group is retired), its producer a warpgroup that gives the consumers its
# registers (``setmaxnreg``: 232 each, 40 left to it, so two tile rows of accumulators and two sets of operands
# fit; v31).
ABLATIONS = ("no_products", "no_copies", "no_x", "no_weights", "no_loop")
VARIANTS = ("early_release", "late_release", "two_blocks", "pipelined")
LATE_UP_TO = 32      # tokens a tile up to which a step waits for its copies before it releases the last stage
STAMPS = "stamps"     # the whole kernel writing time stamps into ``ws`` (no K split; ``sp24_ws_probe.ws_stamps``)
probe_build: list = [None]


def _build_for(r: int, hybrid: bool, cluster: int) -> str | None:
    """The probe build a plan gets inside ``built_as``: "pipelined" only where it applies (two tile rows a
    warpgroup, all-2:4, no cluster); other plans run the default build."""
    ab = probe_build[0]
    return None if ab == "pipelined" and (r != 2 or hybrid or cluster > 1) else ab


def block_threads(wg: int, r: int = 2, hybrid: bool = False, cluster: int = 1) -> int:
    """Threads of a block of ``wg`` consumer warpgroups: one producer warp more, or a producer warpgroup in the
    "pipelined" build (``setmaxnreg`` moves registers a warpgroup at a time)."""
    return 32 * (4 * wg + (4 if _build_for(r, hybrid, cluster) == "pipelined" else 1))


def get_kernel(nt: int, stages: int, r: int = 2, wg: int = 2, hybrid: bool = False, cluster: int = 1):
    """Kernel for ``nt`` tokens per output tile (8 .. 256), a ring of ``stages`` (2-8), ``r`` tile rows
    per warpgroup (1, 2) and ``wg`` consumer warpgroups (1, 2). ``hybrid``: tiles may be dense too (one
    tile row per warpgroup). ``cluster`` (2, 4): thread-block clusters of blocks on neighbouring tile rows whose
    leader multicasts each X slab into all of them (spmm_ws's protocol, docs/kernels-notes.md "v22")."""
    ab = _build_for(r, hybrid, cluster)
    key = (nt, stages, r, wg, hybrid) + ((cluster,) if cluster > 1 else ()) + ((ab,) if ab else ())
    if key not in _KERNELS:
        _KERNELS[key] = kcache.tag(_build(nt, stages, r, wg, hybrid, cluster, ab), "sp24_ws", key)
    return _KERNELS[key]


def _build(NT: int, STAGES: int, R: int, WG: int, HY: bool = False, CL: int = 1, AB: str | None = None):
    assert NT in NTS and 2 <= STAGES <= 8 and R in (1, 2) and WG in (1, 2) and not (HY and R != 1)
    assert CL in (1, 2, 4) and (AB is None or (AB in ABLATIONS + VARIANTS + (STAMPS,) and not HY and CL == 1))
    STAMP = AB == STAMPS
    PIPE = AB == "pipelined"
    assert not PIPE or R == 2, "the pipelined turns take two tile rows a warpgroup"
    NO_PRODUCTS, NO_COPIES, NO_LOOP = AB == "no_products", AB == "no_copies", AB == "no_loop"
    X_BYTES_IN, W_TILES_IN = AB != "no_x", AB != "no_weights"
    # wait for the step's copies before retiring the previous products (rings of 6 up to 32 tokens a tile), or
    # after (3-stage rings from 64: the stage is refilled sooner; H100, docs/kernels-notes.md "v25")
    LATE = AB in ("late_release", "no_products") or (NT <= LATE_UP_TO and AB != "early_release")
    REGS = max_registers(NT, R, WG, 2 if AB == "two_blocks" else 1)
    CW = 4 * WG                           # consumer warps; the producer is warp CW
    THREADS = 32 * (CW + (4 if PIPE else 1))   # (pipelined: a producer warpgroup, for setmaxnreg)
    if PIPE:
        REGS = quarter_regs(CW + 4)       # 168 at launch; the consumers take 232 and the producers keep 40
    NACC = NT // 2
    XBYTES = NT * 128
    STAGE = stage_bytes(NT, R, WG, HY)
    TB = DENSE_BYTES if HY else TILE_BYTES    # a tile slot of the stage
    RW = R * WG
    NKINDS = STAGES * RW                  # the tile kinds of every stage (hybrid)
    ROWS = 64 * R * WG
    TILE = NT * ROWS
    tile_end = make_tile_end(TILE, ROWS, THREADS, tile_ld(ROWS))
    _, strip_offsets, operands, products, acc_store, block_piece = make_tile_ops(NT, R, WG)
    ZERO = (np.float32(0.0),) * NACC
    u32 = np.uint32
    ZA = ((u32(0),) * 8, u32(0), u32(0))

    @cuda.jit(device=True, inline="always")
    def advance(s, ph):
        """The consumers' next ring stage and the phase its "full" barrier completes in."""
        return (u32(0), ph ^ u32(1)) if s == STAGES - 1 else (s + u32(1), ph)

    @cuda.jit(device=True, inline="always")
    def produce(d64, sp, dn, tiles, xs, kinds, full, empty, chunk, tr0, nr, rot, nst, k0, GK, xempty, rank, ws, sb0,
                t0):
        """Lane 0 of the producer warp: every step's bulk copies, each stage once the consumers freed it.
        Hybrid: each tile's kind goes into ``kinds`` before the stage's "full" arrival publishes it. In a
        cluster (``CL`` > 1) the X slab comes from the leader's multicast (see spmm_ws's ``produce``)."""
        for i in range(nst):
            s = i % STAGES
            if i >= STAGES:
                mbar_wait(empty, s, ((i // STAGES) - 1) & 1)
            if STAMP:
                stamp(ws, sb0 + i * 8 + 5, t0)       # (probe: the stage is free)
            gk = step_col(i, rot, nst, k0)
            w0 = (s * STAGE) >> 3                  # the stage, in 8-byte words of the dynamic array
            if HY:
                nbytes = XBYTES
                for r in range(RW):
                    if r < nr:
                        code = tiles[(tr0 + r) * GK + gk]
                        kinds[s * RW + r] = code & 1
                        nbytes += TILE_BYTES if code & 1 else DENSE_BYTES
                mbar_expect(full, s, nbytes)
            else:
                mbar_expect(full, s, XBYTES * X_BYTES_IN + (nr if CL == 1 else max(nr, 0)) * TILE_BYTES * W_TILES_IN)
            if CL > 1:
                mbar_arrive_remote(xempty, s, 0)     # after the expect: the X bytes may land from now on
            elif X_BYTES_IN:
                bulk_copy(d64, w0, xs, (chunk * GK + gk) * (XBYTES >> 3), XBYTES, full, s)
            for r in range(RW):
                if r < nr:
                    dst = w0 + ((XBYTES + r * TB) >> 3)
                    if HY:
                        code = tiles[(tr0 + r) * GK + gk]
                        if code & 1:
                            bulk_copy(d64, dst, sp, (code >> 1) * (TILE_BYTES >> 3), TILE_BYTES, full, s)
                        else:
                            bulk_copy(d64, dst, dn, (code >> 1) * (DENSE_BYTES >> 3), DENSE_BYTES, full, s)
                    elif W_TILES_IN:
                        bulk_copy(d64, dst, sp, ((tr0 + r) * GK + gk) * (TILE_BYTES >> 3), TILE_BYTES, full, s)
            if CL > 1 and rank == 0:                 # every block's stage s free and expecting: one X copy
                mbar_wait(xempty, s, (i // STAGES) & 1)
                bulk_copy_mc(d64, w0, xs, (chunk * GK + gk) * (XBYTES >> 3), XBYTES, full, s, (1 << CL) - 1)
            if STAMP:
                stamp(ws, sb0 + i * 8 + 6, t0)       # (probe: the step's copies issued)

    @cuda.jit(**({} if SIM else {"max_registers": REGS}))
    def kernel(sp, dn, tiles, xs, y, ws, cnt, M, N, GK, nch, PER):
        d64, d32, df = dynamic_smem()
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        flag = cuda.shared.array(1, np.int32)
        full = cuda.shared.array(STAGES, np.uint64)
        empty = cuda.shared.array(STAGES, np.uint64)
        kinds = cuda.shared.array(NKINDS, np.int32)
        if CL > 1:
            xempty = cuda.shared.array(STAGES, np.uint64)  # the leader's: every block's stage free (CL arrivals)
        else:
            xempty = empty
        tid, warp, lane, g, t, _ = thread_ids()
        wg = warp >> 2
        wwarp = warp & 3
        ring = byte_addr(d64, 0)
        b = cuda.blockIdx.x
        tt, k0, nst, rb, n0, tr0, nr, rot, chunk, rank = block_piece(b, M, GK, PER, nch, CL)
        if tid == 0:
            for s in range(STAGES):
                mbar_init(full, s, 1)
                mbar_init(empty, s, CW)
                if CL > 1:
                    mbar_init(xempty, s, CL)
        cuda.syncthreads()
        if CL > 1:
            cluster_sync()                                   # every block's barriers set up before any remote use
        t0 = clock32() if STAMP else u32(0)                  # probe builds: 8 stamps a step (``sp24_ws_probe``),
        g0 = gtimer32() if STAMP else u32(0)                 # then the block's row: SM, start and end (ns)
        sb0 = b * (PER + 1) * 8 if STAMP else 0
        st = STAMP and tid == 0                              # (the consumers' stamps: warp 0, lane 0)
        acc0 = ZERO
        acc1 = ZERO
        if warp == CW or (PIPE and warp > CW):
            if PIPE:                                         # registers move from the producer warpgroup to the
                regs_dec40()                                 # consumers: 8 x 232 + 4 x 40 = 12 x 168, the launch's
            if (not PIPE or warp == CW) and lane == 0 and not (NO_COPIES or NO_LOOP):
                produce(d64, sp, dn, tiles, xs, kinds, full, empty, chunk, tr0, nr, rot, nst, k0, GK, xempty, rank,
                        ws, sb0, t0)
            if PIPE:
                wsync(scr, tid)                              # (setmaxnreg is warp-aligned)
                regs_inc168()                                # back to the launch's count for the end
        else:
            if PIPE:
                regs_inc232()
            # hybrid (R = 1): warpgroup wg's tile sits at slot wg, 2:4 strips SLOT apart, dense ones DENSE_STRIP
            aoff, moff, moff1 = strip_offsets(XBYTES + (wg * (TB - 4 * SLOT) if HY else 0), wg, wwarp, lane)
            doff = u32(XBYTES + wg * TB + wwarp * DENSE_STRIP + lane * 16)
            a0, m0, m0b = ZA
            a1, m1, m1b = ZA
            for i in range(nst if PIPE else 0):          # (variant "pipelined": the tile rows take turns)
                s = i % STAGES
                mbar_wait(full, s, (i // STAGES) & 1)
                sb = ring + u32(s * STAGE)
                xd = x_desc(sb)
                xd1 = x_desc(sb + u32(512))
                acc0 = wg_wait1(acc0)                    # row 0 of step i-1 done (its row 1 may still run) ...
                wg_keep(a0, m0, m0b, M)                  # ... so only now may its operands' registers be reused
                a0, m0, m0b = operands(d64, d32, sb, aoff, moff, moff1)
                acc0 = wg_mma2(scr, tid, a0, m0, m0b, xd, xd1, acc0)
                wg_commit()
                acc1 = wg_wait1(acc1)                    # row 1 of step i-1 done: step i-1's stage is free
                wg_keep(a1, m1, m1b, M)
                if i > 0 and lane == 0:
                    mbar_arrive(empty, (i - 1) % STAGES)
                a1, m1, m1b = operands(d64, d32, sb + u32(4 * SLOT), aoff, moff, moff1)
                acc1 = wg_mma2(scr, tid, a1, m1, m1b, xd, xd1, acc1)
                wg_commit()
            s = u32(0)                                   # step i's stage and its "full" phase, carried as
            ph = u32(0)                                  # 32-bit counters (i % STAGES on the int64 i cost ~50
            sprev = u32(STAGES - 1)                      # dependent instructions a step, v33)
            for i in range(0 if NO_LOOP or PIPE else nst):
                if st:
                    stamp(ws, sb0 + i * 8, t0)               # (probe: the step begins)
                if LATE and not NO_COPIES:
                    mbar_wait(full, s, ph)                  # step i's copies first (up to 32 tokens a tile)
                    if st:
                        stamp(ws, sb0 + i * 8 + 2, t0)       # (probe: "full")
                if NO_PRODUCTS:                              # (ablation: the stage is released at once, once
                    wsync(scr, tid)                          # every lane of the warp has seen it land)
                    if lane == 0:
                        mbar_arrive(empty, s)
                    s, ph = advance(s, ph)
                    continue
                acc0 = wg_wait0(acc0)                        # step i-1's products are done ...
                if R == 2:
                    acc1 = wg_hold(acc1)
                if i > 0 and lane == 0 and not NO_COPIES:
                    mbar_arrive(empty, sprev)                # ... so its stage may be refilled at once
                if st:
                    stamp(ws, sb0 + i * 8 + 1, t0)           # (probe: retired and released)
                if not (LATE or NO_COPIES):
                    mbar_wait(full, s, ph)                  # only then: step i's copies have landed
                    if st:
                        stamp(ws, sb0 + i * 8 + 2, t0)
                sb = ring + u32(s * STAGE)
                if HY and kinds[s * RW + wg] == 0:           # a dense tile: four m64nNk16 products
                    da = lds_a8(d64, sb + doff) + lds_a8(d64, sb + doff + u32(1024))
                    acc0 = wg_mmad(scr, tid, da, x_desc(sb), x_desc(sb + u32(256)), x_desc(sb + u32(512)),
                                   x_desc(sb + u32(768)), acc0)
                else:
                    a0, m0, m0b = operands(d64, d32, sb, aoff, moff, moff1)
                    a1, m1, m1b = a0, m0, m0b
                    if R == 2:
                        a1, m1, m1b = operands(d64, d32, sb + u32(4 * SLOT), aoff, moff, moff1)
                    if st:
                        stamp(ws, sb0 + i * 8 + 3, t0)       # (probe: A and metadata loads issued)
                    acc0, acc1 = products(scr, tid, sb, a0, m0, m0b, a1, m1, m1b, acc0, acc1)
                wg_commit()
                if st:
                    stamp(ws, sb0 + i * 8 + 4, t0)           # (probe: the products issued)
                sprev = s
                s, ph = advance(s, ph)
            acc0 = wg_wait0(acc0)
            if R == 2:
                acc1 = wg_hold(acc1)
            if PIPE:
                regs_dec168()
        cuda.syncthreads()                                   # every copy consumed: the ring is free
        if warp < CW:
            acc_store(df, acc0, acc1, wg, wwarp, g, t)
        cuda.syncthreads()
        q0, q1 = split_sharers(tt, GK, PER)
        if CL == 1 or nr > 0:
            tile_end(df, y, ws, cnt, flag, tid, M, N, tr0 * 64, n0, tt, GK, b, nst, q0, q1)
        if STAMP and tid == 0:
            block_row(ws, sb0 + PER * 8, g0)
        if CL > 1:
            cluster_sync()                                   # no block leaves while another may still signal it

    return kernel
