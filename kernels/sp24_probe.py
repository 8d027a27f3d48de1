"""One ``mma.sp`` m16n8k32 (selector 0) on one warp, with every lane's registers given by the caller:
the fragment contract, checked on its own (tests/test_sp24_sim.py under the simulator,
scripts/gpu_check_sp24.py on the device, where it is the real instruction)."""
from __future__ import annotations

import numpy as np
import torch
from numba import cuda

from ._intrinsics import SCRATCH_WORDS
from ._sp_intrinsics import mma_sp

_KERNEL: list = []


def _kernel():
    if not _KERNEL:
        @cuda.jit
        def k(a, b, meta, c, d):
            scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
            ln = cuda.threadIdx.x
            r = mma_sp(scr, ln, a[4 * ln], a[4 * ln + 1], a[4 * ln + 2], a[4 * ln + 3], b[4 * ln], b[4 * ln + 1],
                       b[4 * ln + 2], b[4 * ln + 3], c[4 * ln], c[4 * ln + 1], c[4 * ln + 2], c[4 * ln + 3], meta[ln])
            for i in range(4):
                d[4 * ln + i] = r[i]

        _KERNEL.append(k)
    return _KERNEL[0]


def mma_sp_once(a: torch.Tensor, b: torch.Tensor, meta: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``d[32, 4]`` (fp32) from lane registers ``a[32, 4]``, ``b[32, 4]`` (int32 bit patterns of fp16
    pairs), ``meta[32]`` (int32) and ``c[32, 4]`` (fp32), all on one device (CPU under the simulator)."""
    from .launch import launch_tensors

    d = torch.empty((32, 4), dtype=torch.float32, device=c.device)
    ts = [t.contiguous().reshape(-1) for t in (a.to(torch.int32), b.to(torch.int32), meta.to(torch.int32),
                                              c.to(torch.float32))]
    launch_tensors(_kernel(), 1, 32, ts + [d.reshape(-1)], ())
    return d
