"""Device primitives the kernels need, in two forms: GPU (inline PTX / LLVM IR) and simulator.

On a GPU, ``mma`` is one ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` (inline PTX through
``numba.cuda.extending.intrinsic`` + llvmlite ``InlineAsm``), ``ldg16`` one 16-byte global load
(``ld.v2.u64``), ``h2f`` / ``f2h`` single ``cvt`` instructions, ``shfl_up`` / ``shfl_xor`` / ``syncwarp``
the warp intrinsics.

Under ``NUMBA_ENABLE_CUDASIM=1`` none of that can run (no PTX, and the simulator has no warp
shuffles), so the same names are plain Python: warp exchanges go through a per-block shared
scratch array and ``syncthreads`` (every kernel calls them uniformly across the block, which the
emulation requires), and ``mma`` computes exactly the fragment contract of m16n8k16 (each lane
publishes its A/B registers, then computes its own four C elements from everyone's). This makes
the tensor-core kernel's decode, fragment layout and epilogue testable without a GPU; what the
simulator does not cover is the PTX itself (instruction syntax, register constraints), which
``scripts/gpu_check_kernels.py`` checks on the device.
"""
from __future__ import annotations

import numpy as np
from numba import config

SIM = bool(config.ENABLE_CUDASIM)

# Per-block scratch words each emulated warp exchange needs (0 on the GPU: the array is unused).
SCRATCH_WORDS = 1024 * 6 if SIM else 1

if SIM:
    from numba.cuda.simulator.kernel import _get_kernel_context

    class _Cuda:  # the simulator's per-launch fake ``cuda`` module, looked up at call time
        def syncthreads(self):
            _get_kernel_context().syncthreads()

    cuda = _Cuda()

    def _f16(bits) -> float:
        return float(np.array([int(bits) & 0xFFFF], dtype=np.uint16).view(np.float16)[0])

    def h2f(bits):
        """fp16 bit pattern (low 16 bits of ``bits``) -> float32."""
        return np.float32(_f16(bits))

    def f2h(x):
        """float32 -> fp16 bit pattern (round to nearest even), as uint16."""
        return np.array([x], dtype=np.float32).astype(np.float16).view(np.uint16)[0]

    def ldg16(arr, i):
        """arr[i], arr[i+1] of a uint64 array (one 16-byte load on the GPU)."""
        return np.uint64(arr[i]), np.uint64(arr[i + 1])

    def syncwarp():
        cuda.syncthreads()

    def cp_async16(dst, di, src, si, nbytes=16):
        """dst[di:di+2] = src[si:si+2] (uint64 views), zero-filled when nbytes == 0."""
        if nbytes:
            dst[di] = np.int64(src[si]).view(np.uint64)
            dst[di + 1] = np.int64(src[si + 1]).view(np.uint64)
        else:
            dst[di] = 0
            dst[di + 1] = 0

    def cp_commit():
        pass

    def mbar_init(mbar, i, count):
        pass

    def mbar_expect(mbar, i, nbytes):
        pass

    def mbar_wait(mbar, i, parity):
        pass

    def fence_proxy_async():
        pass

    def bulk_copy(dst, di, src, si, nbytes, mbar, mi):
        """dst[di:di+nbytes/8] = src[si:...] (uint64 views): one TMA bulk copy on the GPU."""
        for k in range(nbytes // 8):
            dst[di + k] = np.int64(src[si + k]).view(np.uint64)

    def smem_base(arr, i):
        """Shared-memory "address" of uint64 element ``i`` (simulator: its uint32 word index)."""
        return 2 * i

    def lds32(d32, base, woff):
        """The uint32 word ``woff`` words past ``base`` (a ``smem_base`` address)."""
        return np.uint32(d32[base + woff])

    def decode_pair(d32, e, lmask, pos, vbase):
        """SMBD: this lane's A-fragment register from its half-bitmap entry ``e``.

        ``e`` = bitmap half-word (low 32 bits) | value offset of that half-word (high 32 bits).
        The lane's two elements are bits ``pos`` and ``pos + 1`` of the word; the first set one is
        value ``offset + popc(word & lmask)``; the register holds (low, high) = (element 0,
        element 1), zeros for unset bits.
        """
        e = int(e)
        w = e & 0xFFFFFFFF
        idx = (e >> 32) + bin(w & int(lmask)).count("1")
        a = vbase + (idx >> 1)
        pair = (int(d32[a]) | (int(d32[a + 1]) << 32)) >> (16 * (idx & 1))
        return select_pair(w, pos, pair & 0xFFFF, (pair >> 16) & 0xFFFF)

    def select_pair(w, pos, first, second):
        """The A register of the lane's elements at bits ``pos``, ``pos + 1`` of ``w``: the set ones
        take the next values in order (``first``, then ``second``), the unset ones are zero."""
        b0, b1 = (int(w) >> int(pos)) & 1, (int(w) >> (int(pos) + 1)) & 1
        if b0 and b1:
            return np.uint32(first | (second << 16))
        if b0:
            return np.uint32(first)
        if b1:
            return np.uint32(first << 16)
        return np.uint32(0)

    def cp_wait0():
        pass

    cp_wait1 = cp_wait2 = cp_wait3 = cp_wait0

    def ptr_of(arr):
        """Raw device address of ``arr``'s data (simulator: 0; offsets index the array)."""
        return 0

    def cp16(d64, dst_base, dst_off, src, src_ptr, src_off, pred):
        """If ``pred``: 16 bytes from byte ``src_off`` of ``src`` (an int64 view) to the shared
        address ``dst_base`` + ``dst_off`` bytes (one predicated ``cp.async.cg`` on the GPU)."""
        if pred:
            di = (int(dst_base) * 4 + int(dst_off)) // 8
            si = int(src_off) // 8
            d64[di] = np.int64(src[si]).view(np.uint64)
            d64[di + 1] = np.int64(src[si + 1]).view(np.uint64)

    def shfl_idx(scr, tid, val, src_lane):
        """Warp broadcast of lane ``src_lane``'s uint32 (GPU: shfl.sync.idx)."""
        scr[tid] = val
        cuda.syncthreads()
        out = scr[(tid & ~31) + int(src_lane)]
        cuda.syncthreads()
        return type(val)(out)

    def shfl_up(scr, tid, val, delta):
        """Warp shuffle-up of a uint32 (GPU: shfl.sync.up)."""
        lane = tid & 31
        scr[tid] = val
        cuda.syncthreads()
        out = scr[tid - delta] if lane >= delta else scr[tid]
        cuda.syncthreads()
        return type(val)(out)

    def shfl_xor(scr, tid, val, mask):
        """Butterfly shuffle of a float32 (GPU: shfl.sync.bfly)."""
        scr[tid] = val
        cuda.syncthreads()
        out = scr[tid ^ mask]
        cuda.syncthreads()
        return type(val)(out)

    def _half_pair(word):
        w = int(word)
        return _f16(w & 0xFFFF), _f16(w >> 16)

    def mma(scr, tid, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A(16x16, row) * B(16x8, col) + C with the m16n8k16 register layout (fp32 math)."""
        base = (tid >> 5) * 32 * 6
        lane = tid & 31
        for j, r in enumerate((a0, a1, a2, a3, b0, b1)):
            scr[base + lane * 6 + j] = np.uint32(r)
        cuda.syncthreads()
        gid, tig = lane >> 2, lane & 3
        out = [c0, c1, c2, c3]
        for oi in range(4):
            row = gid + 8 * (oi >> 1)
            col = 2 * tig + (oi & 1)
            acc = 0.0
            for k in range(16):
                # A[row][k]: lane (row%8)*4 + (k%8)//2, register (row>=8) + 2*(k>=8), half k%2
                al = (row & 7) * 4 + ((k & 7) >> 1)
                areg = (row >> 3) + 2 * (k >> 3)
                a = _half_pair(scr[base + al * 6 + areg])[k & 1]
                # B[k][col]: lane col*4 + (k%8)//2, register (k>=8), half k%2
                bl = col * 4 + ((k & 7) >> 1)
                b = _half_pair(scr[base + bl * 6 + 4 + (k >> 3)])[k & 1]
                acc += a * b
            out[oi] = np.float32(out[oi] + np.float32(acc))
        cuda.syncthreads()
        return out[0], out[1], out[2], out[3]

else:  # pragma: no cover - GPU only
    from llvmlite import ir
    from numba import cuda
    from numba.cuda.extending import intrinsic

    try:  # numba-cuda >= 0.20 carries its own type system
        from numba.cuda import cgutils, types
    except ImportError:  # the CUDA target bundled with numba
        from numba.core import cgutils, types

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
    def _ldg16(typingctx, arr, idx):
        sig = types.UniTuple(types.uint64, 2)(arr, types.int64)

        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
            vty = ir.VectorType(ir.IntType(64), 2)
            vec = builder.load(builder.bitcast(ptr, vty.as_pointer()), align=16)
            parts = [builder.extract_element(vec, ir.Constant(_i32, i)) for i in range(2)]
            return context.make_tuple(builder, sig.return_type, parts)

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

    @intrinsic
    def _cp_async16(typingctx, dst, di, src, si, nbytes):
        sig = types.void(dst, types.int64, src, types.int64, types.int32)

        def codegen(context, builder, sig, args):
            dty, _, sty, _, _ = sig.args
            d = context.make_array(dty)(context, builder, args[0])
            s = context.make_array(sty)(context, builder, args[2])
            dp = cgutils.get_item_pointer(context, builder, dty, d, [args[1]], wraparound=False)
            sp = cgutils.get_item_pointer(context, builder, sty, s, [args[3]], wraparound=False)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_i32, _i8p, _i32]),
                               "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                               side_effect=True)
            builder.call(asm, [_smem_addr(builder, dp), builder.bitcast(sp, _i8p), args[4]])
            return context.get_dummy_value()

        return sig, codegen

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
    _mbar_try = _asm_fn2("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; "
                         "selp.u32 $0, 1, 0, p; }", "=r,r,r,~{memory}", ret=True)
    fence_proxy_async = _asm_stmt("fence.proxy.async.shared::cta;")
    fence_mbar_init = _asm_stmt("fence.mbarrier_init.release.cluster;")

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

    @cuda.jit(device=True, inline=True)
    def mbar_init(mbar, i, count):
        _mbar_init(_smem_base(mbar, i), np.uint32(count))
        fence_mbar_init()

    @cuda.jit(device=True, inline=True)
    def mbar_expect(mbar, i, nbytes):
        _mbar_expect(_smem_base(mbar, i), np.uint32(nbytes))

    @cuda.jit(device=True, inline=True)
    def mbar_wait(mbar, i, parity):
        a = _smem_base(mbar, i)
        while _mbar_try(a, np.uint32(parity)) == 0:
            pass

    @cuda.jit(device=True, inline=True)
    def bulk_copy(dst, di, src, si, nbytes, mbar, mi):
        _bulk(_smem_base(dst, di), src, si, np.uint32(nbytes), _smem_base(mbar, mi))

    cp_commit = _asm_stmt("cp.async.commit_group;")
    cp_wait0 = _asm_stmt("cp.async.wait_group 0;")
    cp_wait1 = _asm_stmt("cp.async.wait_group 1;")
    cp_wait2 = _asm_stmt("cp.async.wait_group 2;")
    cp_wait3 = _asm_stmt("cp.async.wait_group 3;")

    @intrinsic
    def _ptr_of(typingctx, arr):
        sig = types.uint64(arr)

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            return builder.ptrtoint(ary.data, ir.IntType(64))

        return sig, codegen

    @intrinsic
    def _cp16(typingctx, dst, src, off, pred):
        u = types.uint32
        sig = types.void(u, types.uint64, u, u)

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_i32, ir.IntType(64), _i32, _i32]),
                               "{ .reg .pred p; .reg .u64 a; setp.ne.u32 p, $3, 0; cvt.u64.u32 a, $2; "
                               "add.u64 a, $1, a; @p cp.async.cg.shared.global [$0], [a], 16; }",
                               "r,l,r,r,~{memory}", side_effect=True)
            builder.call(asm, args)
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def ptr_of(arr):
        return _ptr_of(arr)

    @cuda.jit(device=True, inline=True)
    def cp16(d64, dst_base, dst_off, src, src_ptr, src_off, pred):
        _cp16(np.uint32(dst_base + dst_off), np.uint64(src_ptr), np.uint32(src_off), np.uint32(pred))

    @cuda.jit(device=True, inline=True)
    def shfl_idx(scr, tid, val, src_lane):
        return np.uint32(cuda.shfl_sync(0xFFFFFFFF, np.int32(val), np.int32(src_lane)))


    @cuda.jit(device=True, inline=True)
    def cp_async16(dst, di, src, si, nbytes=16):
        _cp_async16(dst, di, src, si, np.int32(nbytes))

    @cuda.jit(device=True, inline=True)
    def mma(scr, tid, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma(np.uint32(a0), np.uint32(a1), np.uint32(a2), np.uint32(a3), np.uint32(b0),
                    np.uint32(b1), np.float32(c0), np.float32(c1), np.float32(c2), np.float32(c3))

    @cuda.jit(device=True, inline=True)
    def ldg16(arr, i):
        return _ldg16(arr, i)

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
