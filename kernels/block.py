"""Block-level pieces the warp kernels (spmm_warp, sp24_kernel) share: thread ids, the dynamic
shared-memory views, and the end of a block whose warps split K (their fp32 sums meet in shared memory, fp16 out).

Under the simulator these are plain Python on the running kernel's context (``compat_numba.sim_kernel``):
a device function of another module than the kernel cannot use ``cuda.*`` there (the simulator's
per-call swap of that module's ``cuda`` races between threads).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ._intrinsics import SIM, f2h

if SIM:
    from .compat_numba import sim_kernel, sim_syncthreads as _syncthreads

    def _device(fn):
        return fn

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
    def thread_ids():
        """(thread, warp, lane, lane // 4, lane % 4, warps in the block)."""
        tid = cuda.threadIdx.x
        return tid, tid >> 5, tid & 31, (tid & 31) >> 2, tid & 3, cuda.blockDim.x >> 5

    @cuda.jit(device=True, inline="always")
    def dynamic_smem():
        """(uint64, uint32, float32) views of the block's dynamic shared memory, 16-byte aligned."""
        return (cuda.shared.array(0, np.uint64, alignment=16), cuda.shared.array(0, np.uint32, alignment=16),
                cuda.shared.array(0, np.float32, alignment=16))


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
