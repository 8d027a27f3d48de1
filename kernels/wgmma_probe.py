"""One Hopper ``wgmma.mma_async.sp`` (m64n8k32, fp16 in, fp32 accumulate, A from registers, B from
shared memory through a matrix descriptor) on one warpgroup: the probe that pins down its operand
contract before any kernel is built on it (docs/kernels-notes.md "v16"). GPU only (sm_90a): the
simulator has no twin of it.

Why: from 32 tokens on, the tile-row kernels are bound by instruction issue (docs/kernels-notes.md,
v15 outcome). ``mma.sp`` m16n8k32 computes 16x8x32 per warp instruction and needs an ``ldmatrix`` for
its B operand; ``wgmma.mma_async.sp`` m64nNk32 computes 64xNx32 per warpgroup instruction (N up to
256) and reads B from shared memory itself.

Everything the contract leaves open is an input, so that ``scripts/checks/gpu_wgmma.py`` can try each
candidate on the device and keep the one that matches a float64 reference:

- ``a`` (int32 [128, 4]): each thread's four A registers (compressed fp16 pairs);
- ``meta`` (int32 [128]): each thread's metadata register (selector 0);
- ``bimg`` (int32 words): the bytes of the B tile as they are copied, verbatim, to shared memory
  (16-byte aligned), so any core-matrix layout can be tried;
- ``desc`` (int64 [1]): the matrix descriptor without its start address (leading and stride byte
  offsets, base offset, swizzle mode); the kernel adds the tile's shared address (bits 0-13, >> 4);
- ``c`` (fp32 [128, 4]): each thread's accumulators; ``d`` (fp32 [128, 4]) receives them after.
"""
from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import cuda
from numba.cuda.extending import intrinsic

from ._intrinsics_ptx import fence_proxy_async, smem_base
from .compat_numba import cuda_typing

types, _ = cuda_typing()
_i32, _i64, _f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()

B_WORDS = 1024          # the shared tile: 4 KB (a 32 x 8 fp16 B tile takes 512 bytes)

# fence (the accumulators were written by ordinary instructions), the product, then wait for it.
# Operands: $0-$3 d (tied to the accumulators $11-$14), $4-$7 A, $8 the B descriptor, $9 the metadata,
# $10 a nonzero word for scale-d (accumulate: d = A B + d).
_WGMMA_SP = ("{\n.reg .pred p;\nsetp.ne.b32 p, $10, 0;\nwgmma.fence.sync.aligned;\n"
             "wgmma.mma_async.sp.sync.aligned.m64n8k32.f32.f16.f16 {$0,$1,$2,$3}, {$4,$5,$6,$7}, $8, $9, 0, p, 1, 1, 0;\n"
             "wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n}")
_WGMMA_SP_CONSTRAINTS = "=f,=f,=f,=f,r,r,r,r,l,r,r,0,1,2,3,~{memory}"


@intrinsic
def _wgmma_sp(typingctx, a0, a1, a2, a3, desc, meta, one, c0, c1, c2, c3):
    u, f = types.uint32, types.float32
    sig = types.UniTuple(f, 4)(u, u, u, u, types.uint64, u, u, f, f, f, f)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.LiteralStructType([_f32] * 4), [_i32] * 4 + [_i64] + [_i32] * 2 + [_f32] * 4)
        asm = ir.InlineAsm(fnty, _WGMMA_SP, _WGMMA_SP_CONSTRAINTS, side_effect=True)
        res = builder.call(asm, args)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])

    return sig, codegen


_KERNEL: list = []


def get_kernel():
    if not _KERNEL:
        @cuda.jit
        def k(a, meta, bimg, desc, c, d, nwords):
            sm = cuda.shared.array(B_WORDS, np.int32, alignment=128)
            t = cuda.threadIdx.x
            for i in range(t, nwords, 128):
                sm[i] = bimg[i]
            fence_proxy_async()       # generic-proxy stores, then reads by the async proxy (the tensor core)
            cuda.syncthreads()
            addr = np.uint64(smem_base(sm, 0))
            dsc = np.uint64(desc[0]) | ((addr & np.uint64(0x3FFFF)) >> np.uint64(4))
            r = _wgmma_sp(np.uint32(a[4 * t]), np.uint32(a[4 * t + 1]), np.uint32(a[4 * t + 2]),
                          np.uint32(a[4 * t + 3]), dsc, np.uint32(meta[t]), np.uint32(1),
                          np.float32(c[4 * t]), np.float32(c[4 * t + 1]), np.float32(c[4 * t + 2]),
                          np.float32(c[4 * t + 3]))
            for i in range(4):
                d[4 * t + i] = r[i]

        _KERNEL.append(k)
    return _KERNEL[0]


def wgmma_sp_once(a: torch.Tensor, meta: torch.Tensor, bimg: torch.Tensor, desc: int, c: torch.Tensor) -> torch.Tensor:
    """``d[128, 4]`` (fp32) from the threads' registers and a B image (see the module docstring)."""
    from .launch import launch_tensors

    if bimg.numel() > B_WORDS:
        raise ValueError(f"the B image has {bimg.numel()} words; the probe's shared tile holds {B_WORDS}")
    d = torch.full((128, 4), float("nan"), dtype=torch.float32, device=c.device)
    dt = torch.tensor([desc - (1 << 64) if desc >= 1 << 63 else desc], dtype=torch.int64, device=c.device)
    ts = [a.to(torch.int32).contiguous().reshape(-1), meta.to(torch.int32).contiguous().reshape(-1),
          bimg.to(torch.int32).contiguous().reshape(-1), dt, c.to(torch.float32).contiguous().reshape(-1),
          d.reshape(-1)]
    launch_tensors(get_kernel(), 1, 128, ts, (bimg.numel(),))
    return d


def descriptor(lbo: int, sbo: int, swizzle: int = 0, base: int = 0) -> int:
    """A shared-memory matrix descriptor without its start address: leading byte offset (bits 16-29)
    and stride byte offset (bits 32-45), each >> 4; base offset (bits 49-51); swizzle (bits 62-63:
    0 none, 1 128 B, 2 64 B, 3 32 B)."""
    return ((lbo >> 4) & 0x3FFF) << 16 | ((sbo >> 4) & 0x3FFF) << 32 | (base & 7) << 49 | (swizzle & 3) << 62
