"""The inline-PTX piece of spmm_rows (``_rows_intrinsics``) as plain Python, for the simulator.

Shared addresses are _SMEM_BASE plus byte offsets into the dynamic shared array, global sources byte offsets into
the arrays (as in ``_warp_intrinsics_sim``). Same public names and signatures as ``_rows_intrinsics_ptx``.
"""
from __future__ import annotations

from ._warp_intrinsics_sim import _copy16

__all__ = ["make_x_issue"]


def make_x_issue(xit: int, qstep: int, dstep: int):
    def x_issue(d64, x, xdst, xsrc, xrem, xstride):
        for c in range(xit):
            if int(xrem) > qstep * c:
                _copy16(d64, int(xdst) + dstep * c, x, int(xsrc) + int(xstride) * c)
    return x_issue
