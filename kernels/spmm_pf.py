"""TCA-BME prefill in one kernel (issue 21 item 2, docs/kernels-notes.md "v29"): spmm_ws's warp-specialized
skeleton with a wide token tile, where each consumer warpgroup decodes its GroupTile into a dense A tile in shared
memory and multiplies it with the warpgroup MMA taking both operands from shared memory (Flash-LLM's shape on
Hopper). With no A registers to guard, a step's products run on while the warpgroup decodes the next step, and the
decoded weight never goes through DRAM. GPU: sm_90a; the simulator runs its Python twin.

- **Block**: 11 warps (three in the fullest quarter of the SM: at most 168 registers a thread,
  ``common.quarter_regs``). Warpgroups 0 and 1 are the consumers of GroupTile rows ``2 rb`` and ``2 rb + 1`` and
  all ``NT`` tokens of one chunk; warp 8 copies (spmm_ws's copy role, ``spmm_ws.make_roles``; with ``cluster=2``
  two row blocks share each X slab by multicast) and warps 9 and 10 build the decode table of one tile row each,
  on a ring whose stages are spmm_ws's with two tile rows (the X slab, then per tile row its table, bitmaps and
  values). Both table warps arrive on "full".
- **Consumers**, per step: wait "full", ``strip_a16`` (the warp's strip as ``mma.sync`` A fragments, from the
  table), each fragment word stored into the warpgroup's A tile of this step's parity (two per warpgroup, after the
  ring; K-major 8x8 core matrices as the X slab's: row ``r``, column ``k`` at ``1024 (r >> 3) + 128 (k >> 3) + 16 (r
  & 7) + 2 (k & 7)``; a warp's 32 lanes fill one core matrix a store), fence the writes for the tensor cores, meet
  as a warpgroup, four dense m64nNk16 products from shared memory (``wg_mmss``), commit, then wait for all but that
  group (``wg_wait1``): the previous step's products are done, so its stage is released and its A tile free.
- **End**: ``block.make_tile_end`` (every warp), the fp32 tile ``[NT, 128]`` through shared memory, fp16 out.

On an H100 it is correct and runs at 0.37-0.50x cuBLAS at 2048-4096 tokens, slower than decode + cuBLAS: not a
runtime path. Its ablations (``ABLATIONS``, timed by ``scripts/checks/gpu_spmm_pf.py``) and an earlier form (a
third warpgroup decoding for both, 0.09-0.21x) are in docs/kernels-notes.md "v29".
"""
from __future__ import annotations

import numpy as np
import torch
from numba import cuda

from . import kcache
from ._intrinsics import (SCRATCH_WORDS, SIM, clock32, cluster_rank, cluster_sync, fence_proxy_async, gtimer32,
                          mbar_arrive, mbar_init, mbar_wait)
from ._warp_intrinsics import byte_addr
from ._wg_intrinsics import strip_a16, wg_bar, wg_commit, wg_mmss, wg_wait0, wg_wait1, wsync
from .block import block_row, dynamic_smem, make_tile_end, stamp, thread_ids, tile_bytes, tile_ld
from .common import quarter_regs
from .sp24_wg import _device, make_tile_ops, x_desc
from .spmm_ws import _publish_table, make_roles
from .spmm_ws_plan import slot_bytes

PF_NTS = (64, 128, 192, 256)      # tokens per output tile
THREADS = 352                      # two consumer warpgroups, the copy warp and a table warp per tile row
REGS = quarter_regs(THREADS // 32)  # 168: three warps in the fullest quarter of the SM
A_BYTES = 8192                     # one dense 64x64 fp16 tile
SMEM_MAX = 227 * 1024              # Hopper's opt-in shared memory per block
_KERNELS: dict = {}
u32 = np.uint32
u64 = np.uint64


def stage_bytes(nt: int, vbytes: int) -> int:
    """A stage of the ring: the X slab, two tile rows' slots (``spmm_ws_plan.slot_bytes``)."""
    return nt * 128 + 2 * slot_bytes(vbytes)


def smem_bytes(nt: int, stages: int, vbytes: int) -> int:
    """Dynamic shared bytes: the ring and four A tiles (two per warpgroup), reused for the fp32 tile at the end."""
    return max(stages * stage_bytes(nt, vbytes) + 4 * A_BYTES, tile_bytes(nt, 128))


# Diagnostics: a build named in ABLATIONS leaves that part of every step out (its output is wrong; only its time
# means anything): "no_decode" (no table lookups or A stores: the products run on a stale A tile), "no_mma" (no
# products), "no_fence" (no proxy fence before the warpgroup meets), "wait0" (every step's products are retired
# before the next step's decode: the whole kernel, correct, without the overlap), "no_copies" (a zeroed ring whose
# stages are released at once with no bytes: the table warps and the consumers run on it), "skeleton" (the copies
# and the table warps only: no decode, no products); STAMPS: the whole kernel writing time stamps (``pf_stamps``)
ABLATIONS = ("no_decode", "no_mma", "no_fence", "wait0", "no_copies", "skeleton")
STAMPS = "stamps"
probe_build: list = [None]


def get_kernel(nt: int, stages: int, cluster: int = 1, build: str | None = None):
    """Kernel for ``nt`` tokens a tile (``PF_NTS``), a ring of ``stages`` and thread-block clusters of ``cluster``
    row blocks (1, 2); ``build`` (STAMPS, or one of ABLATIONS, else what ``probe_build[0]`` names): that
    diagnostic build."""
    ab = build or probe_build[0]
    key = (nt, stages) + ((cluster,) if cluster > 1 else ()) + ((ab,) if ab else ())
    if key not in _KERNELS:
        _KERNELS[key] = kcache.tag(_build(nt, stages, ab, cluster), "spmm_pf", key)
    return _KERNELS[key]


def compiled_kernels() -> dict:
    return dict(_KERNELS)


def _build(NT: int, STAGES: int, AB: str | None = None, CL: int = 1):
    assert NT in PF_NTS and 2 <= STAGES <= 6 and (AB is None or AB in ABLATIONS + (STAMPS,)) and CL in (1, 2)
    STAMP = AB == STAMPS
    DECODE, MMA = AB not in ("no_decode", "skeleton"), AB not in ("no_mma", "skeleton")
    FENCE, LAG, COPIES = AB != "no_fence", AB != "wait0", AB != "no_copies"
    XBYTES = NT * 128
    ZERO = (np.float32(0.0),) * (NT // 2)
    tile_end = make_tile_end(NT * 128, 128, THREADS, tile_ld(128))
    _, _, _, _, acc_store, _ = make_tile_ops(NT, 1, 2)
    _, produce = make_roles(NT, STAGES, 2, CL=CL, STAMP=STAMP)

    @_device
    def publish(d32, d64, scr, tid, lane, raw, full, j, r, nr, SLOT, ws, sb0, t0):
        """Step ``j``'s copies have landed ("raw"): the warp fills tile row ``r``'s decode table (a row past the
        weight's: none), then releases its half of the stage to the consumers ("full": two arrivals)."""
        s = j % STAGES
        mbar_wait(raw, s, (j // STAGES) & 1)
        if STAMP and r == 0 and lane == 0:
            stamp(ws, sb0 + j * 8 + 7, t0)           # (probe: the copies landed)
        if r < nr:
            tb = byte_addr(d64, 0) + u32(s * (XBYTES + 2 * SLOT) + XBYTES + r * SLOT)
            _publish_table(d32, d64, scr, tid, lane, tb)
        wsync(scr, tid)                              # every lane's entries before the release
        if lane == 0:
            mbar_arrive(full, s)

    @_device
    def store_a(d32, ab, da):
        """The warp's 16 fragment words into its A tile: word ``4 q + e`` is rows ``g`` (+8 for odd ``e``) and
        columns ``16 q + 2 t`` (+8 for ``e >= 2``); ``ab``: this lane's word of the first (byte offset)."""
        d32[ab >> 2] = da[0]
        d32[(ab + 1024) >> 2] = da[1]
        d32[(ab + 128) >> 2] = da[2]
        d32[(ab + 1152) >> 2] = da[3]
        d32[(ab + 256) >> 2] = da[4]
        d32[(ab + 1280) >> 2] = da[5]
        d32[(ab + 384) >> 2] = da[6]
        d32[(ab + 1408) >> 2] = da[7]
        d32[(ab + 512) >> 2] = da[8]
        d32[(ab + 1536) >> 2] = da[9]
        d32[(ab + 640) >> 2] = da[10]
        d32[(ab + 1664) >> 2] = da[11]
        d32[(ab + 768) >> 2] = da[12]
        d32[(ab + 1792) >> 2] = da[13]
        d32[(ab + 896) >> 2] = da[14]
        d32[(ab + 1920) >> 2] = da[15]

    @cuda.jit(**({} if SIM else {"max_registers": REGS}))
    def kernel(bm, vals, goff, xs, y, ws, cnt, M, N, GK, nch, SLOT):
        d64, d32, df = dynamic_smem()
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        flag = cuda.shared.array(1, np.int32)
        raw = cuda.shared.array(STAGES, np.uint64)
        full = cuda.shared.array(STAGES, np.uint64)
        empty = cuda.shared.array(STAGES, np.uint64)
        if CL > 1:
            xempty = cuda.shared.array(STAGES, np.uint64)  # the leader's: every block's stage free (CL arrivals)
        else:
            xempty = empty
        tid, warp, lane, g, t, _ = thread_ids()
        wg = warp >> 2
        wwarp = warp & 3
        ring = byte_addr(d64, 0)
        b = cuda.blockIdx.x
        if CL > 1:                                     # a cluster: CL row blocks of one token chunk (X multicast)
            rank = cluster_rank()
            c = b // CL
            rq = c // nch
            chunk = c - rq * nch
            rb = rq * CL + rank
        else:
            rank = u32(0)
            rb = b // nch
            chunk = b - rb * nch
        tr0 = 2 * rb
        nr = min(2, (M + 63) // 64 - tr0)
        rot = (rb - rank) % GK                         # one rotation a cluster: its X slabs are one copy
        stb = XBYTES + 2 * SLOT
        if tid == 0:
            for s in range(STAGES):
                mbar_init(raw, s, 1)
                mbar_init(full, s, 2)
                mbar_init(empty, s, 8)
                if CL > 1:
                    mbar_init(xempty, s, CL)
        if not COPIES:
            for e in range(tid, (STAGES * stb) >> 3, THREADS):
                d64[e] = u64(0)
        cuda.syncthreads()
        if CL > 1:
            cluster_sync()                             # every block's barriers set up before any remote use
        t0 = clock32() if STAMP else u32(0)            # probe builds: stamps per step (``pf_stamps``), then the
        g0 = gtimer32() if STAMP else u32(0)           # block's row: SM, start and end (ns)
        sb0 = b * (GK + 1) * 8 if STAMP else 0
        st0 = STAMP and tid == 0                       # (the consumers' stamps: warp 0, lane 0)
        acc = ZERO
        if warp == 8 and not COPIES:                   # (ablation: empty phases on a zeroed ring)
            for i in range(GK):
                if i >= STAGES:
                    mbar_wait(empty, i % STAGES, ((i // STAGES) - 1) & 1)
                if lane == 0:
                    mbar_arrive(raw, i % STAGES)
        elif warp == 8:
            produce(d64, scr, tid, lane, bm, vals, goff, xs, raw, empty, chunk, tr0, nr, rot, GK, 0, GK, SLOT,
                    xempty, rank, ws, sb0, t0)
        elif warp >= 9:
            for j in range(GK):
                publish(d32, d64, scr, tid, lane, raw, full, j, warp - 9, nr, SLOT, ws, sb0, t0)
        else:
            pos = u32(8 * (g & 3) + 2 * t)          # the lane's two bits in its half-word of each BitmapTile
            lmask = (u32(1) << pos) - u32(1)
            hsel = u32(lane >> 4)                     # rows 4-7 (g >= 4): the high half-word
            gofs = u32(XBYTES) + u32(wg) * u32(SLOT)  # the warpgroup's GroupTile in a stage
            wvsel = u32(512) * hsel + u32(128) * u32(wwarp)
            asel = u32(1024) + u32(256) * hsel + u32(64) * u32(wwarp)
            a0 = u32(STAGES) * u32(stb) + u32(2 * A_BYTES) * u32(wg)     # the warpgroup's two A tiles
            lw = u32(2048) * u32(wwarp) + u32(16) * u32(g) + u32(4) * u32(t)   # the lane's first word in one
            s = u32(0)
            ph = u32(0)
            for i in range(GK):
                if st0:
                    stamp(ws, sb0 + i * 8, t0)       # (probe: the step begins)
                mbar_wait(full, s, ph)
                if st0:
                    stamp(ws, sb0 + i * 8 + 2, t0)   # (probe: "full")
                sb = ring + s * u32(stb)
                ab = a0 + u32(A_BYTES) * u32(i & 1)
                if DECODE and wg < nr:               # (a warpgroup past the weight's rows: stale products)
                    da = strip_a16(scr, tid, d64, d32, sb + gofs + wvsel, sb + gofs + asel, lmask, pos)
                    store_a(d32, ab + lw, da)
                if st0:
                    stamp(ws, sb0 + i * 8 + 3, t0)   # (probe: decoded and stored)
                if FENCE:
                    fence_proxy_async()              # the A tile's writes, seen by the tensor cores ...
                wg_bar(scr, tid)                     # ... of the whole warpgroup
                if MMA:
                    xd = x_desc(sb)
                    ad = x_desc(ring + ab)
                    acc = wg_mmss(ad, ad + u64(16), ad + u64(32), ad + u64(48),
                                  xd, xd + u64(16), xd + u64(32), xd + u64(48), acc)
                    wg_commit()
                if st0:
                    stamp(ws, sb0 + i * 8 + 4, t0)   # (probe: met and issued)
                if LAG:
                    acc = wg_wait1(acc)              # step i - 1's products are done: its stage is free
                else:
                    acc = wg_wait0(acc)
                if i >= 1 and lane == 0:
                    mbar_arrive(empty, (s + u32(STAGES - 1)) % u32(STAGES))
                if st0:
                    stamp(ws, sb0 + i * 8 + 1, t0)   # (probe: the previous products retired, their stage free)
                s += u32(1)
                if s == u32(STAGES):
                    s = u32(0)
                    ph ^= u32(1)
            acc = wg_wait0(acc)
        cuda.syncthreads()                             # every copy consumed: the ring is free
        if wg < 2:
            acc_store(df, acc, acc, wg, wwarp, g, t)
        cuda.syncthreads()
        if nr > 0:
            tile_end(df, y, ws, cnt, flag, tid, M, N, tr0 * 64, chunk * NT, b, GK, b, GK, b, b)
        if STAMP and tid == 0:
            block_row(ws, sb0 + GK * 8, g0)
        if CL > 1:
            cluster_sync()                             # no block leaves while another may still signal it

    return kernel


def pf_plan(nt: int, stages: int | None, vbytes: int) -> tuple[int, int]:
    """``(tokens a tile, stages)``: the deepest ring up to 4 that fits (a forced depth that does not fit is a
    ``ValueError``)."""
    if nt not in PF_NTS:
        raise ValueError(f"spmm_pf takes {PF_NTS} tokens a tile, got {nt}")
    st = stages or max(2, min(4, (SMEM_MAX - 2048 - 4 * A_BYTES) // stage_bytes(nt, vbytes)))
    if smem_bytes(nt, st, vbytes) > SMEM_MAX - 2048:
        raise ValueError(f"spmm_pf with {nt} tokens a tile and {st} stages needs {smem_bytes(nt, st, vbytes)} bytes of "
                         "shared memory: fewer stages or tokens")
    return nt, st


def tcabme_pf_matmul(x: torch.Tensor, w, out: torch.Tensor | None = None, tokens: int = 256,
                     stages: int | None = None, cluster: int = 1, slabs: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T`` for fp16 ``x`` [N, K] and an fp16 TCA-BME weight ``w`` through spmm_pf (Hopper, or the
    simulator): ``[N, M]`` fp16, into ``out`` if given. ``tokens`` (tokens a tile) and ``stages`` force the plan;
    ``slabs``: X already rewritten at that width (``sp24_ws.x_slabs``)."""
    return _launch(x, w, out, tokens, stages, cluster, slabs)[0]


def pf_stamps(x: torch.Tensor, w, tokens: int = 256, stages: int | None = None) -> tuple:
    """``(y, stamps, plan)``: ``tcabme_pf_matmul``'s product from the time-stamped build, ``stamps`` [blocks, steps, 8]
    float32 SM cycles since the block's start: consumer (warp 0) 0 the step begins, 2 "full", 3 its A tile stored,
    4 the products issued, 1 the previous products retired and their stage released; copy warp 5 the stage free, 6
    its copies issued; first table warp 7 the copies landed. ``plan``: tokens, stages, blocks, steps, and each
    block's SM and start and end on the GPU's nanosecond timer (low 32 bits), as ``spmm_ws_probe.ws_stamps``'s."""
    if x.dim() != 2 or x.shape[0] == 0 or w.shape[0] == 0:
        raise ValueError("pf_stamps expects x [N, K] with N > 0 and a weight with rows")
    y, nt, st, blocks, gk, buf = _launch(x, w, None, tokens, stages, 1, None, stamps=True)
    buf = buf.view(blocks, gk + 1, 8)
    row = buf[:, -1].to(torch.int64)
    return y, buf[:, :-1], {"tokens": nt, "stages": st, "blocks": blocks, "steps": gk, "sm": row[:, 0],
                            "start_ns": row[:, 1] | (row[:, 2] << 16), "end_ns": row[:, 3] | (row[:, 4] << 16)}


def _launch(x, w, out, tokens, stages, cluster, slabs, stamps: bool = False):
    """``(y, tokens a tile, stages, blocks, tile columns, the stamp buffer or None)`` of one launch."""
    from . import launch
    from .io import output_for, padded
    from .sp24_ws import slabs_or_make
    from .spmm_ws_plan import value_room

    if x.dim() != 2 or x.dtype != torch.float16 or w.dtype != torch.float16:
        raise ValueError(f"tcabme_pf_matmul expects fp16 x [N, K] and an fp16 weight, got {x.dtype} {w.dtype}")
    m, k = w.shape
    n = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but the weight expects {k}")
    out = output_for(x, m, out)
    if n == 0 or m == 0:
        return out, 0, 0, 0, 0, None
    gm, gk = w.grid
    x = padded(x, gk * 64)
    vbytes = value_room(w)
    nt, st = pf_plan(tokens, stages, vbytes)
    nch = -(-n // nt)
    if cluster not in (1, 2) or (cluster > 1 and SIM):
        raise ValueError(f"spmm_pf takes clusters of 1 or 2 blocks (2: on a GPU only), got {cluster}")
    blocks = -(-(-(-gm // 2)) // cluster) * cluster * nch
    if stamps:
        ws = torch.zeros(blocks * (gk + 1) * 8, dtype=torch.float32, device=x.device)
        cnt = torch.zeros(1, dtype=torch.int32, device=x.device)
    else:
        ws, cnt = launch.workspace(x.device, 1, 1)
    vals = w.values.contiguous() if w.values.numel() else torch.zeros(8, dtype=torch.float16, device=x.device)
    tensors = (w.bitmaps.view(torch.int64), vals.view(torch.int64), w.gtile_offsets, slabs_or_make(x, nt, slabs),
               out.reshape(-1).view(torch.int16), ws, cnt)
    kern = get_kernel(nt, st, cluster, STAMPS if stamps else None)
    launch.launch_tensors(kern, blocks, THREADS, tensors, (m, n, gk, nch, slot_bytes(vbytes)),
                          dyn=smem_bytes(nt, st, vbytes), cluster=cluster)
    return out, nt, st, blocks, gk, ws if stamps else None
