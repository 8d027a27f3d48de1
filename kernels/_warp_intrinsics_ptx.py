"""The inline-PTX pieces of spmm_warp (``_warp_intrinsics``) for the GPU.

Each is one PTX block so that the step's hot path is what we wrote, not what numba makes of
uint32 arithmetic (it widens it to 64 bits). Same public names and signatures as
``_warp_intrinsics_sim`` (checked by tests/test_kernels_layout.py).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import cuda
from numba.cuda.extending import intrinsic

from ._intrinsics_ptx import _asm_tuple, _smem_base, smem_base
from .plan import XROW_BYTES
from .compat_numba import cuda_typing

__all__ = ["byte_addr", "decode_at", "lds128b", "lds32b", "lds_f4", "make_step_issue", "scan_counts", "sts64b"]

types, _ = cuda_typing()

_i32, _i64 = ir.IntType(32), ir.IntType(64)


@cuda.jit(device=True, inline=True)
def byte_addr(d64, i):
    return smem_base(d64, i)


@intrinsic
def _lds32b(typingctx, addr):
    sig = types.uint32(types.uint32)

    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(_i32, [_i32]), "ld.shared.u32 $0, [$1];", "=r,r",
                           side_effect=True)
        return builder.call(asm, args)

    return sig, codegen


@intrinsic
def _sts64b(typingctx, addr, val):
    sig = types.void(types.uint32, types.uint64)

    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_i32, _i64]), "st.shared.u64 [$0], $1;",
                           "r,l,~{memory}", side_effect=True)
        builder.call(asm, args)
        return context.get_dummy_value()

    return sig, codegen


@cuda.jit(device=True, inline=True)
def lds32b(d32, addr):
    return _lds32b(np.uint32(addr))


@cuda.jit(device=True, inline=True)
def sts64b(d64, addr, val):
    _sts64b(np.uint32(addr), np.uint64(val))


_lds128b = _asm_tuple("ld.shared.v2.u64 {$0, $1}, [$2];", 64, 2, "=l,=l,r")


@cuda.jit(device=True, inline=True)
def lds128b(d64, addr):
    return _lds128b(np.uint32(addr))


@intrinsic
def _lds_f4(typingctx, addr):
    sig = types.UniTuple(types.float32, 4)(types.uint32)

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [_i32])
        res = builder.call(ir.InlineAsm(fnty, "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r",
                                        side_effect=True), args)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])

    return sig, codegen


@cuda.jit(device=True, inline=True)
def lds_f4(df, i):
    """``df[i .. i + 3]`` (fp32 shared memory, ``i`` a multiple of 4) in one 16-byte load: a warp reading 4
    consecutive values a lane takes 4 wavefronts, against 16 for four scalar loads at a 4-word stride."""
    return _lds_f4(_smem_base(df, i))


def _x_copy_lines(xit: int, dst: str, rem: str, stride: str, qstep: int, dstep: int) -> list:  # also _rows_intrinsics_ptx
    """PTX lines of ``xit`` predicated 16-byte copies of X rows: copy ``c`` goes from the u64
    register ``xs`` (advanced by ``stride`` after each) to ``dst + c*dstep``, when ``rem > c*qstep``
    (registers ``p`` and ``xs`` declared, ``xs`` set, by the caller)."""
    lines = []
    for c in range(xit):
        if c:
            lines.append(f"add.u64 xs, xs, {stride};")
        lines.append(f"setp.gt.s32 p, {rem}, {qstep * c};")
        lines.append(f"@p cp.async.cg.shared.global [{dst}+{dstep * c}], [xs], 16;")
    return lines


def make_step_issue(cmax: int, xit: int, nbm: int = 8):
    """The whole issue of one step in PTX: fetch the step's strip start/end from lane j,
    compute the value chunk range and source address, predicate on j < nsw, copy, commit."""
    L = ["{", ".reg .pred p, q;", ".reg .u32 st, en, a0, rem, xr;", ".reg .u64 vs, xs, t64;",
         "shfl.sync.idx.b32 st, $0, $2, 31, -1;",
         "shfl.sync.idx.b32 en, $1, $2, 31, -1;",
         "setp.lt.u32 q, $2, $3;",
         "shr.b32 a0, st, 3;",
         "add.u32 en, en, 7;",
         "shr.b32 en, en, 3;",
         "sub.s32 rem, en, a0;",
         "sub.s32 rem, rem, $4;",
         "selp.b32 rem, rem, 0, q;",
         "add.u32 a0, a0, $4;",
         "mul.wide.u32 t64, a0, 16;",
         "add.u64 vs, $6, t64;"]
    for c in range(cmax):
        L.append(f"setp.gt.s32 p, rem, {32 * c};")
        L.append(f"@p cp.async.cg.shared.global [$5+{512 * c}], [vs+{512 * c}], 16;")
    L.append(f"setp.lt.u32 p, $4, {nbm};")
    L.append("and.pred p, p, q;")
    L.append("@p cp.async.cg.shared.global [$7], [$8], 16;")
    L.append("selp.b32 xr, $11, 0, q;")
    L.append("mov.u64 xs, $10;")
    L += _x_copy_lines(xit, "$9", "xr", "$12", 32, 4 * XROW_BYTES)
    L.append("cp.async.commit_group;")
    L.append("}")
    text = "\n".join(L)

    @intrinsic
    def _step(typingctx, lstart, lend, j, nsw, lane, vdst, vp, bdst, bsrc, xdst, xsrc, xrem, xstride):
        u, u64, s = types.uint32, types.uint64, types.int32
        sig = types.void(u, u, u, u, u, u, u64, u, u64, u, u64, s, u64)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.VoidType(), [_i32] * 6 + [_i64, _i32, _i64, _i32, _i64, _i32, _i64])
            asm = ir.InlineAsm(fnty, text, "r,r,r,r,r,r,l,r,l,r,l,r,l,~{memory}", side_effect=True)
            builder.call(asm, args)
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def step_issue(scr, tid, d64, lstart, lend, j, nsw, lane, vdst, vals, vp, bm, bdst, bsrc, x, xdst, xsrc,
                   xrem, xstride):
        _step(np.uint32(lstart), np.uint32(lend), np.uint32(j), np.uint32(nsw), np.uint32(lane),
              np.uint32(vdst), np.uint64(vp), np.uint32(bdst), np.uint64(bsrc), np.uint32(xdst),
              np.uint64(xsrc), np.int32(xrem), np.uint64(xstride))

    return step_issue


_SCAN_PTX = """{
    .reg .pred p;
    .reg .u32 s, t;
    mov.u32 s, $1;
    shfl.sync.up.b32 t|p, s, 1, 0, -1;
    @p add.u32 s, s, t;
    shfl.sync.up.b32 t|p, s, 2, 0, -1;
    @p add.u32 s, s, t;
    shfl.sync.up.b32 t|p, s, 4, 0, -1;
    @p add.u32 s, s, t;
    shfl.sync.up.b32 t|p, s, 8, 0, -1;
    @p add.u32 s, s, t;
    shfl.sync.up.b32 t|p, s, 16, 0, -1;
    @p add.u32 s, s, t;
    sub.u32 $0, s, $1;
}"""


@intrinsic
def _scan(typingctx, c):
    sig = types.uint32(types.uint32)

    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(_i32, [_i32]), _SCAN_PTX, "=r,r", side_effect=True)
        return builder.call(asm, args)

    return sig, codegen


@cuda.jit(device=True, inline=True)
def scan_counts(scr, tid, c):
    return _scan(np.uint32(c))


_DECODE_PTX = """{
    .reg .u32 w, a, t, f, s, k, sel;
    mov.b64 {w, a}, $1;
    and.b32 t, w, $2;
    popc.b32 t, t;
    mad.lo.u32 a, t, 2, a;
    ld.shared.u16 f, [a];
    ld.shared.u16 s, [a+2];
    shr.b32 k, w, $3;
    and.b32 k, k, 3;
    mad.lo.u32 k, k, 34, 16;
    prmt.b32 sel, 0x22102222, 0x54101022, k;
    prmt.b32 $0, f, s, sel;
}"""


@intrinsic
def _decode(typingctx, e, lmask, pos):
    u = types.uint32
    sig = u(types.uint64, u, u)

    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(_i32, [_i64, _i32, _i32]), _DECODE_PTX, "=r,l,r,r")
        return builder.call(asm, args)

    return sig, codegen


@cuda.jit(device=True, inline=True)
def decode_at(d32, e, lmask, pos):
    return _decode(np.uint64(e), np.uint32(lmask), np.uint32(pos))
