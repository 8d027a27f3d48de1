"""The warpgroup kernel's device primitives (``_wg_intrinsics``) for the GPU (sm_90a): Hopper's sparse
warpgroup MMA through inline PTX, with the operand contract ``scripts/checks/gpu_wgmma.py`` pinned down on
an H100 (docs/kernels-notes.md "v16 outcome"): A from registers in ``mma.sp``'s per-warp fragment and
metadata layouts (warp w of the warpgroup: rows 16w .. 16w+15), B from shared memory through a
descriptor whose leading byte offset is the step between 8x8 core matrices along K and whose stride byte
offset is the step along N, D in ``mma``'s per-warp C layout for each 8-token block.

- ``wg_mma2(scr, tid, a, m0, m1, desc0, desc1, acc)``: ``wgmma.fence``, then two ``wgmma.mma_async.sp``
  m64nNk32 (A registers ``a[0:4]`` with metadata ``m0`` and B at ``desc0``, then ``a[4:8]``, ``m1``,
  ``desc1``) accumulating into ``acc`` (N / 2 fp32 per thread; N from the tuple's length). The products
  run asynchronously: ``acc`` may only feed another ``wg_mma2`` until a ``wg_wait*`` returns it.
  (``scr``, ``tid``: the simulator twin's exchange; unused here.)
- ``wg_mmad(scr, tid, a, desc0, desc1, desc2, desc3, acc)``: ``wgmma.fence``, then four dense
  ``wgmma.mma_async`` m64nNk16 (A registers ``a[4q:4q+4]``, ``mma.sync.m16n8k16``'s per-warp A fragment of
  the 16 columns ``16q ..``, B at ``desc_q``): one 64x64 dense tile against 64 K of B. Not yet probed
  on a GPU on its own: the kernels' float64 checks are its test.
- ``wshfl_idx(scr, tid, val, src)``: ``shfl.sync`` of a uint32 within one warp (the simulator twin
  synchronizes that warp only: warp-specialized kernels have warps that never meet a block barrier);
  ``wscan(scr, tid, c)``: the inclusive prefix sum of a uint32 over the warp's lanes (five
  ``shfl.sync.up``, warp-scoped the same way).
- ``strip_a16(scr, tid, tab, d32, wvaddr, aaddr, lmask, pos)``: the 16 A registers of one warp's 16-row strip
  of a staged TCA-BME GroupTile (spmm_ws), branch-free, on 32-bit shared addresses, from the warp's part of
  the table (``spmm_ws._publish_table``): per pair of BitmapTiles, 16 bytes at ``wvaddr`` (the lane's two
  half-words of the bitmaps, then the same with each bit pair's low bit flipped where its high bit is clear)
  and 8 at ``aaddr`` (the shared addresses of the halves' first values). Per BitmapTile: popc of the bits
  below the lane's (``lmask``), two unconditional 16-bit loads, a forward 4-byte extract (``prmt.f4e``) of
  ``common.STRIP_LUT`` at the lane's flipped bit pair (``pos``) that yields the selector, and the permute.
  The value region must have 4 readable bytes past its end. ``wsync(scr, tid)``: ``bar.warp.sync`` (the
  simulator twin waits for the warp only).
- ``lds_a8(d64, addr)``: the 8 A registers of a staged strip, 16 bytes at ``addr`` and 16 at ``addr +
  512``, as two ``ld.shared.v4.u32`` straight into 32-bit registers (no 64-bit halves to split: ptxas
  turned those into register copies that mixed up the A operands of the second tile column's products).
- ``wg_mmss(a0, a1, a2, a3, b0, b1, b2, b3, acc)``: ``wgmma.fence``, then four dense ``wgmma.mma_async``
  m64nNk16 with both operands in shared memory (A at descriptor ``a_q``, K-major 8x8 core matrices as B's;
  B at ``b_q``): one 64x64 dense tile against 64 K of B, with no A registers to guard (spmm_pf).
- ``wg_bar(scr, tid)``: the warpgroup's 128 threads meet (``bar.sync`` on named barrier 1 + warpgroup).
- ``regs_inc232()``, ``regs_dec40()``, ``regs_inc168()``, ``regs_dec168()``: ``setmaxnreg`` (the warpgroup's
  registers a thread raised or lowered to that count; every thread of the warpgroup runs it).
- ``wg_commit()``: ``wgmma.commit_group`` (the products issued since the last one form a group).
- ``wg_wait0(acc)``: ``wgmma.wait_group 0`` (every product group done), returning ``acc`` through the
  wait so that nothing reads it earlier. (Products with A in registers must wait for this one: ptxas
  gives every step's A operand the same registers, so the kernels retire a step's products before the
  next step's loads; docs/kernels-notes.md "v17".)
- ``wg_wait1(acc)``: ``wgmma.wait_group 1`` (all but the newest group done): for products whose operands
  are all in shared memory (``wg_mmss``), where no register of an earlier group can be overwritten.
- ``wg_hold(acc)``: no instruction; ``acc`` passes through an empty asm statement (a second tuple
  waited for by the same ``wg_wait*``).
- ``wg_keep(a, m0, m1, guard)``: a product's 8 A registers and two metadata words read by a store that never
  runs (predicated on ``guard`` being all ones, which ptxas cannot rule out; an empty asm statement reaches ptxas
  as nothing, and a definition would make it serialize the products), so they stay live and ptxas gives nothing
  else their registers until that point: placed after the ``wg_wait1`` that retires their
  group, it lets the next group's operands load while it runs (sp24_ws's pipelined turns).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import cuda
from numba.cuda.extending import intrinsic

from ._intrinsics_ptx import _asm_fn2, _asm_stmt, _asm_tuple
from .common import STRIP_LUT
from .compat_numba import cuda_typing

__all__ = ["lds_a8", "regs_dec40", "regs_dec168", "regs_inc168", "regs_inc232", "strip_a16", "wscan", "wsync", "wg_bar",
           "wg_commit", "wg_hold", "wg_keep", "wg_mma2", "wg_mmad", "wg_mmss", "wg_wait0", "wg_wait1", "wshfl_idx"]

types, _ = cuda_typing()
_i32, _i64, _f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()


def _mma2_asm(n: int) -> tuple[str, str]:
    r = n // 2
    d = ",".join(f"${i}" for i in range(r))
    a0 = ",".join(f"${r + i}" for i in range(4))
    a1 = ",".join(f"${r + 4 + i}" for i in range(4))
    m0, m1, b0, b1 = r + 8, r + 9, r + 10, r + 11
    op = f"wgmma.mma_async.sp.sync.aligned.m64n{n}k32.f32.f16.f16"
    text = ("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.fence.sync.aligned;\n"
            f"{op} {{{d}}}, {{{a0}}}, ${b0}, ${m0}, 0, p, 1, 1, 0;\n"
            f"{op} {{{d}}}, {{{a1}}}, ${b1}, ${m1}, 0, p, 1, 1, 0;\n}}")
    cons = ",".join(["=f"] * r + ["r"] * 10 + ["l", "l"] + [str(i) for i in range(r)] + ["~{memory}"])
    return text, cons


def _product_codegen(text: str, cons: str, na: int, nwords: int, ndesc: int, r: int):
    """The codegen of a product intrinsic ``(a, *words, *descs, acc)``: ``na`` A registers (a tuple; none with
    ``na`` = 0, where the operands start with the words), then ``nwords`` 32-bit words, ``ndesc`` 64-bit
    descriptors, and ``r`` fp32 accumulators tied in and out."""
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.LiteralStructType([_f32] * r), [_i32] * (na + nwords) + [_i64] * ndesc + [_f32] * r)
        head = [builder.extract_value(args[0], i) for i in range(na)] + list(args[1:-1]) if na else list(args[:-1])
        ins = head + [builder.extract_value(args[-1], i) for i in range(r)]
        res = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True), ins)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(r)])

    return codegen


@intrinsic
def _wg_mma2(typingctx, a, m0, m1, desc0, desc1, acc):
    r = acc.count
    u, f, d = types.uint32, types.float32, types.uint64
    sig = types.UniTuple(f, r)(types.UniTuple(u, 8), u, u, d, d, types.UniTuple(f, r))
    return sig, _product_codegen(*_mma2_asm(2 * r), 8, 2, 2, r)


def _mmad_asm(n: int) -> tuple[str, str]:
    r = n // 2
    d = ",".join(f"${i}" for i in range(r))
    op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16"
    lines = ["{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.fence.sync.aligned;\n"]
    for q in range(4):
        a = ",".join(f"${r + 4 * q + i}" for i in range(4))
        lines.append(f"{op} {{{d}}}, {{{a}}}, ${r + 16 + q}, p, 1, 1, 0;\n")
    cons = ",".join(["=f"] * r + ["r"] * 16 + ["l"] * 4 + [str(i) for i in range(r)] + ["~{memory}"])
    return "".join(lines) + "}", cons


@intrinsic
def _wg_mmad(typingctx, a, desc0, desc1, desc2, desc3, acc):
    r = acc.count
    u, f, d = types.uint32, types.float32, types.uint64
    sig = types.UniTuple(f, r)(types.UniTuple(u, 16), d, d, d, d, types.UniTuple(f, r))
    return sig, _product_codegen(*_mmad_asm(2 * r), 16, 0, 4, r)


def _mmss_asm(n: int) -> tuple[str, str]:
    r = n // 2
    d = ",".join(f"${i}" for i in range(r))
    op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16"
    lines = ["{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.fence.sync.aligned;\n"]
    for q in range(4):
        lines.append(f"{op} {{{d}}}, ${r + q}, ${r + 4 + q}, p, 1, 1, 0, 0;\n")
    cons = ",".join(["=f"] * r + ["l"] * 8 + [str(i) for i in range(r)] + ["~{memory}"])
    return "".join(lines) + "}", cons


@intrinsic
def _wg_mmss(typingctx, a0, a1, a2, a3, b0, b1, b2, b3, acc):
    r = acc.count
    f, d = types.float32, types.uint64
    sig = types.UniTuple(f, r)(d, d, d, d, d, d, d, d, types.UniTuple(f, r))
    return sig, _product_codegen(*_mmss_asm(2 * r), 0, 0, 8, r)


def _tied(text: str):
    """An intrinsic running ``text`` with a tuple of fp32 registers tied in and out."""
    @intrinsic
    def _fn(typingctx, acc):
        r = acc.count
        sig = types.UniTuple(types.float32, r)(types.UniTuple(types.float32, r))

        def codegen(context, builder, sig, args):
            cons = ",".join(["=f"] * r + [str(i) for i in range(r)] + ["~{memory}"])
            fnty = ir.FunctionType(ir.LiteralStructType([_f32] * r), [_f32] * r)
            res = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True),
                               [builder.extract_value(args[0], i) for i in range(r)])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(r)])

        return sig, codegen

    return _fn


_lds_a8 = _asm_tuple("ld.shared.v4.u32 {$0,$1,$2,$3}, [$8];\nld.shared.v4.u32 {$4,$5,$6,$7}, [$8+512];", 32, 8,
                     "=r,=r,=r,=r,=r,=r,=r,=r,r,~{memory}")


def _strip_a16_asm() -> str:
    lines = ["{", ".reg .u32 l0, l1;", f"mov.u32 l0, {STRIP_LUT[0]:#x};", f"mov.u32 l1, {STRIP_LUT[1]:#x};"]
    for j in range(16):
        lines.append(f".reg .u32 w{j}, v{j}, a{j}, t{j}, f{j}, s{j}, k{j}, q{j};")
    for p in range(8):        # the loads first, so that their latencies overlap
        lines.append(f"ld.shared.v4.u32 {{w{2 * p}, w{2 * p + 1}, v{2 * p}, v{2 * p + 1}}}, [$16+{16 * p}];")
        lines.append(f"ld.shared.v2.u32 {{a{2 * p}, a{2 * p + 1}}}, [$17+{8 * p}];")
    for j in range(16):
        lines.append(f"and.b32 t{j}, w{j}, $18;\npopc.b32 t{j}, t{j};\nmad.lo.u32 a{j}, t{j}, 2, a{j};\n"
                     f"ld.shared.u16 f{j}, [a{j}];\nld.shared.u16 s{j}, [a{j}+2];\n"
                     f"shr.b32 k{j}, v{j}, $19;\nprmt.b32.f4e q{j}, l0, l1, k{j};\nprmt.b32 ${j}, f{j}, s{j}, q{j};")
    return "\n".join(lines) + "\n}"


@intrinsic
def _strip_a16(typingctx, wvaddr, aaddr, lmask, pos):
    u = types.uint32
    sig = types.UniTuple(u, 16)(u, u, u, u)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.LiteralStructType([_i32] * 16), [_i32] * 4)
        cons = ",".join(["=r"] * 16 + ["r"] * 4 + ["~{memory}"])
        res = builder.call(ir.InlineAsm(fnty, _strip_a16_asm(), cons, side_effect=True), args)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(16)])

    return sig, codegen


@cuda.jit(device=True, inline=True)
def strip_a16(scr, tid, tab, d32, wvaddr, aaddr, lmask, pos):
    u = np.uint32
    return _strip_a16(u(wvaddr), u(aaddr), u(lmask), u(pos))


@cuda.jit(device=True, inline=True)
def wsync(scr, tid):
    cuda.syncwarp(0xFFFFFFFF)


@cuda.jit(device=True, inline=True)
def lds_a8(d64, addr):
    return _lds_a8(np.uint32(addr))


@cuda.jit(device=True, inline=True)
def wg_mma2(scr, tid, a, m0, m1, desc0, desc1, acc):
    return _wg_mma2(a, m0, m1, desc0, desc1, acc)


@cuda.jit(device=True, inline=True)
def wg_mmad(scr, tid, a, desc0, desc1, desc2, desc3, acc):
    return _wg_mmad(a, desc0, desc1, desc2, desc3, acc)


@cuda.jit(device=True, inline=True)
def wg_mmss(a0, a1, a2, a3, b0, b1, b2, b3, acc):
    return _wg_mmss(a0, a1, a2, a3, b0, b1, b2, b3, acc)


_bar_wg = _asm_fn2("bar.sync $0, $1;", "r,r,~{memory}")


@cuda.jit(device=True, inline=True)
def wg_bar(scr, tid):
    """The 128 threads of ``tid``'s warpgroup meet (named barrier 1 + warpgroup; 0 is the block's)."""
    _bar_wg(np.uint32(1 + (tid >> 7)), np.uint32(128))


@intrinsic
def _keep(typingctx, a, m0, m1, guard):
    u = types.uint32
    sig = types.void(types.UniTuple(u, 8), u, u, u)
    # a store that never runs (``guard`` is never all ones) but that ptxas cannot drop: it reads the registers
    text = ("{\n.reg .pred p;\n.reg .u32 z;\nmov.u32 z, 0;\nsetp.eq.u32 p, $10, 0xffffffff;\n"
            "@p st.shared.v4.b32 [z], {$0,$1,$2,$3};\n@p st.shared.v4.b32 [z+16], {$4,$5,$6,$7};\n"
            "@p st.shared.v2.b32 [z+32], {$8,$9};\n}")

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(32)] * 11)
        ins = [builder.extract_value(args[0], i) for i in range(8)] + [args[1], args[2], args[3]]
        builder.call(ir.InlineAsm(fnty, text, ",".join(["r"] * 11) + ",~{memory}", side_effect=True), ins)
        return context.get_dummy_value()

    return sig, codegen


@cuda.jit(device=True, inline=True)
def wg_keep(a, m0, m1, guard):
    _keep(a, np.uint32(m0), np.uint32(m1), np.uint32(guard))


regs_inc232 = _asm_stmt("setmaxnreg.inc.sync.aligned.u32 232;")
regs_dec40 = _asm_stmt("setmaxnreg.dec.sync.aligned.u32 40;")
regs_inc168 = _asm_stmt("setmaxnreg.inc.sync.aligned.u32 168;")
regs_dec168 = _asm_stmt("setmaxnreg.dec.sync.aligned.u32 168;")
wg_commit = _asm_stmt("wgmma.commit_group.sync.aligned;")
wg_wait0 = _tied("wgmma.wait_group.sync.aligned 0;")
wg_wait1 = _tied("wgmma.wait_group.sync.aligned 1;")
wg_hold = _tied("")


@cuda.jit(device=True, inline=True)
def wshfl_idx(scr, tid, val, src):
    return np.uint32(cuda.shfl_sync(0xFFFFFFFF, np.int32(val), np.int32(src)))


_WSCAN_PTX = "{\n.reg .u32 t;\n.reg .pred p;\nmov.b32 $0, $1;\n" + "".join(
    f"shfl.sync.up.b32 t|p, $0, {d}, 0, -1;\n@p add.u32 $0, $0, t;\n" for d in (1, 2, 4, 8, 16)) + "}"


@intrinsic
def _wscan(typingctx, c):
    sig = types.uint32(types.uint32)

    def codegen(context, builder, sig, args):
        return builder.call(ir.InlineAsm(ir.FunctionType(_i32, [_i32]), _WSCAN_PTX, "=&r,r", side_effect=True), args)

    return sig, codegen


@cuda.jit(device=True, inline=True)
def wscan(scr, tid, c):
    return _wscan(np.uint32(c))

