"""The tensor form of Hopper's bulk copy (``cp.async.bulk.tensor``, a tensor map made on the host), for the copy
probe only (issue 21, docs/kernels-notes.md "v30"): does it land more bytes a cycle than the one-dimensional bulk
copy, alone or multicast over a cluster, as cuBLAS's kernels use it? GPU only (the simulator has no tensor maps);
imported by ``copy_probe`` only when a probe asks for it. A diagnostic, never on a product path.

``tensor_map_rows(t, box_rows)``: the 128-byte tensor map (on ``t``'s device, as int64 [16]) of an int64 tensor
viewed as rows of 128 bytes (16 words), boxes of ``box_rows`` rows, optionally swizzled; ``tma_rows`` /
``tma_rows_mc`` copy box ``row`` of it into shared memory, completing on an mbarrier (``_mc``: into every block of
the cluster in ``mask``). ``const_map``: the same map as a host record for the kernel's constant memory.
"""
from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import cuda
from numba.cuda.extending import intrinsic

from ._intrinsics_ptx import _smem_base
from .compat_numba import cuda_typing

types, cgutils = cuda_typing()
_i16, _i32, _i64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
_i8p = ir.IntType(8).as_pointer()


def tensor_map_rows(t: torch.Tensor, box_rows: int, swizzle: bool = False) -> torch.Tensor:
    """The tensor map of ``t`` (int64, contiguous, a multiple of 16 words) as ``[rows, 16]`` words, boxes of
    ``box_rows`` x 16, through the driver's ``cuTensorMapEncodeTiled`` (cuda-python's binding); ``swizzle``: the
    128-byte swizzle of cuBLAS's tiles (the destination then 1024-byte aligned)."""
    from cuda.bindings import driver as drv

    if t.dtype != torch.int64 or not t.is_contiguous() or t.numel() % 16 or not 1 <= box_rows <= 256:
        raise ValueError("tensor_map_rows takes a contiguous int64 tensor of whole 128-byte rows, boxes of 1-256 rows")
    rows = t.numel() // 16
    u64, u32, sw = drv.cuuint64_t, drv.cuuint32_t, drv.CUtensorMapSwizzle
    err, tmap = drv.cuTensorMapEncodeTiled(
        drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_INT64, u32(2), t.data_ptr(), [u64(16), u64(rows)], [u64(128)],
        [u32(16), u32(box_rows)], [u32(1), u32(1)], drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        sw.CU_TENSOR_MAP_SWIZZLE_128B if swizzle else sw.CU_TENSOR_MAP_SWIZZLE_NONE,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: {err}")
    words = np.array([int(w) for w in tmap.opaque], dtype=np.uint64).view(np.int64)
    return torch.from_numpy(words.copy()).to(t.device)


MAP_RECORD = np.dtype([("w", np.int64, (16,))])   # one tensor map: numba aligns a record array to its 128 bytes


def const_map(tmap: torch.Tensor) -> np.ndarray:
    """``tmap`` (from :func:`tensor_map_rows`) as a one-record host array, for ``cuda.const.array_like``: the map in
    the kernel's constant memory (128-byte aligned), as CUDA C passes one in a ``__grid_constant__`` parameter or a
    ``__constant__`` variable, instead of in global memory."""
    rec = np.zeros(1, dtype=MAP_RECORD)
    rec["w"][0] = tmap.cpu().numpy()
    return rec


def _map_pointer(context, builder, aty, arr):
    """The tensor map array's first byte, as a generic pointer."""
    ary = context.make_array(aty)(context, builder, arr)
    return builder.bitcast(cgutils.get_item_pointer(context, builder, aty, ary, [ir.Constant(_i64, 0)],
                                                    wraparound=False), _i8p)


def _tensor_copy(mc: bool):
    """The intrinsic ``(dst_addr, tmap, row, mbar_addr, mask)``: one box into shared memory (``mc``: multicast to
    the blocks in ``mask``), column 0, row ``row``."""
    text = ("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
            + (".multicast::cluster" if mc else "") + " [$0], [$1, {$2, $3}], [$4]" + (", $5;" if mc else ";"))
    fnty = ir.FunctionType(ir.VoidType(), [_i32, _i8p, _i32, _i32, _i32] + ([_i16] if mc else []))
    asm = ir.InlineAsm(fnty, text, "r,l,r,r,r" + (",h" if mc else "") + ",~{memory}", side_effect=True)

    @intrinsic
    def _copy(typingctx, dst_addr, tmap, row, mbar_addr, mask):
        u = types.uint32
        sig = types.void(u, tmap, u, u, u)

        def codegen(context, builder, sig, args):
            ops = [args[0], _map_pointer(context, builder, sig.args[1], args[1]), ir.Constant(_i32, 0), args[2],
                   args[3]]
            builder.call(asm, ops + ([builder.trunc(args[4], _i16)] if mc else []))
            return context.get_dummy_value()

        return sig, codegen

    return _copy


_tma, _tma_mc = _tensor_copy(False), _tensor_copy(True)


@intrinsic
def _tma_prefetch(typingctx, tmap):
    sig = types.void(tmap)

    def codegen(context, builder, sig, args):
        builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_i8p]), "prefetch.tensormap [$0];", "l,~{memory}",
                                  side_effect=True), [_map_pointer(context, builder, sig.args[0], args[0])])
        return context.get_dummy_value()

    return sig, codegen


@cuda.jit(device=True, inline=True)
def tma_prefetch(tmap):
    """Bring the tensor map into the copy engine's descriptor cache before the first copy names it."""
    _tma_prefetch(tmap)


@cuda.jit(device=True, inline=True)
def tma_rows(dst, di, tmap, row, mbar, mi):
    """The box starting at ``row`` (of the map's 128-byte rows) into ``dst`` from word ``di``, completing on barrier
    ``mi`` of ``mbar``."""
    _tma(_smem_base(dst, di), tmap, np.uint32(row), _smem_base(mbar, mi), np.uint32(0))


@cuda.jit(device=True, inline=True)
def tma_rows_mc(dst, di, tmap, row, mbar, mi, mask):
    """``tma_rows`` into every block of the cluster in ``mask``, at the same offsets, each on its own barrier."""
    _tma_mc(_smem_base(dst, di), tmap, np.uint32(row), _smem_base(mbar, mi), np.uint32(mask))
