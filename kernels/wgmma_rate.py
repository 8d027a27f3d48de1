"""The product rate of the register-sourced warpgroup MMA on its own (docs/kernels-notes.md "v24"): each warpgroup
of every block issues ``iters`` calls of sp24_ws's products back to back on a staged X slab (two sparse m64nNk32,
``wg_mma2``, or four dense m64nNk16, ``wg_mmad``: 64 x N x 64 multiply-adds either way), with the same A registers
throughout and nothing else in the loop. GPU only (sm_90a; no simulator twin), a diagnostic.

``wait``: after each call's commit, ``"each"`` waits for every group (what the kernels do), ``"lag1"`` for all
but the newest, ``"end"`` only after the loop. Shared memory holds no data (the rate does not depend on it).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import cuda

from .common import SCRATCH_WORDS
from ._warp_intrinsics import byte_addr
from ._wg_intrinsics_ptx import _tied, wg_commit, wg_mma2, wg_mmad, wg_wait0
from .block import dynamic_smem
from .sp24_wg import x_desc

WAITS = ("each", "lag1", "end")
_wait1 = _tied("wgmma.wait_group.sync.aligned 1;")
_KERNELS: dict = {}


def _slab(n: int) -> int:
    """Bytes between the two X slabs (``n`` x 128 bytes each) the calls alternate on; 0 at 256 tokens, where two
    would pass the 48 KB of shared memory a launch gets without opting in."""
    return n * 128 if n <= 128 else 0


def _build(N: int, SPARSE: bool, WAIT: int):
    ZERO = (np.float32(0.0),) * (N // 2)
    SLAB = _slab(N)
    u32 = np.uint32

    @cuda.jit(max_registers=168)
    def kernel(out, iters):
        d64, _, _ = dynamic_smem()
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        tid = cuda.threadIdx.x
        base = byte_addr(d64, 0)
        acc = ZERO
        v = u32(tid)
        a = (v, v, v, v, v, v, v, v)
        meta = u32(0x44444444)
        for i in range(iters):
            sb = base + u32((i & 1) * SLAB)
            if SPARSE:
                acc = wg_mma2(scr, tid, a, meta, meta, x_desc(sb), x_desc(sb + u32(512)), acc)
            else:
                acc = wg_mmad(scr, tid, a + a, x_desc(sb), x_desc(sb + u32(256)), x_desc(sb + u32(512)),
                              x_desc(sb + u32(768)), acc)
            wg_commit()
            if WAIT == 0:
                acc = wg_wait0(acc)
            elif WAIT == 1:
                acc = _wait1(acc)
        acc = wg_wait0(acc)
        s = np.float32(0.0)
        for j in range(N // 2):
            s += acc[j]
        out[cuda.blockIdx.x * cuda.blockDim.x + tid] = s

    return kernel


def product_rate(n: int, sparse: bool, wait: str, groups: int, iters: int = 2000) -> dict:
    """``{"us", "tflops"}``: one launch of ``groups`` warpgroups per block (2 blocks per SM for one warpgroup,
    else one) for ``n`` tokens (64, 128 or 256); ``tflops``: dense-equivalent (2 x 64 x n x 64 per call and
    warpgroup)."""
    if n not in (64, 128, 256) or wait not in WAITS or groups not in (1, 2, 3):
        raise ValueError("product_rate takes n 64, 128 or 256, wait in WAITS and 1-3 warpgroups")
    key = (n, sparse, wait)
    if key not in _KERNELS:
        _KERNELS[key] = _build(n, sparse, WAITS.index(wait))
    kern = _KERNELS[key]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks, threads = sms * (2 if groups == 1 else 1), 128 * groups
    out = cuda.device_array(blocks * threads, np.float32)
    dyn = _slab(n) + n * 128 + 1024
    kern[blocks, threads, 0, dyn](out, 10)      # compile and warm up
    cuda.synchronize()
    t0, t1 = cuda.event(), cuda.event()
    t0.record()
    kern[blocks, threads, 0, dyn](out, iters)
    t1.record()
    t1.synchronize()
    us = cuda.event_elapsed_time(t0, t1) * 1e3
    return {"us": us, "tflops": 2 * 64 * n * 64 * iters * blocks * groups / (us * 1e-6) / 1e12}
