"""The inline-PTX pieces of spmm_v3 (``_v3_intrinsics``) as plain Python, for the simulator.

Shared addresses are byte offsets into the dynamic shared array, global sources byte offsets into
the arrays (as in ``_warp_intrinsics_sim``). ``ldsm_x4`` exchanges the lanes' row addresses
through the block's scratch array, as the hardware does through its crossbar, so a wrong lane
address gives a wrong fragment here too. Same public names and signatures as ``_v3_intrinsics_ptx``.
"""
from __future__ import annotations

import numpy as np

from ._warp_intrinsics_sim import _copy16
from .compat_numba import sim_syncthreads

__all__ = ["ldsm_x4", "make_x_issue"]


def ldsm_x4(scr, tid, d32, addr):
    """Four 8x8 b16 matrices: lane l gets word l % 4 of row l // 4 of each (GPU: ldmatrix .x4)."""
    scr[tid] = int(addr)
    sim_syncthreads()
    base = tid & ~31
    lane = tid & 31
    out = []
    for m in range(4):
        a = int(scr[base + 8 * m + (lane >> 2)])
        assert a % 16 == 0, "ldmatrix rows must be 16-byte aligned"
        out.append(np.uint32(d32[(a >> 2) + (lane & 3)]))
    sim_syncthreads()
    return out[0], out[1], out[2], out[3]


def make_x_issue(xit: int, qstep: int, dstep: int):
    def x_issue(d64, x, xdst, xsrc, xrem, xstride):
        for c in range(xit):
            if int(xrem) > qstep * c:
                _copy16(d64, int(xdst) + dstep * c, x, int(xsrc) + int(xstride) * c)
    return x_issue
