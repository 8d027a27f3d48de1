"""The device primitives of ``_intrinsics`` for the GPU: inline PTX / LLVM IR.

``mma`` is one ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` (inline PTX through
``numba.cuda.extending.intrinsic`` + llvmlite ``InlineAsm``), ``h2f`` / ``f2h`` single ``cvt``
instructions, ``shfl_*`` / ``syncwarp`` the warp intrinsics, ``bulk_copy`` / ``mbar_*`` Hopper bulk
copies completing on mbarriers, ``cp_wait*`` ``cp.async.wait_group``. Importing this module needs no
GPU (nothing compiles until a kernel does); what the simulator cannot cover (PTX syntax, register
constraints) ``scripts/checks/gpu_kernels.py`` checks on the device. Same public names and
signatures as ``_intrinsics_sim`` (checked by tests/test_kernels_layout.py).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import cuda
from numba.cuda.extending import intrinsic

from .compat_numba import cuda_typing

__all__ = ["bulk_copy", "bulk_copy_mc", "clock32", "cluster_rank", "cluster_sync", "cp_wait0", "cp_wait1",
           "cp_wait2", "decode_pair", "f2h", "fence_proxy_async", "gtimer32", "h2f", "lds32", "mbar_arrive",
           "mbar_arrive_remote", "mbar_expect", "mbar_init", "mbar_wait", "mma", "ptr_of", "shfl_idx", "shfl_up",
           "shfl_xor", "smem_base", "smid", "stg_h4", "syncwarp"]

types, cgutils = cuda_typing()

_i16, _i32, _f32 = ir.IntType(16), ir.IntType(32), ir.FloatType()


@intrinsic
def _mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    u, f = types.uint32, types.float32
    sig = types.UniTuple(f, 4)(u, u, u, u, u, u, f, f, f, f)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.LiteralStructType([_f32] * 4), [_i32] * 6 + [_f32] * 4)
        asm = ir.InlineAsm(
            fnty,
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        )
        res = builder.call(asm, args)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])

    return sig, codegen


@intrinsic
def _h2f(typingctx, bits):
    sig = types.float32(types.uint32)

    def codegen(context, builder, sig, args):
        h = builder.trunc(args[0], _i16)
        asm = ir.InlineAsm(ir.FunctionType(_f32, [_i16]), "cvt.f32.f16 $0, $1;", "=f,h")
        return builder.call(asm, [h])

    return sig, codegen


@intrinsic
def _f2h(typingctx, x):
    sig = types.uint16(types.float32)

    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(_i16, [_f32]), "cvt.rn.f16.f32 $0, $1;", "=h,f")
        return builder.call(asm, [args[0]])

    return sig, codegen


_i8p = ir.IntType(8).as_pointer()


def _smem_addr(builder, ptr):
    """32-bit shared-window address of a generic pointer into shared memory (cvta.to.shared)."""
    sp = builder.addrspacecast(builder.bitcast(ptr, _i8p), ir.IntType(8).as_pointer(addrspace=3))
    return builder.ptrtoint(sp, _i32)


def _asm_tuple(text: str, bits: int, n: int, constraints: str):
    """An intrinsic running ``text`` on one uint32 operand (a shared address) that returns ``n`` unsigned
    results of ``bits`` (32 or 64) bits as a tuple (the shared-memory loads of the kernels)."""
    out = ir.IntType(bits)
    nb = types.uint32 if bits == 32 else types.uint64

    @intrinsic
    def _fn(typingctx, addr):
        sig = types.UniTuple(nb, n)(types.uint32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.LiteralStructType([out] * n), [ir.IntType(32)])
            res = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), args)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(n)])

        return sig, codegen

    return _fn


def _asm_stmt(text):
    @intrinsic
    def _stmt(typingctx):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return types.void(), codegen

    return _stmt


@intrinsic
def _smem_base(typingctx, arr, i):
    sig = types.uint32(arr, types.int64)

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        return _smem_addr(builder, ptr)

    return sig, codegen


@intrinsic
def _lds32(typingctx, addr):
    sig = types.uint32(types.uint32)

    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(_i32, [_i32]), "ld.shared.u32 $0, [$1];", "=r,r")
        return builder.call(asm, [args[0]])

    return sig, codegen


# SMBD decode of one lane's A-fragment register: value index = offset + popc(word & lmask);
# two 16-bit shared loads (value i, value i+1); a 2-bit code (bit0, bit1 set?) picks a byte
# permutation from a 4-entry table (PRMT), so the register is (v_i, v_i+1), (v_i, 0),
# (0, v_i) or (0, 0) without branches.
_DECODE_PTX = """{
    .reg .u32 w, b, t, i, a, f, s, k, c, sel;
    mov.b64 {w, b}, $1;
    and.b32 t, w, $2;
    popc.b32 t, t;
    add.u32 i, b, t;
    mad.lo.u32 a, i, 2, $4;
    ld.shared.u16 f, [a];
    ld.shared.u16 s, [a+2];
    bfe.u32 k, w, $3, 2;
    mad.lo.u32 c, k, 34, 16;
    prmt.b32 sel, 0x22102222, 0x54101022, c;
    prmt.b32 $0, f, s, sel;
}"""


@intrinsic
def _decode_pair(typingctx, e, lmask, pos, vbase):
    u = types.uint32
    sig = u(types.uint64, u, u, u)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_i32, [ir.IntType(64), _i32, _i32, _i32])
        asm = ir.InlineAsm(fnty, _DECODE_PTX, "=r,l,r,r,r")
        return builder.call(asm, args)

    return sig, codegen


@cuda.jit(device=True, inline=True)
def smem_base(arr, i):
    return _smem_base(arr, i)


@cuda.jit(device=True, inline=True)
def lds32(d32, base, woff):
    return _lds32(np.uint32(base + np.uint32(woff) * np.uint32(4)))


@cuda.jit(device=True, inline=True)
def decode_pair(d32, e, lmask, pos, vbase):
    return _decode_pair(np.uint64(e), np.uint32(lmask), np.uint32(pos), np.uint32(vbase))


def _asm_fn2(text, constraints, ret=False):
    """An intrinsic running ``text`` on two uint32 operands (optionally returning a uint32)."""
    @intrinsic
    def _fn(typingctx, a, b):
        u = types.uint32
        sig = (u if ret else types.void)(u, u)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(_i32 if ret else ir.VoidType(), [_i32, _i32])
            out = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), args)
            return out if ret else context.get_dummy_value()

        return sig, codegen

    return _fn


_mbar_init = _asm_fn2("mbarrier.init.shared::cta.b64 [$0], $1;", "r,r,~{memory}")
_mbar_expect = _asm_fn2("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "r,r,~{memory}")
_mbar_arrive = _asm_fn2("mbarrier.arrive.shared::cta.b64 _, [$0];", "r,r,~{memory}")   # the 2nd operand: unused
_mbar_try = _asm_fn2("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; "
                     "selp.u32 $0, 1, 0, p; }", "=r,r,r,~{memory}", ret=True)
fence_proxy_async = _asm_stmt("fence.proxy.async.shared::cta;")
_fence_mbar_init = _asm_stmt("fence.mbarrier_init.release.cluster;")
# thread-block clusters (sm_90): this block's rank, an arrival on a barrier of another block of the cluster (at
# the same offset in its shared memory), and every thread of the cluster meeting (barrier inits visible first)
_cluster_rank = _asm_fn2("mov.u32 $0, %cluster_ctarank;", "=r,r,r", ret=True)
_clock32 = _asm_fn2("mov.u32 $0, %clock;", "=r,r,r,~{memory}", ret=True)   # the SM's cycle counter (probes)
_smid = _asm_fn2("mov.u32 $0, %smid;", "=r,r,r", ret=True)                   # the SM a block runs on (probes)
_gtimer32 = _asm_fn2("{ .reg .u64 t; mov.u64 t, %globaltimer; cvt.u32.u64 $0, t; }", "=r,r,r,~{memory}", ret=True)
# (remote arrivals .release.cta, as CUTLASS's: ".release.cluster" slowed multicast rings 1.5-2.5x; kernels-notes v33)
_mbar_arrive_remote = _asm_fn2("{ .reg .b32 ra; mapa.shared::cluster.u32 ra, $0, $1; "
                               "mbarrier.arrive.shared::cluster.b64 _, [ra]; }", "r,r,~{memory}")
cluster_sync = _asm_stmt("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;")


@intrinsic
def _bulk(typingctx, dst_addr, src, si, nbytes, mbar_addr):
    u = types.uint32
    sig = types.void(u, src, types.int64, u, u)

    def codegen(context, builder, sig, args):
        sty = sig.args[1]
        ary = context.make_array(sty)(context, builder, args[1])
        sp = cgutils.get_item_pointer(context, builder, sty, ary, [args[2]], wraparound=False)
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_i32, _i8p, _i32, _i32]),
                           "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                           "[$0], [$1], $2, [$3];", "r,l,r,r,~{memory}", side_effect=True)
        builder.call(asm, [args[0], builder.bitcast(sp, _i8p), args[3], args[4]])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _bulk_mc(typingctx, dst_addr, src, si, nbytes, mbar_addr, mask):
    u = types.uint32
    sig = types.void(u, src, types.int64, u, u, u)

    def codegen(context, builder, sig, args):
        sty = sig.args[1]
        ary = context.make_array(sty)(context, builder, args[1])
        sp = cgutils.get_item_pointer(context, builder, sty, ary, [args[2]], wraparound=False)
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_i32, _i8p, _i32, _i32, _i16]),
                           "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
                           "[$0], [$1], $2, [$3], $4;", "r,l,r,r,h,~{memory}", side_effect=True)
        builder.call(asm, [args[0], builder.bitcast(sp, _i8p), args[3], args[4], builder.trunc(args[5], _i16)])
        return context.get_dummy_value()

    return sig, codegen


@cuda.jit(device=True, inline=True)
def cluster_rank():
    return _cluster_rank(np.uint32(0), np.uint32(0))


@cuda.jit(device=True, inline=True)
def smid():
    """The SM this block runs on (time-stamp probes)."""
    return _smid(np.uint32(0), np.uint32(0))


@cuda.jit(device=True, inline=True)
def gtimer32():
    """The low 32 bits of the GPU's nanosecond timer, the same on every SM (probes; differences under 4 s)."""
    return _gtimer32(np.uint32(0), np.uint32(0))


@cuda.jit(device=True, inline=True)
def clock32():
    """The low 32 bits of this SM's cycle counter (time-stamp probes; differences within one block)."""
    return _clock32(np.uint32(0), np.uint32(0))


@cuda.jit(device=True, inline=True)
def mbar_arrive_remote(mbar, i, rank):
    """Arrive on barrier ``i`` of ``mbar`` in the shared memory of the cluster's block ``rank``."""
    _mbar_arrive_remote(_smem_base(mbar, i), np.uint32(rank))


@cuda.jit(device=True, inline=True)
def bulk_copy_mc(dst, di, src, si, nbytes, mbar, mi, mask):
    """``bulk_copy`` into every block of the cluster in ``mask`` (bit r: rank r), at the same offsets, each
    counting toward its own barrier ``mi``."""
    _bulk_mc(_smem_base(dst, di), src, si, np.uint32(nbytes), _smem_base(mbar, mi), np.uint32(mask))


@cuda.jit(device=True, inline=True)
def mbar_init(mbar, i, count):
    _mbar_init(_smem_base(mbar, i), np.uint32(count))
    _fence_mbar_init()


@cuda.jit(device=True, inline=True)
def mbar_expect(mbar, i, nbytes):
    _mbar_expect(_smem_base(mbar, i), np.uint32(nbytes))


@cuda.jit(device=True, inline=True)
def mbar_arrive(mbar, i):
    _mbar_arrive(_smem_base(mbar, i), np.uint32(0))


@cuda.jit(device=True, inline=True)
def mbar_wait(mbar, i, parity):
    a = _smem_base(mbar, i)
    while _mbar_try(a, np.uint32(parity)) == 0:
        pass


@cuda.jit(device=True, inline=True)
def bulk_copy(dst, di, src, si, nbytes, mbar, mi):
    _bulk(_smem_base(dst, di), src, si, np.uint32(nbytes), _smem_base(mbar, mi))


cp_wait0 = _asm_stmt("cp.async.wait_group 0;")
cp_wait1 = _asm_stmt("cp.async.wait_group 1;")
cp_wait2 = _asm_stmt("cp.async.wait_group 2;")


@intrinsic
def _ptr_of(typingctx, arr):
    sig = types.uint64(arr)

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.ptrtoint(ary.data, ir.IntType(64))

    return sig, codegen


@cuda.jit(device=True, inline=True)
def ptr_of(arr):
    return _ptr_of(arr)


_STG_H4 = ("{\n.reg .b16 h0, h1, h2, h3;\n.reg .b32 p0, p1;\ncvt.rn.f16.f32 h0, $1;\ncvt.rn.f16.f32 h1, $2;\n"
           "cvt.rn.f16.f32 h2, $3;\ncvt.rn.f16.f32 h3, $4;\nmov.b32 p0, {h0, h1};\nmov.b32 p1, {h2, h3};\n"
           "st.global.v2.b32 [$0], {p0, p1};\n}")


@intrinsic
def _stg_h4(typingctx, addr, a, b, c, d):
    sig = types.void(types.uint64, types.float32, types.float32, types.float32, types.float32)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64)] + [_f32] * 4)
        builder.call(ir.InlineAsm(fnty, _STG_H4, "l,f,f,f,f,~{memory}", side_effect=True), args)
        return context.get_dummy_value()

    return sig, codegen


@cuda.jit(device=True, inline=True)
def stg_h4(y, i, a, b, c, d):
    """``y[i .. i + 3]`` (fp16 bits, an int16 array; ``i`` a multiple of 4) = ``a, b, c, d`` rounded to fp16, one
    8-byte global store."""
    _stg_h4(ptr_of(y) + np.uint64(2 * i), np.float32(a), np.float32(b), np.float32(c), np.float32(d))


@cuda.jit(device=True, inline=True)
def shfl_idx(scr, tid, val, src_lane):
    return np.uint32(cuda.shfl_sync(0xFFFFFFFF, np.int32(val), np.int32(src_lane)))


@cuda.jit(device=True, inline=True)
def mma(scr, tid, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma(np.uint32(a0), np.uint32(a1), np.uint32(a2), np.uint32(a3), np.uint32(b0),
                np.uint32(b1), np.float32(c0), np.float32(c1), np.float32(c2), np.float32(c3))


@cuda.jit(device=True, inline=True)
def h2f(bits):
    return _h2f(np.uint32(bits))


@cuda.jit(device=True, inline=True)
def f2h(x):
    return _f2h(np.float32(x))


@cuda.jit(device=True, inline=True)
def syncwarp():
    cuda.syncwarp(0xFFFFFFFF)


@cuda.jit(device=True, inline=True)
def shfl_up(scr, tid, val, delta):
    return np.uint32(cuda.shfl_up_sync(0xFFFFFFFF, np.int32(val), np.int32(delta)))


@cuda.jit(device=True, inline=True)
def shfl_xor(scr, tid, val, mask):
    return cuda.shfl_xor_sync(0xFFFFFFFF, np.float32(val), np.int32(mask))
