"""TCA-BME decoded once per tile into warpgroup A registers (issue 21, docs/kernels-notes.md "v19"):
``sp24_ws``'s warp-specialized skeleton with the packed GroupTile as the operand source. ``tcabme_matmul``'s
default plan takes it on Hopper for many tokens (``matmul.default_kernel``); ``tcabme_ws_matmul`` forces it.

- **Warps**: ``WG`` consumer warpgroups, one 64-row GroupTile row each, then a copy warp and a table warp.
- **Copy warp** (lane 0 issues): each lane loads the ``gtile_offsets`` pair of one step and tile row ``WINDOW``
  (32) steps ahead of their use, so the step loop does not wait on a global load; lane 0 takes each step's
  pair by shuffle. Per step, into ring stage ``s`` once freed ("empty"), bulk copies completing on "raw":
  the X slab (``sp24_ws.x_slabs``), and per tile row the GroupTile's 64 bitmaps (512 bytes) and its values
  (16-byte aligned and padded by the format; none for an all-zero GroupTile).
- **Table warp**: per step, once "raw" completes, it fills each tile row's decode table in the stage
  (``_publish_table``: lane l popcounts half-words 4l .. 4l+3, one warp scan gives their first values; per
  half-word, its bits, its selector word and the shared address of its first value), then arrives on "full". It runs
  beside the copies, so the ring stays full of copies in flight.
- **Consumers**: retire the previous products (``wg_wait0``), release the previous stage, wait "full", then
  ``strip_a16`` builds the lane's 16 A registers from the warp's part of the table, branch-free on 32-bit shared
  addresses (``mma.sync``'s m16n8k16 fragment of each 16-column TCTile: BitmapTiles top-left, bottom-left,
  top-right, bottom-right, bit ``8 row + col``): per BitmapTile one entry, a popcount, two unconditional value loads
  and two permutes (the selector, the word). One ``wg_mmad`` (four dense m64nNk16 products) per step; the products
  are retired before the next step's A registers are written (ptxas does not guard them:
  ``scripts/checks/ptxas_wgmma.py``). The decode is per tile: nothing in it grows with the tokens.
- **End**: ``block.make_tile_end``, as sp24_ws.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import cuda

from . import kcache
from ._intrinsics import (SCRATCH_WORDS, SIM, bulk_copy, bulk_copy_mc, clock32, cluster_sync, gtimer32, mbar_arrive,
                          mbar_arrive_remote, mbar_expect, mbar_init, mbar_wait)
from ._sp_intrinsics import sts128
from ._warp_intrinsics import byte_addr, lds128b, sts64b
from ._wg_intrinsics import strip_a16, wg_commit, wg_mmad, wg_wait0, wscan, wshfl_idx, wsync
from .block import (block_row, dynamic_smem, make_tile_end, split_sharers, stamp, step_col, thread_ids, tile_ld,
                    unrolled)
from .sp24_wg import NTS, _device, acc_offsets, make_tile_ops, x_desc
from .spmm_ws_plan import (BITMAP_BYTES, TABLE_BYTES, WINDOW, block_warps, max_registers, slot_bytes, value_room,
                           ws_plan)

_KERNELS: dict = {}
u32 = np.uint32
u64 = np.uint64


def compiled_kernels() -> dict:
    """The kernels built so far in this process (tests and the kernel-cache check)."""
    return _KERNELS


def get_kernel(nt: int, stages: int, wg: int = 1, window: int = WINDOW, regs: int | None = None, cluster: int = 1,
               stamps: bool = False, alt: bool = False):
    """Kernel for ``nt`` tokens per output tile (8 .. 128), a ring of ``stages`` (2-8) and ``wg`` consumer
    warpgroups (1, 2), one GroupTile row each; ``window``: steps per offset load (tests shorten it); ``regs``:
    the register cap (``max_registers``); ``cluster``: blocks per thread-block cluster sharing each X slab
    (1, 2, 4; docs/kernels-notes.md "v22"). The stage's value room is an argument of the launch. ``stamps``: the
    time-stamp probe build (``spmm_ws_probe``), never a product's. ``alt``: two warpgroups share one tile row
    and take its steps in turn (docs/kernels-notes.md "v23")."""
    regs = regs or max_registers(nt, wg)
    key = ((nt, stages, wg, window, regs) + ((cluster,) if cluster > 1 else ()) + (("stamps",) if stamps else ())
           + (("alt",) if alt else ()))
    if key not in _KERNELS:
        _KERNELS[key] = kcache.tag(_build(nt, stages, wg, window, regs, cluster, stamps, alt), "spmm_ws", key)
    return _KERNELS[key]


if SIM:
    def _popc(v):
        """``cuda.popc`` outside a kernel's own module under the simulator (spmm_pf runs ``_publish_table`` too)."""
        return bin(int(v) & 0xFFFFFFFF).count("1")
else:  # pragma: no cover - GPU only
    @cuda.jit(device=True, inline="always")
    def _popc(v):
        return cuda.popc(v)


@_device
def _publish_table(d32, d64, scr, tid, lane, tb):
    """The table warp fills the decode table of the GroupTile staged at shared address ``tb`` (table, bitmaps,
    values). Per half ``h`` (rows 0-3, 4-7) and pair ``p`` of BitmapTiles (``2 p``, ``2 p + 1``): at ``tb + 512 h +
    16 p`` their two half-words of the bitmap, then the same with each bit pair's low bit flipped where its
    high bit is clear (the lane's selector index for ``strip_a16``); at ``tb + 1024 + 256 h + 8 p`` the shared
    addresses of the two halves' first values. Lane ``l`` takes pair ``l``; one warp scan gives the starts."""
    q0, q1 = lds128b(d64, tb + u32(TABLE_BYTES) + u32(16) * lane)
    h0 = u32(q0 & u64(0xFFFFFFFF))
    h1 = u32(q0 >> u64(32))
    h2 = u32(q1 & u64(0xFFFFFFFF))
    h3 = u32(q1 >> u64(32))
    c0 = u32(_popc(h0))
    c1 = u32(_popc(h1))
    c2 = u32(_popc(h2))
    tot = c0 + c1 + c2 + u32(_popc(h3))
    a0 = tb + u32(TABLE_BYTES + BITMAP_BYTES) + u32(2) * (wscan(scr, tid, tot) - tot)
    a1 = a0 + u32(2) * c0
    a2 = a1 + u32(2) * c1
    a3 = a2 + u32(2) * c2
    sts128(d32, tb + u32(16) * lane, h0, h2, _selectors(h0), _selectors(h2))
    sts128(d32, tb + u32(512) + u32(16) * lane, h1, h3, _selectors(h1), _selectors(h3))
    sts64b(d64, tb + u32(1024) + u32(8) * lane, u64(a0) | (u64(a2) << u64(32)))
    sts64b(d64, tb + u32(1280) + u32(8) * lane, u64(a1) | (u64(a3) << u64(32)))


@_device
def _selectors(h):
    """Each bit pair (b1, b0) of ``h`` as ``strip_a16``'s index: 00 -> 01, 01 -> 00, 10 and 11 stay."""
    return h ^ (((h >> u32(1)) ^ u32(0xFFFFFFFF)) & u32(0x55555555))


def make_roles(NT: int, STAGES: int, TG: int, WIN: int = WINDOW, CL: int = 1, STAMP: bool = False):
    """``(publish, produce)``: the table warp's and the copy warp's loops over a ring of ``STAGES`` stages, each
    an X slab of ``NT`` tokens, then ``TG`` tile rows' slots (table, bitmaps, values; ``SLOT`` bytes each, an
    argument); shared by spmm_ws and spmm_pf."""
    XBYTES = NT * 128

    @cuda.jit(device=True, inline="always")
    def offsets(goff, lane, i, rot, nst, k0, tr0, nr, GK):
        """Lane l: the ``gtile_offsets`` pairs of step ``i + l`` (both tile rows), zeros past the range."""
        a0 = u32(0)
        a1 = u32(0)
        b0 = u32(0)
        b1 = u32(0)
        j = i + lane
        if j < nst and lane < WIN and (CL == 1 or nr > 0):       # (a cluster's rank past the rows: none)
            gk = step_col(j, rot, nst, k0)
            gt = tr0 * GK + gk
            a0 = u32(goff[gt])
            a1 = u32(goff[gt + 1])
            if nr > 1:
                b0 = u32(goff[gt + GK])
                b1 = u32(goff[gt + GK + 1])
        return a0, a1, b0, b1

    @cuda.jit(device=True, inline="always")
    def publish(d32, d64, scr, tid, lane, raw, full, j, nr, SLOT, ws, sb0, t0):
        """Step ``j``'s copies have landed ("raw"): the whole warp fills each tile row's decode table, then
        releases the stage to the consumers ("full")."""
        s = j % STAGES
        mbar_wait(raw, s, (j // STAGES) & 1)
        if STAMP and lane == 0:
            stamp(ws, sb0 + j * 8 + 7, t0)
        tb = byte_addr(d64, 0) + u32(s * (XBYTES + TG * SLOT) + XBYTES)
        _publish_table(d32, d64, scr, tid, lane, tb)
        if nr > 1:
            _publish_table(d32, d64, scr, tid, lane, tb + u32(SLOT))
        wsync(scr, tid)                              # every lane's entries before the release
        if lane == 0:
            mbar_arrive(full, s)

    @cuda.jit(device=True, inline="always")
    def produce(d64, scr, tid, lane, bm, vals, goff, xs, raw, empty, chunk, tr0, nr, rot, nst, k0, GK, SLOT,
                xempty, rank, ws, sb0, t0):
        """The copy warp: offsets loaded one window (32 steps) ahead; per step, lane 0's copies into a freed
        stage, completing on "raw" (the table warp takes it from there). In a cluster (``CL`` > 1) each block
        copies its own GroupTile, tells the leader (rank 0, ``xempty``) that the stage is free and expects X,
        and the leader multicasts the X slab into every block's stage."""
        a0, a1, b0, b1 = offsets(goff, lane, 0, rot, nst, k0, tr0, nr, GK)
        n0, n1, m0, m1 = offsets(goff, lane, WIN, rot, nst, k0, tr0, nr, GK)
        for i in range(nst):
            if i % WIN == 0 and i > 0:               # lane l: the offsets of step i + l, loaded a window ago
                a0, a1, b0, b1 = n0, n1, m0, m1
                n0, n1, m0, m1 = offsets(goff, lane, i + WIN, rot, nst, k0, tr0, nr, GK)
            v0 = wshfl_idx(scr, tid, a0, i % WIN)
            v1 = wshfl_idx(scr, tid, a1, i % WIN)
            w0 = wshfl_idx(scr, tid, b0, i % WIN)
            w1 = wshfl_idx(scr, tid, b1, i % WIN)
            if lane == 0:
                s = i % STAGES
                if i >= STAGES:
                    mbar_wait(empty, s, ((i // STAGES) - 1) & 1)
                if STAMP:
                    stamp(ws, sb0 + i * 8 + 5, t0)
                gk = step_col(i, rot, nst, k0)
                gt = tr0 * GK + gk
                st = (s * (XBYTES + TG * SLOT)) >> 3     # the stage, in 8-byte words of the dynamic array
                nb = XBYTES + BITMAP_BYTES + 2 * (v1 - v0)
                if nr > 1:
                    nb += BITMAP_BYTES + 2 * (w1 - w0)
                if CL > 1 and nr <= 0:
                    nb = XBYTES                          # a rank past the weight's rows: only X lands here
                mbar_expect(raw, s, nb)
                if CL > 1:
                    mbar_arrive_remote(xempty, s, 0)     # after the expect: the X bytes may land from now on
                else:
                    bulk_copy(d64, st, xs, (chunk * GK + gk) * (XBYTES >> 3), XBYTES, raw, s)
                if CL == 1 or nr > 0:
                    dst = st + ((XBYTES + TABLE_BYTES) >> 3)
                    bulk_copy(d64, dst, bm, gt * 64, BITMAP_BYTES, raw, s)
                    if v1 > v0:
                        bulk_copy(d64, dst + (BITMAP_BYTES >> 3), vals, v0 >> 2, 2 * (v1 - v0), raw, s)
                    if nr > 1:
                        dst += SLOT >> 3
                        bulk_copy(d64, dst, bm, (gt + GK) * 64, BITMAP_BYTES, raw, s)
                        if w1 > w0:
                            bulk_copy(d64, dst + (BITMAP_BYTES >> 3), vals, w0 >> 2, 2 * (w1 - w0), raw, s)
                if CL > 1 and rank == 0:                 # every block's stage s free and expecting: one X copy
                    mbar_wait(xempty, s, (i // STAGES) & 1)
                    bulk_copy_mc(d64, st, xs, (chunk * GK + gk) * (XBYTES >> 3), XBYTES, raw, s, (1 << CL) - 1)
                if STAMP:
                    stamp(ws, sb0 + i * 8 + 6, t0)

    return publish, produce


def _build(NT: int, STAGES: int, WG: int, WIN: int = WINDOW, REGS: int = 128, CL: int = 1, STAMP: bool = False,
           ALT: bool = False):
    assert NT in NTS and 2 <= STAGES <= 8 and WG in (1, 2) and 1 <= WIN <= 32 and CL in (1, 2, 4)
    assert CL == 1 or WG == 1
    assert not ALT or (WG == 2 and CL == 1)
    CW = 4 * WG
    TG = 1 if ALT else WG                    # tile rows per block (ALT: the warpgroups take turns on one)
    THREADS = 32 * block_warps(WG)
    NACC = NT // 2
    XBYTES = NT * 128
    ROWS = 64 * TG
    TILE = NT * ROWS
    tile_end = make_tile_end(TILE, ROWS, THREADS, tile_ld(ROWS))
    _, _, _, _, acc_store, block_piece = make_tile_ops(NT, 1, TG)
    ZERO = (np.float32(0.0),) * NACC

    # acc_add: acc_store's layout for one tile row, adding the warp's accumulators to what is there
    acc_add = unrolled("acc_add", "df, acc, wwarp, g, t", [f"b = 2 * t * {tile_ld(64)} + wwarp * 16 + g"] +
                       [f"df[b + {o}] = df[b + {o}] + acc[{i}]" for o, i in acc_offsets(NT, tile_ld(64))])

    publish, produce = make_roles(NT, STAGES, TG, WIN, CL, STAMP)

    @cuda.jit(**({} if SIM else {"max_registers": REGS}))
    def kernel(bm, vals, goff, xs, y, ws, cnt, M, N, GK, nch, PER, SLOT):
        d64, d32, df = dynamic_smem()
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        flag = cuda.shared.array(1, np.int32)
        full = cuda.shared.array(STAGES, np.uint64)
        empty = cuda.shared.array(STAGES, np.uint64)
        raw = cuda.shared.array(STAGES, np.uint64)
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
                mbar_init(raw, s, 1)
                mbar_init(full, s, 1)
                mbar_init(empty, s, 4 if ALT else CW)
                if CL > 1:
                    mbar_init(xempty, s, CL)
        cuda.syncthreads()
        if CL > 1:
            cluster_sync()                                   # every block's barriers set up before any remote use
        if STAMP:                                            # probe builds: 8 stamps per step (spmm_ws_probe),
            t0 = clock32()                                   # then the block's row: SM, start and end (ns)
            g0 = gtimer32()
            sb0 = b * (PER + 1) * 8
        else:
            t0 = u32(0)
            g0 = u32(0)
            sb0 = 0
        acc = ZERO
        if warp == CW:
            produce(d64, scr, tid, lane, bm, vals, goff, xs, raw, empty, chunk, tr0, nr, rot, nst, k0, GK, SLOT,
                    xempty, rank, ws, sb0, t0)
        elif warp == CW + 1:
            for j in range(nst):
                publish(d32, d64, scr, tid, lane, raw, full, j, nr, SLOT, ws, sb0, t0)
        else:
            pos = u32(8 * (g & 3) + 2 * t)          # the lane's two bits in its half-word of each BitmapTile
            lmask = (u32(1) << pos) - u32(1)
            hsel = u32(lane >> 4)                     # rows 4-7 (g >= 4): the high half-word
            sp = u32(0)
            gofs = u32(XBYTES + (0 if ALT else wg) * SLOT)  # the GroupTile in a stage: table, bitmaps, values
            stb = u32(XBYTES + TG * SLOT)                    # a stage's bytes
            stamper = ((tid & 127) == 0) if ALT else (tid == 0)   # (ALT: a step's own warpgroup stamps it)
            wvsel = u32(512) * hsel + u32(128) * u32(wwarp)             # the table of this warp's BitmapTiles in
            asel = u32(1024) + u32(256) * hsel + u32(64) * u32(wwarp)  # the lane's half: words, value addresses
            i0 = wg if ALT else 0                            # ALT: warpgroup w takes steps w, w + 2, ...
            di = 2 if ALT else 1
            s = u32(i0)                                      # this step's stage and its phase
            ph = u32(0)
            for i in range(i0, nst, di):
                if STAMP and stamper:
                    stamp(ws, sb0 + i * 8, t0)
                acc = wg_wait0(acc)                          # the previous step's products: done, so their A
                if i >= di and lane == 0:                    # registers are free and their stage too (released
                    mbar_arrive(empty, sp)                   # before waiting: the producer's tables lag its
                if STAMP and stamper:
                    stamp(ws, sb0 + i * 8 + 1, t0)
                mbar_wait(full, s, ph)                       # copies, so it waits on this stage to go on)
                if STAMP and stamper:
                    stamp(ws, sb0 + i * 8 + 2, t0)
                sb = ring + s * stb                          # shared addresses throughout
                if ALT or wg < nr:                           # (a warpgroup past the weight's rows only keeps time)
                    da = strip_a16(scr, tid, d64, d32, sb + gofs + wvsel, sb + gofs + asel, lmask, pos)
                    if STAMP and stamper:
                        stamp(ws, sb0 + i * 8 + 3, t0)
                    xd = x_desc(sb)                              # the K parts' descriptors: +256 bytes each
                    acc = wg_mmad(scr, tid, da, xd, xd + u64(16), xd + u64(32), xd + u64(48), acc)
                    wg_commit()
                    if STAMP and stamper:
                        stamp(ws, sb0 + i * 8 + 4, t0)
                sp = s
                if ALT:
                    s += u32(2)
                    if s >= u32(STAGES):
                        s -= u32(STAGES)
                        ph ^= u32(1)
                else:
                    s += u32(1)
                    if s == u32(STAGES):
                        s = u32(0)
                        ph ^= u32(1)
            acc = wg_wait0(acc)
        cuda.syncthreads()                                   # every copy consumed: the ring is free
        if ALT:                                              # the second warpgroup's partial tile, then the first's
            if warp >= 4 and warp < CW:                      # added to it
                acc_store(df, acc, acc, 0, wwarp, g, t)
            cuda.syncthreads()
            if warp < 4:
                acc_add(df, acc, wwarp, g, t)
        elif warp < CW:
            acc_store(df, acc, acc, wg, wwarp, g, t)
        cuda.syncthreads()
        q0, q1 = split_sharers(tt, GK, PER)
        if CL == 1 or nr > 0:
            tile_end(df, y, ws, cnt, flag, tid, M, N, tr0 * 64, n0, tt, GK, b, nst, q0, q1)
        if STAMP and tid == 0:
            block_row(ws, sb0 + PER * 8, g0)
        if CL > 1:
            cluster_sync()                                   # no block leaves while another may still signal it

    return kernel


def tcabme_ws_matmul(x: torch.Tensor, w, out: torch.Tensor | None = None, tokens: int | None = None,
                     stages: int | None = None, groups: int | None = None, splits: int | None = None,
                     window: int = WINDOW, regs: int | None = None, cluster: int = 1, alt: bool = False,
                     slabs: torch.Tensor | None = None, record=None) -> torch.Tensor:
    """``x @ W^T`` for fp16 ``x`` [N, K] and a TCA-BME weight ``w`` (``packed.tcabme.TcaBme``, fp16, on x's
    device) through this kernel (Hopper, or the simulator): ``[N, M]`` fp16, into ``out`` if given. The
    keywords force the plan (``ws_plan``) and the register cap; ``cluster`` (2, 4; not in the simulator,
    which runs one block at a time) shares each X slab across that many tile rows (docs/kernels-notes.md
    "v22": correct, and slower than without on every shape measured); ``alt``: two warpgroups take turns on
    each block's tile row (v23); ``slabs``: X already rewritten as the kernel reads it (``sp24_ws.x_slabs``
    at the plan's tile width, ``matmul.slab_tokens``); ``record``: a key under which the launch is kept
    (``launch.replay``)."""
    return ws_launch(x, w, out, tokens, stages, groups, splits, window, regs, cluster, alt=alt, slabs=slabs,
                     record=record)[0]


def ws_launch(x: torch.Tensor, w, out: torch.Tensor | None = None, tokens: int | None = None,
              stages: int | None = None, groups: int | None = None, splits: int | None = None,
              window: int = WINDOW, regs: int | None = None, cluster: int = 1, stamps: bool = False,
              alt: bool = False, slabs: torch.Tensor | None = None, record=None):
    """``(y, plan, stamps)``: ``tcabme_ws_matmul``'s product with the ``RowsPlan`` it launched (None for an empty
    product). ``stamps``: the time-stamp build (``spmm_ws_probe``) writes into a zeroed float32 buffer instead
    of the split-K workspace, returned as [blocks, steps + 1, 8] (the plan must not split K; the last row of a
    block: its SM, start and end, ``spmm_ws_probe``); else None."""
    from . import launch
    from .sp24_ws import slabs_or_make
    from .io import output_for, padded

    if x.dim() != 2 or x.dtype != torch.float16 or w.dtype != torch.float16:
        raise ValueError(f"tcabme_ws_matmul expects fp16 x [N, K] and an fp16 weight, got {x.dtype} {w.dtype}")
    m, k = w.shape
    n = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but the weight expects {k}")
    out = output_for(x, m, out)
    if n == 0 or m == 0:
        return out, None, None
    gm, gk = w.grid
    x = padded(x, gk * 64)
    vbytes = value_room(w)
    if cluster > 1 and SIM:
        raise ValueError("the simulator runs one block at a time: spmm_ws with cluster > 1 runs on a GPU only")
    p, _r, wg = ws_plan(m, gk, n, launch.sm_count(x.device), tokens, stages, groups, splits, vbytes, regs, cluster,
                        alt)
    if stamps:
        if p.partial:
            raise ValueError("the time-stamp build writes where split-K partials go: force splits=1")
        wsp = torch.zeros(p.blocks * (p.per + 1) * 8, dtype=torch.float32, device=x.device)
        cnt = torch.zeros(max(p.tiles, 1), dtype=torch.int32, device=x.device)
    else:
        wsp, cnt = launch.workspace(x.device, p.workspace_floats(), p.tiles)
    vals = w.values.contiguous() if w.values.numel() else torch.zeros(8, dtype=torch.float16, device=x.device)
    tensors = (w.bitmaps.view(torch.int64), vals.view(torch.int64), w.gtile_offsets, slabs_or_make(x, p.nt, slabs),
               out.reshape(-1).view(torch.int16), wsp, cnt)
    launch.launch_tensors(get_kernel(p.nt, p.stages, wg, window, regs, cluster, stamps, alt), p.blocks,
                          32 * block_warps(wg), tensors, (m, n, gk, p.chunks, p.per, slot_bytes(vbytes)), dyn=p.dyn,
                          cluster=cluster, record=None if record is None or stamps else (record, 3, 4, p.nt))
    return out, p, wsp.view(p.blocks, p.per + 1, 8) if stamps else None
