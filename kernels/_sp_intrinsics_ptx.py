"""The 2:4 kernel's device primitives (``_sp_intrinsics``) for the GPU: inline PTX through numba
``@intrinsic`` + llvmlite ``InlineAsm``, as in ``_intrinsics_ptx``.

``mma.sp`` takes its operands in the order and with the constraint string verified on an H100
(/work/shared/notes/mma-sp-facts.md): 4 fp32 outputs, 4 A registers (compressed fp16 pairs), 4 B
registers, 4 fp32 accumulators, the metadata register, then the selector as the immediate ``0x0``.
Same public names and signatures as ``_sp_intrinsics_sim`` (checked by tests/test_kernels_layout.py).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import cuda
from numba.cuda.extending import intrinsic

from ._intrinsics_ptx import _asm_stmt, _asm_tuple, mma
from .compat_numba import cuda_typing

__all__ = ["cp16", "cp_commit", "cp_wait3", "cp_wait4", "cp_wait5", "cp_wait6", "ldg128", "ldmatrix_x4", "mma_k32", "mma_sp", "stg128", "sts128"]

types, cgutils = cuda_typing()

_i32, _f32 = ir.IntType(32), ir.FloatType()
_MMA_SP = ("mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 "
          "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9,$10,$11}, {$12,$13,$14,$15}, $16, 0x0;")
_MMA_SP_CONSTRAINTS = "=f,=f,=f,=f,r,r,r,r,r,r,r,r,f,f,f,f,r"


@intrinsic
def _mma_sp(typingctx, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, meta):
    u, f = types.uint32, types.float32
    sig = types.UniTuple(f, 4)(u, u, u, u, u, u, u, u, f, f, f, f, u)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.LiteralStructType([_f32] * 4), [_i32] * 8 + [_f32] * 4 + [_i32])
        res = builder.call(ir.InlineAsm(fnty, _MMA_SP, _MMA_SP_CONSTRAINTS), args)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])

    return sig, codegen


_ldmatrix_x4 = _asm_tuple("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0,$1,$2,$3}, [$4];", 32, 4,
                          "=r,=r,=r,=r,r,~{memory}")


@intrinsic
def _ldg128(typingctx, arr, i):
    sig = types.UniTuple(types.uint32, 4)(arr, types.int64)

    def codegen(context, builder, sig, args):
        aty = sig.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1]], wraparound=False)
        fnty = ir.FunctionType(ir.LiteralStructType([_i32] * 4), [ptr.type])
        asm = ir.InlineAsm(fnty, "ld.global.nc.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,l")
        res = builder.call(asm, [ptr])
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])

    return sig, codegen


@intrinsic
def _stg128(typingctx, arr, i, w0, w1, w2, w3):
    u = types.uint32
    sig = types.void(arr, types.int64, u, u, u, u)

    def codegen(context, builder, sig, args):
        aty = sig.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1]], wraparound=False)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type] + [_i32] * 4)
        asm = ir.InlineAsm(fnty, "st.global.v4.u32 [$0], {$1,$2,$3,$4};", "l,r,r,r,r,~{memory}", side_effect=True)
        builder.call(asm, [ptr] + list(args[2:]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _sts128(typingctx, addr, w0, w1, w2, w3):
    u = types.uint32
    sig = types.void(u, u, u, u, u)

    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_i32] * 5), "st.shared.v4.u32 [$0], {$1,$2,$3,$4};",
                           "r,r,r,r,r,~{memory}", side_effect=True)
        builder.call(asm, args)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _cp16(typingctx, addr, arr, i, nbytes):
    sig = types.void(types.uint32, arr, types.int64, types.uint32)

    def codegen(context, builder, sig, args):
        aty = sig.args[1]
        ary = context.make_array(aty)(context, builder, args[1])
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[2]], wraparound=False)
        fnty = ir.FunctionType(ir.VoidType(), [_i32, ptr.type, _i32])
        asm = ir.InlineAsm(fnty, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                           side_effect=True)
        builder.call(asm, [args[0], ptr, args[3]])
        return context.get_dummy_value()

    return sig, codegen


cp_commit = _asm_stmt("cp.async.commit_group;")
cp_wait3 = _asm_stmt("cp.async.wait_group 3;")
cp_wait4 = _asm_stmt("cp.async.wait_group 4;")
cp_wait5 = _asm_stmt("cp.async.wait_group 5;")
cp_wait6 = _asm_stmt("cp.async.wait_group 6;")


@cuda.jit(device=True, inline=True)
def cp16(d32, addr, arr, i, nbytes):
    _cp16(np.uint32(addr), arr, np.int64(i), np.uint32(nbytes))


@cuda.jit(device=True, inline=True)
def mma_sp(scr, tid, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, meta):
    u = np.uint32
    f = np.float32
    return _mma_sp(u(a0), u(a1), u(a2), u(a3), u(b0), u(b1), u(b2), u(b3), f(c0), f(c1), f(c2), f(c3), u(meta))


@cuda.jit(device=True, inline=True)
def mma_k32(scr, tid, sp, a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, c0, c1, c2, c3, meta):
    if sp:
        return mma_sp(scr, tid, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, meta)
    d0, d1, d2, d3 = mma(scr, tid, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
    return mma(scr, tid, a4, a5, a6, a7, b2, b3, d0, d1, d2, d3)


@cuda.jit(device=True, inline=True)
def ldmatrix_x4(scr, tid, d32, addr):
    return _ldmatrix_x4(np.uint32(addr))


@cuda.jit(device=True, inline=True)
def ldg128(arr, i):
    return _ldg128(arr, np.int64(i))


@cuda.jit(device=True, inline=True)
def stg128(arr, i, w0, w1, w2, w3):
    _stg128(arr, np.int64(i), np.uint32(w0), np.uint32(w1), np.uint32(w2), np.uint32(w3))


@cuda.jit(device=True, inline=True)
def sts128(d32, addr, w0, w1, w2, w3):
    _sts128(np.uint32(addr), np.uint32(w0), np.uint32(w1), np.uint32(w2), np.uint32(w3))
