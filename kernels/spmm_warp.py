"""The default TCA-BME kernel (up to 64 tokens per launch): every warp streams its own strips.

spmm.py's kernel moves a whole GroupTile row in lock step (one block barrier, one bulk-copy issue
and one mbarrier wait per step), and its split-K partials make a second trip through global
memory. At decode shapes that serial chain, not bandwidth, set its speed (docs/kernels-notes.md).
Here the warps are independent:

- **Block** = ``R`` strip rows (R = 1, 2 or 4: 16, 32 or 64 outputs) x ``nw`` warps. Warp ``w``
  takes GroupTile columns ``k = w, w + nw, ...`` of those rows (at most 32 steps; a step is R
  strips, contiguous in the format, sharing one X slice): split-K happens inside the block, and at
  the end the warps' fp32 sums meet in shared memory. No partial leaves the SM, no counter, no
  second pass. Block ``b`` starts at its warps' step ``b mod steps`` and wraps around, so that the
  blocks of a launch do not all copy the same X slice (the same L2 lines) at once.
- **Offsets once**: lane ``j`` loads the start and end of the warp's step ``j`` (strip offsets), so
  issuing a step never waits on a global load (one ``shfl`` fetches them).
- **Per-warp ring**: ``STAGES`` shared-memory slots per warp. For a step, 16-byte ``cp.async``
  copies (predicated, no loops) bring the strip's values (from the 16-byte floor of its start),
  its 16 bitmaps (128 B, contiguous in the format) and the N rows of X's 64-column slice. Waiting
  is ``cp.async.wait_group`` + ``__syncwarp``: a scoreboard wait, no spinning, no block barrier.
- **Decode + multiply**: the SMBD decode and ``mma.sync.m16n8k16`` of spmm.py (one popcount per
  strip and a 5-step warp scan per two strips, their counts packed in 16-bit halves; one popc +
  two 16-bit loads + PRMT selects per A register). Token rows
  past N read as zero B fragments.

Under the simulator every warp runs the same number of iterations (its emulated warp exchanges are
block barriers); a warp past its last step decodes an empty strip.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from . import kcache
from ._intrinsics import SCRATCH_WORDS, SIM, cp_wait0, cp_wait1, cp_wait2, mma, ptr_of, shfl_idx, syncwarp
from ._warp_intrinsics import byte_addr, decode_at, lds32b, lds128b, make_step_issue, scan_counts, sts64b
from .block import dynamic_smem, make_warp_sums, thread_ids
from .plan import BMW, DENSE_CHUNKS, MAX_N, MAX_STEPS, MAX_WARPS, WBW, XROW  # noqa: F401 - layout sizes
from .plan import warp_max_registers as max_registers
from .plan import warp_slot_words as slot_words  # noqa: F401 - the kernel's stage layout
from .plan import warp_smem_bytes as smem_bytes  # noqa: F401

_KERNELS: dict = {}
ROT = 1     # blocks start their K loop at different steps (blockIdx mod steps), see _build
PROBE = 0   # diagnostics only (scripts/bench/probe_kernels.py): 1 = stream without decoding, 2 = decode L2-hot data


def compiled_kernels() -> dict:
    """The kernels built so far, by their ``get_kernel`` key (for resource reports)."""
    return dict(_KERNELS)


def get_kernel(n: int, stages: int, cmax: int, r: int = 1, maxreg: int | None = None):
    """Kernel for exactly ``n`` tokens, ``stages`` slots per warp, ``cmax`` value chunks per lane,
    ``r`` (1, 2 or 4) strips per warp-step."""
    maxreg = maxreg or max_registers(n, r)
    key = (n, stages, cmax, r, maxreg, PROBE, ROT)
    if key not in _KERNELS:
        _KERNELS[key] = kcache.tag(_build(n, stages, cmax, r, maxreg, PROBE, ROT), "spmm_warp", key)
    return _KERNELS[key]


def _build(N: int, STAGES: int, CMAX: int, R: int, MAXREG: int, PROBE: int = 0, ROT: int = 1):
    assert 1 <= N <= MAX_N and 2 <= STAGES <= 4 and 1 <= CMAX <= 17 and R in (1, 2, 4)
    NB = (N + 7) // 8          # 8-token mma blocks
    NACC = 4 * NB
    XCH = 8 * N                # 16-byte chunks of one step's X slice
    XIT = (XCH + 31) // 32
    wait = (cp_wait0, cp_wait1, cp_wait2)[STAGES - 2]   # step i landed: STAGES-2 groups may pend
    u32 = np.uint32
    u64 = np.uint64

    step_issue = make_step_issue(CMAX, XIT, 8 * R)
    warp_sums = make_warp_sums(R, NB, N)
    RACC = R * NACC
    TABB = 256                 # bytes of one strip's table

    @cuda.jit(device=True, inline="always")
    def rotated(t, rot, nsw):
        """Step number of the warp's ``t``-th step when it starts at step ``rot``; ``nsw`` (no
        step: the copies are predicated off) once ``t`` runs past the warp's steps. (PROBE 2:
        always step 0.)"""
        if PROBE == 2:
            return u32(0)
        if t >= nsw:
            return nsw
        j = t + rot
        if j >= nsw:
            j -= nsw
        return j

    @cuda.jit(device=True, inline="always")
    def half_bitmap(d32, sb, bmo, k, valid):
        """This lane's half-bitmap word of strip ``k`` of the step staged at ``sb`` (0 if not valid)."""
        w = lds32b(d32, sb + bmo + u32(k * BMW * 8))
        if not valid:
            w = u32(0)
        return w

    @cuda.jit(device=True, inline="always")
    def entry(bw, excl, off, sb):
        """Table word: the half-bitmap and the shared address of its first value (``excl`` values
        into the strip, whose values start ``off`` values into the slot)."""
        return u64(bw) | (u64(sb + u32(2) * (excl + off)) << u64(32))

    @cuda.jit(device=True, inline="always")
    def pair_entries(scr, tid, d32, sb, bmo, k, valid, offa, offb):
        """Table words of strips ``k`` and ``k + 1``: one warp scan, their counts in 16-bit halves."""
        ba = half_bitmap(d32, sb, bmo, k, valid)
        bb = half_bitmap(d32, sb, bmo, k + 1, valid)
        ex = scan_counts(scr, tid, u32(cuda.popc(ba)) | (u32(cuda.popc(bb)) << u32(16)))
        return entry(ba, ex & u32(0xFFFF), offa, sb), entry(bb, ex >> u32(16), offb, sb)

    @cuda.jit(device=True, inline="always")
    def scan_step(scr, tid, d32, sb, bmo, lstart, l1, l2, l3, j, valid):
        """The table words (half-bitmap, address of its first value) of this lane's entry, for
        the R strips of step ``j`` staged at ``sb``. Strips past R get 0."""
        jl = j & u32(31)
        start = shfl_idx(scr, tid, lstart, jl)
        base = start & ~u32(7)           # the slot holds the values from this 8-value boundary
        t2 = u64(0)
        t3 = u64(0)
        t4 = u64(0)
        if R == 1:
            bw0 = half_bitmap(d32, sb, bmo, 0, valid)
            t1 = entry(bw0, scan_counts(scr, tid, u32(cuda.popc(bw0))), start & u32(7), sb)
        else:
            t1, t2 = pair_entries(scr, tid, d32, sb, bmo, 0, valid, start & u32(7),
                                  shfl_idx(scr, tid, l1, jl) - base)
            if R == 4:
                t3, t4 = pair_entries(scr, tid, d32, sb, bmo, 2, valid, shfl_idx(scr, tid, l2, jl) - base,
                                      shfl_idx(scr, tid, l3, jl) - base)
        return t1, t2, t3, t4

    @cuda.jit(device=True, inline="always")
    def tctile(t, scr, tid, d32, d64, xb, tab_r, lmask, p, gid, valid, acc):
        """Decode TCTile ``t`` of the R strips and multiply it with the step's X slice."""
        bb0 = cuda.local.array(NB, np.uint32)
        bb1 = cuda.local.array(NB, np.uint32)
        for jb in range(NB):
            bb0[jb] = u32(0)
            bb1[jb] = u32(0)
            if 8 * jb + gid < N and valid:
                bb0[jb] = lds32b(d32, xb + u32(jb * 8 * XROW * 8 + 32 * t))
                bb1[jb] = lds32b(d32, xb + u32(jb * 8 * XROW * 8 + 32 * t + 16))
        for r in range(R):
            e01 = lds128b(d64, tab_r + u32(r * TABB + 32 * t))
            e23 = lds128b(d64, tab_r + u32(r * TABB + 32 * t + 16))
            a0 = decode_at(d32, e01[0], lmask, p)   # top-left
            a1 = decode_at(d32, e01[1], lmask, p)   # bottom-left
            a2 = decode_at(d32, e23[0], lmask, p)   # top-right
            a3 = decode_at(d32, e23[1], lmask, p)   # bottom-right
            for jb in range(NB):
                q = r * NACC + 4 * jb
                c0, c1, c2, c3 = mma(scr, tid, a0, a1, a2, a3, bb0[jb], bb1[jb],
                                     acc[q], acc[q + 1], acc[q + 2], acc[q + 3])
                acc[q] = c0
                acc[q + 1] = c1
                acc[q + 2] = c2
                acc[q + 3] = c3

    @cuda.jit(**({} if SIM else {"max_registers": MAXREG}))
    def kernel(bm, vals, goff, soff, x, y, M, GK, ldxb, vch, sw):
        d64, d32, df = dynamic_smem()
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)

        tid, warp, lane, gid, tig, nw = thread_ids()
        hsel = lane >> 4
        p = u32(2 * (lane & 15))
        lmask = (u32(1) << p) - u32(1)

        sr = cuda.blockIdx.x * R      # first strip row: GroupTile row gm, strip s (R strips: s .. s+R-1)
        gm = sr >> 2
        s = sr & 3
        nsw = (GK - warp + nw - 1) // nw if warp < GK else 0
        nloop = (GK + nw - 1) // nw if SIM else nsw

        # lane j: where the values of this warp's step j start (and, R > 1, where its other strips
        # start) and end; the R strips of a step are contiguous in the format
        lstart = u32(0)
        l1 = u32(0)
        l2 = u32(0)
        l3 = u32(0)
        lend = u32(0)
        if lane < nsw:
            g = gm * GK + warp + nw * lane
            lstart = u32(soff[4 * g + s])
            if R >= 2:
                l1 = u32(soff[4 * g + s + 1])
            if R == 4:
                l2 = u32(soff[4 * g + 2])
                l3 = u32(soff[4 * g + 3])
            if s + R < 4:
                lend = u32(soff[4 * g + s + R])
            else:
                lend = u32(goff[g + 1])

        # shared byte addresses (u32) of this warp's ring, its table, and this lane's fixed offsets
        wring = byte_addr(d64, warp * (STAGES * sw + R * WBW))
        slot_b = u32(sw * 8)
        ring_b = u32(STAGES) * slot_b
        tab = wring + ring_b
        # half-bitmap h (= lane) goes to entry (h & 1) * 16 + (h >> 3) * 4 + ((h >> 1) & 3), so the
        # four a lane decodes for TCTile t (h = hsel + 8 t + 2 b, b = 0..3) are 32 contiguous bytes
        tab_w = tab + u32(((lane & 1) * 16 + (lane >> 3) * 4 + ((lane >> 1) & 3)) * 8)
        tab_r = tab + u32(hsel * 128)
        bmo = u32(vch * 16 + lane * 4)               # its bitmap word within a slot
        xlo = u32(vch * 16 + R * BMW * 8 + gid * (XROW * 8) + tig * 4)   # its B fragments in a slot
        vlane = u32(lane * 16)
        boff = u32(vch * 16 + lane * 16)
        xoff = u32(vch * 16 + R * BMW * 8 + (lane >> 3) * (XROW * 8) + (lane & 7) * 16)
        # copy sources (raw device addresses; simulator: byte offsets) and their per-step strides
        vp = ptr_of(vals)
        bsrc = ptr_of(bm) + u64((64 * (gm * GK + warp) + 16 * s) * 8 + lane * 16)
        bstep = u64(512 * nw)
        xsrc = ptr_of(x) + u64((lane >> 3) * ldxb + (lane & 7) * 16 + warp * 128)
        xstep = u64(128 * nw)
        xstride = u64(4 * ldxb)
        nsw_u = u32(nsw)
        # ROT: block b runs its warps' steps from step b mod nsw (wrapping), so the blocks of one
        # launch do not all read the same X slice (the same L2 lines) at the same time
        rot = u32(cuda.blockIdx.x % nsw) if ROT and nsw > 0 else u32(0)
        xrem = np.int32(XCH - lane)

        acc = cuda.local.array(RACC, np.float32)
        for e in range(RACC):
            acc[e] = np.float32(0.0)

        # prologue: steps 0 .. STAGES-2 in flight
        islot = u32(0)                 # slot to fill next (byte offset in the ring)
        for j in range(STAGES - 1):
            jr = rotated(u32(j), rot, nsw_u)
            step_issue(scr, tid, d64, lstart, lend, jr, nsw_u, lane, wring + islot + vlane,
                       vals, vp, bm, wring + islot + boff, bsrc + u64(jr) * bstep, x, wring + islot + xoff,
                       xsrc + u64(jr) * xstep, xrem, xstride)
            islot += slot_b
        dslot = u32(0)                 # slot of the step decoded next
        i = u32(0)
        nl = u32(nloop)
        while i < nl:
            wait()                     # this lane's copies of step i have landed ...
            syncwarp()                 # ... and everyone's; everyone is done with step i-1's slot
            # ---- issue step i + STAGES - 1 into the slot of step i - 1
            jn = rotated(i + u32(STAGES - 1), rot, nsw_u)
            step_issue(scr, tid, d64, lstart, lend, jn, nsw_u, lane, wring + islot + vlane,
                       vals, vp, bm, wring + islot + boff, bsrc + u64(jn) * bstep, x, wring + islot + xoff,
                       xsrc + u64(jn) * xstep, xrem, xstride)
            islot += slot_b
            if islot == ring_b:
                islot = u32(0)

            # ---- decode + multiply step i
            sb = wring + dslot
            dslot += slot_b
            if dslot == ring_b:
                dslot = u32(0)
            if PROBE == 1:
                i += u32(1)
                continue
            valid = (i < nsw_u) if SIM else True      # the simulator runs every warp to nloop
            t1, t2, t3, t4 = scan_step(scr, tid, d32, sb, bmo, lstart, l1, l2, l3, rotated(i, rot, nsw_u), valid)
            sts64b(d64, tab_w, t1)
            if R >= 2:
                sts64b(d64, tab_w + u32(TABB), t2)
            if R == 4:
                sts64b(d64, tab_w + u32(2 * TABB), t3)
                sts64b(d64, tab_w + u32(3 * TABB), t4)
            syncwarp()

            xb = sb + xlo
            # the four TCTiles as four inlined copies (not a loop): their table loads, decodes
            # and mma chains interleave
            tctile(0, scr, tid, d32, d64, xb, tab_r, lmask, p, gid, valid, acc)
            tctile(1, scr, tid, d32, d64, xb, tab_r, lmask, p, gid, valid, acc)
            tctile(2, scr, tid, d32, d64, xb, tab_r, lmask, p, gid, valid, acc)
            tctile(3, scr, tid, d32, d64, xb, tab_r, lmask, p, gid, valid, acc)
            i += u32(1)

        # ---- the warps' partial sums meet in shared memory (the ring is free now)
        warp_sums(df, acc, y, tid, warp, lane, nw, sr, M, 0, N)

    return kernel
