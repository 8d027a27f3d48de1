"""The inline-PTX piece of spmm_rows (``_rows_intrinsics``) for the GPU.

Same public names and signatures as ``_rows_intrinsics_sim`` (checked by tests/test_kernels_layout.py).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import cuda
from numba.cuda.extending import intrinsic

from ._warp_intrinsics_ptx import _x_copy_lines
from .compat_numba import cuda_typing

__all__ = ["make_x_issue"]

types, _ = cuda_typing()

_i32, _i64 = ir.IntType(32), ir.IntType(64)


def make_x_issue(xit: int, qstep: int, dstep: int):
    """``xit`` copies per lane: copy ``c`` (16 bytes, to ``xdst + c*dstep`` from ``xsrc + c*xstride``)
    runs when ``xrem > c*qstep``."""
    text = "\n".join(["{", ".reg .pred p;", ".reg .u64 xs;", "mov.u64 xs, $1;",
                      *_x_copy_lines(xit, "$0", "$2", "$3", qstep, dstep), "}"])

    @intrinsic
    def _xi(typingctx, xdst, xsrc, xrem, xstride):
        sig = types.void(types.uint32, types.uint64, types.int32, types.uint64)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.VoidType(), [_i32, _i64, _i32, _i64])
            builder.call(ir.InlineAsm(fnty, text, "r,l,r,l,~{memory}", side_effect=True), args)
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def x_issue(d64, x, xdst, xsrc, xrem, xstride):
        _xi(np.uint32(xdst), np.uint64(xsrc), np.int32(xrem), np.uint64(xstride))

    return x_issue
