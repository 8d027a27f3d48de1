"""Block-level pieces the kernels share: thread ids, the dynamic shared-memory views, the end of a block
whose warps split K (their fp32 sums meet in shared memory, fp16 out: spmm_warp, sp24_kernel), and the
end of a block that runs one K split of an output tile (a whole tile out as fp16, or a partial one
summed by the last of the tile's blocks to arrive: sp24_rows, spmm_rows).

Under the simulator these are plain Python on the running kernel's context (``compat_numba.sim_kernel``):
a device function of another module than the kernel cannot use ``cuda.*`` there (the simulator's
per-call swap of that module's ``cuda`` races between threads).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ._intrinsics import SIM, clock32, f2h, gtimer32, smid, stg_h4
from ._warp_intrinsics import lds_f4

# Where the dynamic shared memory starts. ptxas pads the static arrays up to this, so every ring stage and tile
# slot (multiples of 128 bytes) starts a 128-byte line; at the old 16 a bulk copy into a 4-stage ring (80 bytes
# of static barriers) landed 16-byte aligned only and ran 1.6x slower (docs/kernels-notes.md v34, v35).
SMEM_ALIGN = 128
TILE_PAD = 4   # fp32 words of padding after each token's row of a warpgroup kernel's tile (``tile_ld``)


def tile_ld(rows: int) -> int:
    """The row stride (fp32 words) of a warpgroup kernel's token-major fp32 tile of ``rows`` output rows in shared
    memory: ``rows`` + TILE_PAD. A warp's accumulator store (``sp24_wg.acc_offsets``) writes rows g and tokens 2t:
    at a stride of ``rows`` (a multiple of 32) the four t land in one bank, 4-way conflicts (ncu, H100: 4.2M a
    launch of sp24_ws at 2048 tokens, docs/kernels-notes.md "v33"); 4 more words put them 8 banks apart, and
    keep every row 16-byte aligned for ``lds_f4``."""
    return rows + TILE_PAD


def tile_bytes(nt: int, rows: int) -> int:
    """Shared bytes of a warpgroup kernel's fp32 tile of ``nt`` tokens x ``rows`` output rows (``tile_ld`` apart)."""
    return nt * tile_ld(rows) * 4

if SIM:
    from .compat_numba import sim_kernel, sim_syncthreads as _syncthreads

    def _device(fn):
        return fn

    def _threadfence():
        sim_kernel().threadfence()

    def _atomic_add(arr, i, v):
        return sim_kernel().atomic.add(arr, i, v)

    def thread_ids():
        """(thread, warp, lane, lane // 4, lane % 4, warps in the block)."""
        ctx = sim_kernel()
        tid = ctx.threadIdx.x
        return tid, tid >> 5, tid & 31, (tid & 31) >> 2, tid & 3, ctx.blockDim.x >> 5

    def dynamic_smem():
        """(uint64, uint32, float32) views of the block's dynamic shared memory."""
        ctx = sim_kernel()
        return (ctx.shared.array(0, np.dtype(np.uint64)), ctx.shared.array(0, np.dtype(np.uint32)),
                ctx.shared.array(0, np.dtype(np.float32)))
else:  # pragma: no cover - GPU only
    _device = cuda.jit(device=True, inline="always")

    @cuda.jit(device=True, inline="always")
    def _syncthreads():
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def _threadfence():
        cuda.threadfence()

    @cuda.jit(device=True, inline="always")
    def _atomic_add(arr, i, v):
        return cuda.atomic.add(arr, i, v)

    @cuda.jit(device=True, inline="always")
    def thread_ids():
        """(thread, warp, lane, lane // 4, lane % 4, warps in the block)."""
        tid = cuda.threadIdx.x
        return tid, tid >> 5, tid & 31, (tid & 31) >> 2, tid & 3, cuda.blockDim.x >> 5

    @cuda.jit(device=True, inline="always")
    def dynamic_smem():
        """(uint64, uint32, float32) views of the block's dynamic shared memory, SMEM_ALIGN-byte aligned."""
        return (cuda.shared.array(0, np.uint64, alignment=SMEM_ALIGN),
                cuda.shared.array(0, np.uint32, alignment=SMEM_ALIGN),
                cuda.shared.array(0, np.float32, alignment=SMEM_ALIGN))


def make_warp_sums(R: int, NB: int, NT: int):
    """``warp_sums(df, acc, y, tid, warp, lane, nw, sr, M, n0, N)``: the block's ``nw`` warps each hold
    fp32 accumulators ``acc[r * 4NB + 4jb + i]`` (the m16n8 C fragments of ``R`` strip rows from ``sr`` on
    and ``NB`` blocks of 8 of the ``NT`` token rows from ``n0`` on); sum them over the warps in ``df`` and
    write ``y[n, m]`` (fp16 bits, row-major ``[N, M]``) for rows ``m < M`` and tokens ``n < N``."""
    NACC = 4 * NB

    @_device
    def warp_sums(df, acc, y, tid, warp, lane, nw, sr, M, n0, N):
        g = lane >> 2
        t = lane & 3
        _syncthreads()
        for r in range(R):
            for jb in range(NB):
                for oi in range(4):
                    n = 8 * jb + 2 * t + (oi & 1)
                    if n < NT:
                        df[((warp * R + r) * NT + n) * 16 + g + 8 * (oi >> 1)] = acc[r * NACC + 4 * jb + oi]
        _syncthreads()
        for e in range(tid, R * 16 * NT, 32 * nw):
            r = e // (16 * NT)
            n = (e >> 4) - r * NT
            row = e & 15
            tot = np.float32(0.0)
            for w in range(nw):
                tot += df[((w * R + r) * NT + n) * 16 + row]
            m = (sr + r) * 16 + row
            if m < M and n0 + n < N:
                y[(n0 + n) * M + m] = np.int16(f2h(tot))

    return warp_sums


def make_tile_end(TILE: int, ROWS: int, THREADS: int, LD: int | None = None):
    """``tile_end(df, y, ws, cnt, flag, tid, M, N, m0, n0, tt, GK, b, nst, q0, q1)``: the end of block ``b``'s
    K split of output tile ``tt``, after the block's fp32 tile (``TILE`` = tokens x ``ROWS`` values,
    token-major, from row ``m0`` and token ``n0``, a token's row ``LD`` words after the previous one's: ``ROWS``
    by default, ``tile_ld(ROWS)`` for the warpgroup kernels) is in ``df`` and every thread has passed a barrier.

    The split covered ``nst`` of the tile's ``GK`` columns. A whole tile (``nst == GK``) is written as
    fp16. Otherwise the partial goes to slot ``2b`` of the fp32 workspace ``ws`` (two slots per block,
    ``kernels/work.py``), and the last of the tile's blocks ``q0 .. q1`` to arrive, counted in ``cnt[tt]``,
    sums their slots, writes fp16 and resets the counter (so a CUDA-graph replay needs nothing else).
    ``flag`` is a 1-word shared array. Ends with a barrier. Where ``M`` is a multiple of 4, each thread writes
    4 outputs per 8-byte store (``ROWS`` is a multiple of 64; H100, 22016x4096, docs/kernels-notes.md "v24": one
    value per 2-byte store cost 2:4 weights 114.0 against 103.4-104.8 us at 128 tokens, TCA-BME 136.4 against
    130.1-130.7)."""

    V = 4                      # values per fp16 store where M allows (8 bytes: ROWS and m0 are multiples of 64)
    RV, UNITS = ROWS // V, TILE // V
    LD = LD or ROWS
    GAP = LD - ROWS            # the padding after each token's row
    assert LD % V == 0 and ROWS % V == 0

    # loads in flight a thread at the split's end: 32 in blocks of up to 160 threads (one warpgroup and its producer),
    # 16 in larger ones, so that the end needs no more registers than the step loop (ptxas, sm_90a: sp24_ws at 64
    # tokens 96 with one warpgroup, as before; 32 loads in two warpgroups took 113 against 95, one block an SM less)
    split_sum = make_split_sum(TILE, ROWS, THREADS, 32 if THREADS <= 160 else 16)

    @_device
    def tile_end(df, y, ws, cnt, flag, tid, M, N, m0, n0, tt, GK, b, nst, q0, q1):
        vec = M % V == 0
        if nst == GK:
            if vec:
                for u in range(tid, UNITS, THREADS):
                    n = u // RV
                    e = u * V
                    m = m0 + e - n * ROWS
                    if n0 + n < N and m < M:
                        a, c, d, f = lds_f4(df, e + n * GAP)
                        stg_h4(y, (n0 + n) * M + m, a, c, d, f)
            else:
                for e in range(tid, TILE, THREADS):
                    n = e // ROWS
                    m = m0 + e - n * ROWS
                    if n0 + n < N and m < M:
                        y[(n0 + n) * M + m] = np.int16(f2h(df[e + n * GAP]))
        else:
            wb = 2 * b * TILE
            for u in range(tid, UNITS, THREADS):
                e = u * V
                a, c, d, f = lds_f4(df, e + (u // RV) * GAP)
                ws[wb + e] = a
                ws[wb + e + 1] = c
                ws[wb + e + 2] = d
                ws[wb + e + 3] = f
            _threadfence()
            _syncthreads()
            if tid == 0:
                old = _atomic_add(cnt, tt, 1)
                flag[0] = 1 if old == q1 - q0 else 0
            _syncthreads()
            if flag[0] == 1:
                _threadfence()
                if vec:
                    split_sum(ws, y, tid, M, N, m0, n0, q0, q1)
                else:
                    for e in range(tid, TILE, THREADS):
                        n = e // ROWS
                        m = m0 + e - n * ROWS
                        if n0 + n < N and m < M:
                            tot = np.float32(0.0)
                            for q in range(q0, q1 + 1):
                                tot += ws[2 * q * TILE + e]
                            y[(n0 + n) * M + m] = np.int16(f2h(tot))
                if tid == 0:
                    cnt[tt] = 0
        _syncthreads()

    return tile_end


def make_split_sum(TILE: int, ROWS: int, THREADS: int, most: int = 32):
    """``split_sum(ws, y, tid, M, N, m0, n0, q0, q1)``: the last block of an output tile sums the fp32 partials of
    its blocks ``q0 .. q1`` (slots ``2q`` of ``ws``, token-major, ``ROWS`` values a token) in order of q and writes
    fp16 (``M`` a multiple of 4). Generated so that a thread's loads of ``G`` units (4 values each) of ``P``
    partials at a time are independent of one another: about ``most`` loads in flight a thread and one L2 round
    trip a round, where a loop over units with an inner loop over q waited one round trip per unit and q. H200,
    docs/kernels-notes.md "v42": the K split's end cost 4096x4096 at 64 tokens ~8.6 of its 20.4 us (no step loop:
    13.9 us with 4 splits, 5.3 without). The sum's order (0 + p_q0 + p_q0+1 + ...) is the old one, so the output
    is bit for bit the same."""
    V = 4
    UNITS, RV = TILE // V, ROWS // V
    G = max(1, min(-(-UNITS // THREADS), most // V))     # units a thread sums at once
    P = max(1, min(4, most // (V * G)))                   # partials a round
    lines = []
    for j in range(G):
        lines.append(f"u{j} = base + {j * THREADS}")
        lines.append(f"v{j} = np.uint64(4 * min(u{j}, {UNITS - 1}))")
        lines += [f"s{j}_{c} = np.float32(0.0)" for c in range(V)]

    def round_(p_count):
        out = [f"w{p} = np.uint64({2 * TILE} * (q + {p}))" for p in range(p_count)]
        for p in range(p_count):
            for j in range(G):
                out += [f"s{j}_{c} += ws[w{p} + v{j} + np.uint64({c})]" for c in range(V)]
        return out

    lines.append("q = q0")
    lines.append(f"while q + {P - 1} <= q1:")
    lines += ["    " + x for x in round_(P)] + [f"    q += {P}"]
    if P > 1:
        lines.append("while q <= q1:")
        lines += ["    " + x for x in round_(1)] + ["    q += 1"]
    for j in range(G):
        lines.append(f"if u{j} < {UNITS}:")
        lines.append(f"    n = u{j} // {RV}")
        lines.append(f"    m = m0 + 4 * u{j} - n * {ROWS}")
        lines.append("    if n0 + n < N and m < M:")
        lines.append(f"        stg_h4(y, (n0 + n) * M + m, s{j}_0, s{j}_1, s{j}_2, s{j}_3)")
    body = ["for base in range(tid, %d, %d):" % (UNITS, THREADS * G)] + ["    " + x for x in lines]
    return unrolled("split_sum", "ws, y, tid, M, N, m0, n0, q0, q1", body, stg_h4=stg_h4)


def unrolled(name: str, args: str, lines: list[str], **names):
    """The device function ``def name(args)`` with body ``lines``, generated: for a warp's accumulator tuple
    stored with every index a constant. numba lowers a tuple indexed by a loop variable to a chain of compares
    and branches on every access (~100 instructions a value), which made the tile end of sp24_ws's 128x256
    plan 37% of its time at 2048 tokens (H100, docs/kernels-notes.md "v33")."""
    ns: dict = {"np": np, **names}     # ``names``: the other globals the body calls
    exec(f"def {name}({args}):\n" + "".join(f"    {line}\n" for line in lines), ns)
    return _device(ns[name])


@_device
def split_piece(b, GK, PER, nch, NT):
    """Block ``b``'s K split ``(tt, k0, nst, rb, n0)`` = output tile, its first column, columns, row block,
    first token: split ``b % ksn`` (``PER`` columns, the last split shorter) of output tile ``b // ksn``
    (tiles in order of row block, then token chunk of ``NT``); a tile's splits are neighbouring blocks."""
    ksn = (GK + PER - 1) // PER
    tt = b // ksn
    k0 = (b - tt * ksn) * PER
    rb = tt // nch
    return tt, k0, min(PER, GK - k0), rb, (tt - rb * nch) * NT


@_device
def step_col(i, rot, nst, k0):
    """The tile column of step ``i`` of a K split of ``nst`` columns from ``k0``, rotated by ``rot`` (blocks of
    different row blocks start at different columns, so they do not ask L2 for the same X slice at once)."""
    jj = i + rot
    return k0 + (jj - nst if jj >= nst else jj)


@_device
def split_sharers(tt, GK, PER):
    """The blocks ``(q0, q1)`` of output tile ``tt``'s ``ceil(GK / PER)`` splits (computed after the step
    loop: fewer live registers in it)."""
    ksn = (GK + PER - 1) // PER
    return tt * ksn, tt * ksn + ksn - 1


@_device
def stamp(ws, at, t0):
    """Probe builds (``spmm_ws_probe``, ``sp24_ws_probe``): cycles since ``t0`` (exact below 2^24) into ``ws[at]``."""
    ws[at] = np.float32(np.uint32(clock32() - t0))


@_device
def block_row(ws, at, g0):
    """Probe builds: the block's SM, then its start and end on the GPU's timer, each as two exact 16-bit halves."""
    g1 = gtimer32()
    ws[at] = np.float32(smid())
    ws[at + 1] = np.float32(g0 & np.uint32(0xFFFF))
    ws[at + 2] = np.float32(g0 >> np.uint32(16))
    ws[at + 3] = np.float32(g1 & np.uint32(0xFFFF))
    ws[at + 4] = np.float32(g1 >> np.uint32(16))
