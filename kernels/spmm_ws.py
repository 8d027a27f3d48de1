"""TCA-BME decoded once per tile into warpgroup A registers (issue 21, docs/kernels-notes.md "v19"):
``sp24_ws``'s warp-specialized skeleton with the packed GroupTile as the operand source. **Opt-in**
(``tcabme_ws_matmul``) until a GPU session has timed it against spmm_warp and spmm_rows.

- **Warps**: ``WG`` consumer warpgroups, one 64-row GroupTile row each, and one producer warp (the last).
- **Producer** (the whole warp; lane 0 issues): every ``WINDOW`` (32) steps each lane loads the ``gtile_offsets`` pair
  of one coming step and tile row, so the step loop never waits on a global load; lane 0 takes each
  step's pair by shuffle. Per step, into ring stage ``s`` once freed ("empty"), bulk copies completing on
  "full": the X slab (``sp24_ws.x_slabs``), and per tile row the GroupTile's 64 bitmaps (512 bytes) and
  its values (16-byte aligned and padded by the format; none for an all-zero GroupTile).
- **Consumers**: wait "full", retire the previous products (``wg_wait0``), release the previous stage,
  then decode: each lane popcounts two of the GroupTile's bitmaps, two warp scans give every
  BitmapTile's first value, and each lane builds its 16 A registers of the warp's strip (``mma.sync``'s
  m16n8k16 fragment of each 16-column TCTile: BitmapTiles top-left, bottom-left, top-right,
  bottom-right, bit ``8 row + col``), a value where its bit is set and zero elsewhere. One ``wg_mmad``
  (four dense m64nNk16 products) per step. The decode is per tile: nothing in it grows with the tokens.
- **End**: ``block.make_tile_end``, as sp24_ws.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import cuda

from . import kcache
from ._intrinsics import SCRATCH_WORDS, SIM, bulk_copy, mbar_arrive, mbar_expect, mbar_init, mbar_wait
from ._warp_intrinsics import byte_addr
from ._wg_intrinsics import popc64, wg_commit, wg_mmad, wg_wait0, wshfl_idx, wshfl_up
from .block import dynamic_smem, make_tile_end, split_sharers, step_col, thread_ids
from .sp24_wg import NTS, _device, make_tile_ops, x_desc
from .sp24_ws import max_registers

BITMAP_BYTES = 512                      # a GroupTile's 64 bitmaps
VALUE_BYTES = 8192                      # the most values a GroupTile holds (all 4096, fp16)
SLOT = BITMAP_BYTES + VALUE_BYTES       # a tile row's part of a stage
WINDOW = 32                             # steps whose offsets the producer warp loads at once (one per lane)
_KERNELS: dict = {}


def stage_bytes(nt: int, wg: int) -> int:
    return nt * 128 + wg * SLOT


def smem_bytes(nt: int, stages: int, wg: int) -> int:
    """Dynamic shared bytes: the ring, reused for the block's fp32 tile at the end."""
    return max(stages * stage_bytes(nt, wg), nt * 64 * wg * 4)


def get_kernel(nt: int, stages: int, wg: int = 2, window: int = WINDOW):
    """Kernel for ``nt`` tokens per output tile (8 .. 128), a ring of ``stages`` (2-8) and ``wg`` consumer
    warpgroups (1, 2), one GroupTile row each; ``window``: steps per offset load (tests shorten it)."""
    key = (nt, stages, wg, window)
    if key not in _KERNELS:
        _KERNELS[key] = kcache.tag(_build(nt, stages, wg, window), "spmm_ws", key)
    return _KERNELS[key]


@_device
def _scan(scr, tid, lane, c):
    """Inclusive warp prefix sum of ``c`` (uint32)."""
    s = c
    for d in (1, 2, 4, 8, 16):
        v = wshfl_up(scr, tid, s, d)
        if lane >= d:
            s += v
    return s


@_device
def _value(d32, vbase, p):
    """The fp16 bits of value ``p`` of the staged GroupTile whose values start at byte ``vbase``."""
    w = d32[(vbase >> 2) + (p >> 1)]
    return (w >> np.uint32(16 * (p & 1))) & np.uint32(0xFFFF)


@_device
def _a_word(d64, d32, scr, tid, src, bt, bbase, vbase, bit):
    """One A register: (value at ``bit``, value at ``bit + 1``) of BitmapTile ``bt`` (its first value held by
    lane ``bt & 31`` in ``src``), zeros where the bitmap has no bit. ``bbase``, ``vbase``: byte offsets of
    the staged bitmaps and values in the dynamic shared arrays (offsets, not shared addresses)."""
    start = wshfl_idx(scr, tid, src, bt & 31)
    bm = d64[(bbase >> 3) + bt]
    below = popc64(bm & ((np.uint64(1) << np.uint64(bit)) - np.uint64(1)))
    lo = np.uint32(0)
    hi = np.uint32(0)
    p = start + below
    if (bm >> np.uint64(bit)) & np.uint64(1):
        lo = _value(d32, vbase, p)
        p += np.uint32(1)
    if (bm >> np.uint64(bit + 1)) & np.uint64(1):
        hi = _value(d32, vbase, p)
    return lo | (hi << np.uint32(16))


def _build(NT: int, STAGES: int, WG: int, WIN: int = WINDOW):
    assert NT in NTS and 2 <= STAGES <= 8 and WG in (1, 2) and 1 <= WIN <= 32
    CW = 4 * WG
    THREADS = 32 * (CW + 1)
    NACC = NT // 2
    XBYTES = NT * 128
    STAGE = stage_bytes(NT, WG)
    ROWS = 64 * WG
    TILE = NT * ROWS
    tile_end = make_tile_end(TILE, ROWS, THREADS)
    piece, _, _, _, acc_store = make_tile_ops(NT, 1, WG)
    ZERO = (np.float32(0.0),) * NACC
    u32 = np.uint32

    @cuda.jit(device=True, inline="always")
    def produce(d64, scr, tid, lane, bm, vals, goff, xs, full, empty, chunk, tr0, nr, rot, nst, k0, GK):
        """The producer warp: offsets prefetched 32 steps at a time, lane 0's copies per step."""
        a0 = u32(0)
        a1 = u32(0)
        b0 = u32(0)
        b1 = u32(0)
        for i in range(nst):
            if i % WIN == 0:                         # lane l: the offsets of step i + l
                j = i + lane
                if j < nst and lane < WIN:
                    gk = step_col(j, rot, nst, k0)
                    gt = tr0 * GK + gk
                    a0 = u32(goff[gt])
                    a1 = u32(goff[gt + 1])
                    if nr > 1:
                        b0 = u32(goff[gt + GK])
                        b1 = u32(goff[gt + GK + 1])
            v0 = wshfl_idx(scr, tid, a0, i % WIN)
            v1 = wshfl_idx(scr, tid, a1, i % WIN)
            w0 = wshfl_idx(scr, tid, b0, i % WIN)
            w1 = wshfl_idx(scr, tid, b1, i % WIN)
            if lane == 0:
                s = i % STAGES
                if i >= STAGES:
                    mbar_wait(empty, s, ((i // STAGES) - 1) & 1)
                gk = step_col(i, rot, nst, k0)
                gt = tr0 * GK + gk
                st = (s * STAGE) >> 3            # the stage, in 8-byte words of the dynamic array
                nb = XBYTES + BITMAP_BYTES + 2 * (v1 - v0)
                if nr > 1:
                    nb += BITMAP_BYTES + 2 * (w1 - w0)
                mbar_expect(full, s, nb)
                bulk_copy(d64, st, xs, (chunk * GK + gk) * (XBYTES >> 3), XBYTES, full, s)
                dst = st + (XBYTES >> 3)
                bulk_copy(d64, dst, bm, gt * 64, BITMAP_BYTES, full, s)
                if v1 > v0:
                    bulk_copy(d64, dst + (BITMAP_BYTES >> 3), vals, v0 >> 2, 2 * (v1 - v0), full, s)
                if nr > 1:
                    dst += SLOT >> 3
                    bulk_copy(d64, dst, bm, (gt + GK) * 64, BITMAP_BYTES, full, s)
                    if w1 > w0:
                        bulk_copy(d64, dst + (BITMAP_BYTES >> 3), vals, w0 >> 2, 2 * (w1 - w0), full, s)

    @cuda.jit(**({} if SIM else {"max_registers": max_registers(NT, 1, WG)}))
    def kernel(bm, vals, goff, xs, y, ws, cnt, M, N, GK, nch, PER):
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
        acc = ZERO
        if warp == CW:
            produce(d64, scr, tid, lane, bm, vals, goff, xs, full, empty, chunk, tr0, nr, rot, nst, k0, GK)
        else:
            hi = wwarp >> 1                          # the warp's strip: BitmapTiles 16 wwarp .. (scan half hi)
            bt0 = (wwarp & 1) * 16
            bit = u32(8 * g + 2 * t)
            for i in range(nst):
                s = i % STAGES
                mbar_wait(full, s, (i // STAGES) & 1)
                acc = wg_wait0(acc)
                if i > 0 and lane == 0:
                    mbar_arrive(empty, (i - 1) % STAGES)
                so = u32(s * STAGE)                          # offsets into the arrays; the descriptors
                sb = ring + so                               # take shared addresses (static arrays first)
                bbase = so + u32(XBYTES + wg * SLOT)
                vbase = bbase + u32(BITMAP_BYTES)
                # every BitmapTile's first value: lanes hold tiles lane (strips 0-1) and 32 + lane (2-3)
                c0 = popc64(d64[(bbase >> 3) + lane])
                c1 = popc64(d64[(bbase >> 3) + 32 + lane])
                s0 = _scan(scr, tid, lane, c0)
                s1 = _scan(scr, tid, lane, c1)
                tot0 = wshfl_idx(scr, tid, s0, 31)
                src = (tot0 + s1 - c1) if hi else (s0 - c0)
                bb = bt0 + 32 * hi
                da = (_a_word(d64, d32, scr, tid, src, bb + 0, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 1, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 2, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 3, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 4, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 5, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 6, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 7, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 8, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 9, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 10, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 11, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 12, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 13, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 14, bbase, vbase, bit),
                      _a_word(d64, d32, scr, tid, src, bb + 15, bbase, vbase, bit))
                acc = wg_mmad(scr, tid, da, x_desc(sb), x_desc(sb + u32(256)), x_desc(sb + u32(512)),
                              x_desc(sb + u32(768)), acc)
                wg_commit()
            acc = wg_wait0(acc)
        cuda.syncthreads()                                   # every copy consumed: the ring is free
        if warp < CW:
            acc_store(df, acc, acc, wg, wwarp, g, t)
        cuda.syncthreads()
        q0, q1 = split_sharers(tt, GK, PER)
        tile_end(df, y, ws, cnt, flag, tid, M, N, tr0 * 64, n0, tt, GK, b, nst, q0, q1)

    return kernel


def tcabme_ws_matmul(x: torch.Tensor, w, out: torch.Tensor | None = None, tokens: int | None = None,
                     stages: int | None = None, groups: int | None = None, splits: int | None = None,
                     window: int = WINDOW) -> torch.Tensor:
    """``x @ W^T`` for fp16 ``x`` [N, K] and a TCA-BME weight ``w`` (``packed.tcabme.TcaBme``, fp16, on x's
    device) through this kernel (Hopper, or the simulator): ``[N, M]`` fp16, into ``out`` if given."""
    from . import launch
    from .sp24_ws import x_slabs
    from .io import output_for, padded

    if x.dim() != 2 or x.dtype != torch.float16 or w.dtype != torch.float16:
        raise ValueError(f"tcabme_ws_matmul expects fp16 x [N, K] and an fp16 weight, got {x.dtype} {w.dtype}")
    m, k = w.shape
    n = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but the weight expects {k}")
    out = output_for(x, m, out)
    if n == 0 or m == 0:
        return out
    gm, gk = w.grid
    x = padded(x, gk * 64)
    p, _r, wg = ws_plan(m, gk, n, launch.sm_count(x.device), tokens, stages, groups, splits)
    wsp, cnt = launch.workspace(x.device, p.workspace_floats(), p.tiles)
    vals = w.values.contiguous() if w.values.numel() else torch.zeros(8, dtype=torch.float16, device=x.device)
    tensors = (w.bitmaps.view(torch.int64), vals.view(torch.int64), w.gtile_offsets, x_slabs(x, p.nt),
               out.reshape(-1).view(torch.int16), wsp, cnt)
    launch.launch_tensors(get_kernel(p.nt, p.stages, wg, window), p.blocks, 32 * (4 * wg + 1), tensors,
                          (m, n, gk, p.chunks, p.per), dyn=p.dyn)
    return out


def ws_plan(m: int, gk: int, n: int, sms: int = 132, tokens: int | None = None, stages: int | None = None,
            groups: int | None = None, splits: int | None = None):
    """``(RowsPlan, 1, WG)``: sp24_ws's plan for a weight with dense tiles (one tile row per warpgroup:
    ``sp24_plan.ws_shape``, ``ws_splits``) with this kernel's stage size."""
    from .sp24_plan import wg_plan

    p, r, wg, _ = wg_plan(m, gk, n, sms, tokens, splits, stages, None, groups, specialized=True, hybrid=True,
                          smem=lambda nt, st, _r, wg: smem_bytes(nt, st, wg))
    return p, r, wg
