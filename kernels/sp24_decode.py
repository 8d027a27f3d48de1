"""The 2:4 tile-mosaic layout (``sparsekit.packed.sp24``) -> dense on the GPU in one kernel: the prefill path of a
layer that keeps only its layout (``prefer="memory"``), which decodes once and runs cuBLAS where the 2:4 kernels
lose to it (docs/kernels-notes.md "v37").

One block of 128 threads per 64x64 tile. A thread writes 8 bytes (4 columns: one 2:4 group) of 8 rows; the 16
threads of a row write its 128 bytes together. A 2:4 tile: the group's two kept values (one 32-bit word of the
A-fragment order) go to the positions its metadata nibble names, zeros elsewhere. A dense tile: two 32-bit words of
its fragment order. Bit patterns are copied (a stored -0.0 stays -0.0); the pruned slots are +0.0, as in
``packed.sp24.to_dense``. Buffers may run past their last slot (``runtime.fusion.equalize_sp24_layouts``): only the
slots the tile table names are read.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import cuda

from sparsekit.packed.sp24 import DENSE_TILE_WORDS, SP_STRIP_WORDS, SP_TILE_WORDS, SP_VALUE_WORDS

from . import kcache

THREADS = 128
_KERNEL = []


def _build():
    i64 = np.int64

    @cuda.jit
    def kernel(dense, sp, tiles, out, gk_n, ldo):
        g = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        tr = g // gk_n
        e = tiles[g]
        slot = i64(e >> 1)
        grp = tid & 15                       # the 2:4 group (4 columns) of this thread
        col = i64(g - tr * gk_n) * 16 + grp  # in 8-byte words of the output row
        for i in range(8):
            row = (tid >> 4) + 8 * i
            s = row >> 4
            rh = (row >> 3) & 1
            gg = row & 7
            if e & 1:                        # 2:4: strip s, compressed group (c, kh, t)
                c = grp >> 3
                kh = (grp >> 2) & 1
                t = grp & 3
                base = slot * SP_TILE_WORDS + s * SP_STRIP_WORDS
                word = i64(sp[base + (((c * 8 + gg) * 4 + t) * 2 + kh) * 2 + rh])
                meta = i64(sp[base + SP_VALUE_WORDS + (gg * 2 + c) * 2 + kh])
                code = (meta >> (4 * (rh * 4 + t))) & 15
                i0 = code & 3
                i1 = code >> 2
                r = (word & 0xFFFF) << (16 * i0)
                if i1 != i0:
                    r |= ((word >> 16) & 0xFFFF) << (16 * i1)
            else:                            # dense: columns q * 16 + kh * 8 + t * 2 + pair, t = t0 and t0 + 1
                q = grp >> 2
                kh = (grp >> 1) & 1
                t0 = (grp & 1) * 2
                base = slot * DENSE_TILE_WORDS + (((s * 4 + q) * 8 + gg) * 4 + t0) * 4 + kh * 2 + rh
                r = (i64(dense[base]) & 0xFFFFFFFF) | (i64(dense[base + 4]) << 32)
            out[i64(tr * 64 + row) * ldo + col] = r

    return kernel


def get_kernel():
    """The decode kernel (built once)."""
    if not _KERNEL:
        _KERNEL.append(kcache.tag(_build(), "sp24_decode", ()))
    return _KERNEL[0]


def sp24_decode(layout) -> torch.Tensor:
    """The dense ``[M, K]`` fp16 weight of a CUDA 2:4 tile-mosaic layout (bit-exact; a view of a buffer whose rows are
    padded to whole tiles), on torch's current stream, with no host synchronization (capturable)."""
    from . import launch
    from .sp24 import _buffers

    m, k = layout.shape
    gm, gk = -(-m // 64), -(-k // 64)
    out = torch.empty((gm * 64, gk * 64), dtype=torch.float16, device=layout.tiles.device)
    if gm * gk:
        dense, sp = _buffers(layout)
        launch.launch_tensors(get_kernel(), gm * gk, THREADS, (dense, sp, layout.tiles, out.view(-1).view(torch.int64)),
                              (gk, gk * 16))
    return out[:m, :k]
