"""TCA-BME decode kernel v3 (issue 21): each warp decodes its 16x64 strip ONCE per step into its
16 A-fragment registers and multiplies them with every 8-token block of the launch.

spmm_warp (v5-v12) gives each warp its own copy of the step's X slice, so at N tokens every block
re-reads N x 128 bytes per 1 KB strip from L2 and loads every B fragment with two 4-byte shared
loads; that, not the weight bytes, is what grows with N there. Here:

- **Block** = ``WR`` (1, 2, 4 or 8) strip rows (16 outputs each) x ``KS`` groups of warps along K: warp
  ``(r, ks)`` (``warp = ks*WR + r``) takes strip row ``r`` at GroupTile columns ``ks, ks + KS, ...``.
  The ``WR`` warps of a K group share one X slice per step in shared memory (copied once, each warp
  a share), so X traffic per weight byte drops ``WR``-fold. All warps step together: one block
  barrier per step (a warp past its steps copies nothing and decodes an empty strip).
- **Tokens**: a launch covers ``NT = 8*NB`` tokens per block (NB = 1..16 mma blocks, so 1-128
  tokens); more tokens split the grid over ``blockIdx.y`` (each token chunk re-decodes, so the
  per-token decode cost is flat up to ``NT``). Token rows past N are zero in shared memory (cleared
  once; copies never write them), so B fragments need no predicates.
- **Offsets**: lane ``l`` holds the start and end of the warp's step ``32q + l`` for the window
  ``q`` being issued (reloaded every 32 steps, so K has no limit), and the starts of the window
  being decoded.
- **Ring**: ``STAGES`` slots. A step's copies are 16-byte ``cp.async``: the strip's values and 16
  bitmaps (spmm_warp's ``step_issue``) and this warp's share of the group's X slice
  (``x_issue``), one commit group.
- **Decode once** (per warp-step, independent of N): lane ``h`` takes half-bitmap word ``h`` (bits
  32*(h%2).. of BitmapTile h/2), one ``popc`` and a 5-step warp scan give its value offset; a
  256-byte table hands each lane the four words of each TCTile at its fragment position; one
  ``popc`` of the bits below the lane's two bits, two 16-bit loads and two ``prmt`` make each
  of the 16 A registers (SMBD: ``decode_at``).
- **Multiply**: for each 8-token block, two ``ldmatrix.x4`` (rows = tokens, 144-byte rows: no bank
  conflicts) give the B fragments of the four TCTiles; four ``mma.m16n8k16`` (fp32 accumulate).
- **Epilogue**: the ``KS`` groups' fp32 sums meet in shared memory; fp16 out.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ._intrinsics import SCRATCH_WORDS, SIM, cp_wait0, cp_wait1, cp_wait2, f2h, mma, ptr_of, shfl_idx, syncwarp
from ._v3_intrinsics import ldsm_x4, make_x_issue
from ._warp_intrinsics import byte_addr, decode_at, lds32b, lds128b, make_step_issue, scan_counts, sts64b
from .plan import WBW, XROW
from .plan import v3_smem_bytes as smem_bytes  # noqa: F401 - the kernel's shared layout

_KERNELS: dict = {}
_SIM_U64 = np.dtype(np.uint64) if SIM else np.uint64
_SIM_U32 = np.dtype(np.uint32) if SIM else np.uint32
_SIM_F32 = np.dtype(np.float32) if SIM else np.float32
DECODE_BUG = 0   # tests only: 1 = the offset popc counts the lane's own bit too (a planted indexing bug)


@cuda.jit(device=True, inline="always")
def _dynamic_shared():
    """The block's dynamic shared memory as uint64, uint32 and float32 words (one 16-byte aligned base)."""
    if SIM:
        return cuda.shared.array(0, _SIM_U64), cuda.shared.array(0, _SIM_U32), cuda.shared.array(0, _SIM_F32)
    return (cuda.shared.array(0, np.uint64, alignment=16), cuda.shared.array(0, np.uint32, alignment=16),
            cuda.shared.array(0, np.float32, alignment=16))


def compiled_kernels() -> dict:
    """The kernels built so far, by their ``get_kernel`` key (for resource reports)."""
    return dict(_KERNELS)


def get_kernel(nb: int, stages: int, cmax: int, wr: int, ks: int, maxreg: int):
    """Kernel for ``nb`` 8-token blocks per block, ``stages`` slots, ``cmax`` value chunks per lane,
    ``wr`` strip rows x ``ks`` K groups of warps."""
    key = (nb, stages, cmax, wr, ks, maxreg, DECODE_BUG)
    if key not in _KERNELS:
        _KERNELS[key] = _build(nb, stages, cmax, wr, ks, maxreg, DECODE_BUG)
    return _KERNELS[key]


def _build(NB: int, STAGES: int, CMAX: int, WR: int, KS: int, MAXREG: int, BUG: int = 0):
    assert 1 <= NB <= 16 and 2 <= STAGES <= 4 and 1 <= CMAX <= 5 and WR in (1, 2, 4, 8) and WR * KS <= 32
    NT = 8 * NB
    NACC = 4 * NB
    NWARPS = WR * KS
    XSLOT = NT * XROW * 8                 # bytes of one stage of one group's X slice
    XIT = (8 * NT + 32 * WR - 1) // (32 * WR)   # 16-byte X chunks per lane per step
    wait = (cp_wait0, cp_wait1, cp_wait2)[STAGES - 2]
    u32 = np.uint32
    u64 = np.uint64
    step_issue = make_step_issue(CMAX, 0, 8)
    x_issue = make_x_issue(XIT, 32 * WR, 4 * WR * XROW * 8)

    @cuda.jit(device=True, inline="always")
    def step_offsets(soff, goff, gbase, s, j, nsw):
        """Where this warp's step ``j`` (GroupTile ``gbase + KS*j``, strip ``s``) starts and ends in
        the values; (0, 0) past its last step."""
        st = u32(0)
        en = u32(0)
        if j < nsw:
            g = gbase + KS * j
            st = u32(soff[4 * g + s])
            en = u32(soff[4 * g + s + 1]) if s < 3 else u32(goff[g + 1])
        return st, en

    @cuda.jit(**({} if SIM else {"max_registers": MAXREG}))
    def kernel(bm, vals, goff, soff, x, y, M, N, GK, SR, ldxb, vch, sw):
        d64, d32, df = _dynamic_shared()
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        gid, tig, hsel = lane >> 2, lane & 3, lane >> 4      # mma fragment row, column pair, bitmap half
        r = warp % WR
        ks = warp // WR
        p = u32(2 * (lane & 15))
        lmask = (u32(1) << p) - u32(1)
        if BUG == 1:
            lmask = (u32(2) << p) - u32(1)

        sr = cuda.blockIdx.x * WR + r         # strip row: GroupTile row gm, strip s
        gm = sr >> 2
        s = sr & 3
        n0 = cuda.blockIdx.y * NT
        ntok = min(NT, N - n0)
        gsw = (GK - ks + KS - 1) // KS if ks < GK else 0    # steps of this K group (its X slices)
        nsw = gsw if sr < SR else 0                          # SR: strip rows of the weight
        nloop = (GK + KS - 1) // KS

        # lane l: where this warp's step 32q + l starts and ends (q: the window of 32 steps being
        # issued); ``dstart``: the starts of the window being decoded (STAGES - 1 steps behind)
        gbase = gm * GK + ks
        lstart, lend = step_offsets(soff, goff, gbase, s, lane, nsw)
        dstart = lstart

        # shared layout (uint64 words): per warp STAGES slots (values, bitmaps) + its table; then per
        # K group STAGES X slices of NT rows
        wring = byte_addr(d64, warp * (STAGES * sw + WBW))
        slot_b = u32(sw * 8)
        ring_b = u32(STAGES) * slot_b
        tab = wring + ring_b
        tab_w = tab + u32(((lane & 1) * 16 + (lane >> 3) * 4 + ((lane >> 1) & 3)) * 8)
        tab_r = tab + u32(hsel * 128)
        bmo = u32(vch * 16 + lane * 4)
        vlane = u32(lane * 16)
        boff = u32(vch * 16 + lane * 16)
        xall = byte_addr(d64, NWARPS * (STAGES * sw + WBW))
        xreg = xall + u32(ks * STAGES * XSLOT)
        q0 = r * 32 + lane                          # this lane's first X chunk: row q0 / 8, chunk q0 % 8
        xcp = u32((q0 >> 3) * (XROW * 8) + (q0 & 7) * 16)
        xrd = u32((lane & 7) * (XROW * 8) + (lane >> 3) * 16)   # its ldmatrix row address
        vp = ptr_of(vals)
        bsrc = ptr_of(bm) + u64((64 * (gm * GK + ks) + 16 * s) * 8 + lane * 16)
        bstep = u64(512 * KS)
        xsrc = ptr_of(x) + u64((n0 + (q0 >> 3)) * ldxb + (q0 & 7) * 16 + 128 * ks)
        xstep = u64(128 * KS)
        xstride = u64(4 * WR * ldxb)
        xrem = np.int32(8 * ntok - q0)
        nsw_u = u32(nsw)
        gsw_u = u32(gsw)

        # X rows past the launch's tokens must read as zeros: clear the X slices once
        xwords = KS * STAGES * NT * XROW
        for e in range(tid, xwords, cuda.blockDim.x):
            sts64b(d64, xall + u32(8 * e), u64(0))
        cuda.syncthreads()

        acc = cuda.local.array(NACC, np.float32)
        for e in range(NACC):
            acc[e] = np.float32(0.0)
        a = cuda.local.array(16, np.uint32)

        islot = u32(0)
        ixs = u32(0)
        for j in range(STAGES - 1):
            ju = u32(j)
            x_issue(d64, x, xreg + ixs + xcp, xsrc + u64(ju) * xstep, xrem if ju < gsw_u else np.int32(0), xstride)
            step_issue(scr, tid, d64, lstart, lend, ju, nsw_u, lane, wring + islot + vlane, vals, vp, bm,
                       wring + islot + boff, bsrc + u64(ju) * bstep, x, u32(0), u64(0), np.int32(0), u64(0))
            islot += slot_b
            ixs += u32(XSLOT)
        dslot = u32(0)
        dxs = u32(0)
        i = u32(0)
        nl = u32(nloop)
        while i < nl:
            wait()                 # this thread's copies of step i have landed ...
            cuda.syncthreads()     # ... and everyone's; everyone is done with step i-1's slots
            jn = i + u32(STAGES - 1)
            if (jn & u32(31)) == u32(0):      # the issue runs into the next window of 32 steps
                lstart, lend = step_offsets(soff, goff, gbase, s, jn + lane, nsw)
            x_issue(d64, x, xreg + ixs + xcp, xsrc + u64(jn) * xstep, xrem if jn < gsw_u else np.int32(0), xstride)
            step_issue(scr, tid, d64, lstart, lend, jn, nsw_u, lane, wring + islot + vlane, vals, vp, bm,
                       wring + islot + boff, bsrc + u64(jn) * bstep, x, u32(0), u64(0), np.int32(0), u64(0))
            islot += slot_b
            ixs += u32(XSLOT)
            if islot == ring_b:
                islot = u32(0)
                ixs = u32(0)

            # ---- decode the strip of step i once: 16 A registers
            sb = wring + dslot
            xb = xreg + dxs + xrd
            dslot += slot_b
            dxs += u32(XSLOT)
            if dslot == ring_b:
                dslot = u32(0)
                dxs = u32(0)
            valid = i < nsw_u
            bw = lds32b(d32, sb + bmo)
            if not valid:
                bw = u32(0)
            excl = scan_counts(scr, tid, u32(cuda.popc(bw)))
            if (i & u32(31)) == u32(0) and i > u32(0):
                dstart = step_offsets(soff, goff, gbase, s, i + lane, nsw)[0]
            start = shfl_idx(scr, tid, dstart, i & u32(31))
            sts64b(d64, tab_w, u64(bw) | (u64(sb + u32(2) * (excl + (start & u32(7)))) << u64(32)))
            syncwarp()
            for t in range(4):
                e01 = lds128b(d64, tab_r + u32(32 * t))
                e23 = lds128b(d64, tab_r + u32(32 * t + 16))
                a[4 * t] = decode_at(d32, e01[0], lmask, p)       # top-left
                a[4 * t + 1] = decode_at(d32, e01[1], lmask, p)   # bottom-left
                a[4 * t + 2] = decode_at(d32, e23[0], lmask, p)   # top-right
                a[4 * t + 3] = decode_at(d32, e23[1], lmask, p)   # bottom-right

            # ---- multiply with every 8-token block
            for jb in range(NB):
                for tp in range(2):
                    b0, b1, b2, b3 = ldsm_x4(scr, tid, d32, xb + u32(jb * 8 * XROW * 8 + 64 * tp))
                    q = 4 * jb
                    c0, c1, c2, c3 = mma(scr, tid, a[8 * tp], a[8 * tp + 1], a[8 * tp + 2], a[8 * tp + 3],
                                         b0, b1, acc[q], acc[q + 1], acc[q + 2], acc[q + 3])
                    c0, c1, c2, c3 = mma(scr, tid, a[8 * tp + 4], a[8 * tp + 5], a[8 * tp + 6], a[8 * tp + 7],
                                         b2, b3, c0, c1, c2, c3)
                    acc[q] = c0
                    acc[q + 1] = c1
                    acc[q + 2] = c2
                    acc[q + 3] = c3
            i += u32(1)

        # ---- the K groups' partial sums meet in shared memory (the ring is free now)
        cp_wait0()
        cuda.syncthreads()
        for jb in range(NB):
            for oi in range(4):
                n = 8 * jb + 2 * tig + (oi & 1)
                df[((ks * WR + r) * NT + n) * 16 + gid + 8 * (oi >> 1)] = acc[4 * jb + oi]
        cuda.syncthreads()
        for e in range(tid, WR * 16 * NT, cuda.blockDim.x):
            rr = e // (16 * NT)
            n = (e >> 4) - rr * NT
            row = e & 15
            m = (cuda.blockIdx.x * WR + rr) * 16 + row
            if n < ntok and m < M:
                tot = np.float32(0.0)
                for k in range(KS):
                    tot += df[((k * WR + rr) * NT + n) * 16 + row]
                y[(n0 + n) * M + m] = np.int16(f2h(tot))

    return kernel
