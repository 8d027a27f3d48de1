"""One Hopper ``wgmma.mma_async.sp`` (m64n8k32 or m64n16k32, fp16 in, fp32 accumulate, A from registers, B from
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
- ``c`` (fp32 [128, N/2]): each thread's accumulators; ``d`` (fp32 [128, N/2]) receives them after.
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

B_WORDS = 1024          # the shared tile: 4 KB (a 32 x 16 fp16 B tile takes 1 KB)
NS = (8, 16)            # token widths the probe builds: N = 16 also pins down the stride byte offset


def _asm(n: int) -> tuple[str, str]:
    """The fence, the product (m64{n}k32, selector 0, scale-d from a nonzero word: d = A B + d, A and B
    unscaled, B not transposed), then the wait. Operands: d (tied to the accumulators), 4 A registers,
    the B descriptor, the metadata, the scale-d word."""
    r = n // 2
    d = ",".join(f"${i}" for i in range(r))
    a = ",".join(f"${r + i}" for i in range(4))
    text = ("{\n.reg .pred p;\n" f"setp.ne.b32 p, ${r + 6}, 0;\n" "wgmma.fence.sync.aligned;\n"
            f"wgmma.mma_async.sp.sync.aligned.m64n{n}k32.f32.f16.f16 {{{d}}}, {{{a}}}, ${r + 4}, ${r + 5}, 0, p, 1, 1, 0;\n"
            "wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n}")
    constraints = ",".join(["=f"] * r + ["r"] * 4 + ["l", "r", "r"] + [str(i) for i in range(r)] + ["~{memory}"])
    return text, constraints


@intrinsic
def _wgmma_sp(typingctx, a0, a1, a2, a3, desc, meta, one, acc):
    """``acc`` (a tuple of N/2 fp32 accumulators) gives N; returns the N/2 results."""
    r = acc.count
    text, constraints = _asm(2 * r)
    u, f = types.uint32, types.float32
    sig = types.UniTuple(f, r)(u, u, u, u, types.uint64, u, u, types.UniTuple(f, r))

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.LiteralStructType([_f32] * r), [_i32] * 4 + [_i64] + [_i32] * 2 + [_f32] * r)
        ins = list(args[:7]) + [builder.extract_value(args[7], i) for i in range(r)]
        res = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), ins)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(r)])

    return sig, codegen


_KERNELS: dict = {}


def _stage(bimg, desc, nwords):
    """The B image into shared memory, then the descriptor with the tile's address added."""
    sm = cuda.shared.array(B_WORDS, np.int32, alignment=128)
    t = cuda.threadIdx.x
    for i in range(t, nwords, 128):
        sm[i] = bimg[i]
    fence_proxy_async()       # generic-proxy stores, then reads by the async proxy (the tensor core)
    cuda.syncthreads()
    addr = np.uint64(smem_base(sm, 0))
    return np.uint64(desc[0]) | ((addr & np.uint64(0x3FFFF)) >> np.uint64(4))


def _acc4(c, t):
    return (np.float32(c[4 * t]), np.float32(c[4 * t + 1]), np.float32(c[4 * t + 2]), np.float32(c[4 * t + 3]))


def _acc8(c, t):
    return (np.float32(c[8 * t]), np.float32(c[8 * t + 1]), np.float32(c[8 * t + 2]), np.float32(c[8 * t + 3]),
            np.float32(c[8 * t + 4]), np.float32(c[8 * t + 5]), np.float32(c[8 * t + 6]), np.float32(c[8 * t + 7]))


def get_kernel(n: int = 8):
    """The probe kernel for ``n`` tokens (8 or 16): one warpgroup, one product."""
    if n not in NS:
        raise ValueError(f"the wgmma.sp probe is built for N in {NS}, not {n}")
    if n not in _KERNELS:
        device = cuda.jit(device=True, inline=True)
        stage, acc = device(_stage), device(_acc4 if n == 8 else _acc8)
        R = n // 2

        @cuda.jit
        def k(a, meta, bimg, desc, c, d, nwords):
            dsc = stage(bimg, desc, nwords)
            t = cuda.threadIdx.x
            r = _wgmma_sp(np.uint32(a[4 * t]), np.uint32(a[4 * t + 1]), np.uint32(a[4 * t + 2]),
                          np.uint32(a[4 * t + 3]), dsc, np.uint32(meta[t]), np.uint32(1), acc(c, t))
            for i in range(R):
                d[R * t + i] = r[i]

        _KERNELS[n] = k
    return _KERNELS[n]


def wgmma_sp_once(a: torch.Tensor, meta: torch.Tensor, bimg: torch.Tensor, desc: int, c: torch.Tensor) -> torch.Tensor:
    """``d[128, N/2]`` (fp32) from the threads' registers and a B image (see the module docstring); N (8 or
    16) is given by ``c[128, N/2]``."""
    from .launch import launch_tensors

    if bimg.numel() > B_WORDS:
        raise ValueError(f"the B image has {bimg.numel()} words; the probe's shared tile holds {B_WORDS}")
    n = 2 * c.shape[1]
    d = torch.full((128, n // 2), float("nan"), dtype=torch.float32, device=c.device)
    dt = torch.tensor([desc - (1 << 64) if desc >= 1 << 63 else desc], dtype=torch.int64, device=c.device)
    ts = [a.to(torch.int32).contiguous().reshape(-1), meta.to(torch.int32).contiguous().reshape(-1),
          bimg.to(torch.int32).contiguous().reshape(-1), dt, c.to(torch.float32).contiguous().reshape(-1),
          d.reshape(-1)]
    launch_tensors(get_kernel(n), 1, 128, ts, (bimg.numel(),))
    return d
