"""An all-2:4 tile-mosaic layout (``sparsekit.packed.sp24``) -> cuSPARSELt's compressed buffer
(``sparsekit.packed.cslt``) on the GPU in one kernel, for prefill: cuSPARSELt (``runtime.cusparselt``) multiplies it
on Hopper's sparse tensor cores 1.2-1.4x faster than cuBLAS from about 2048 tokens (docs/kernels-notes.md "v39"),
where the 2:4 kernels do not. It reads and writes ~1.125 bytes a weight (75 us on 22016x4096 on an H100), against
the 2 a decode for cuBLAS writes.

One block of 128 threads per 64x64 tile (each a 2:4 tile: the layout has no dense ones). Values: a thread writes 16
bytes (4 groups' kept pairs, each one 32-bit word of the A-fragment order) of 2 rows; 4 threads a 64-byte tile row.
Metadata: a tile is two of cuSPARSELt's 256-byte blocks (64 rows x 32 columns); a thread writes one 32-bit word (8
nibbles: 2 rows x 2 groups x 2 groups) from two of the layout's metadata words. Bit patterns are copied.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import cuda

from sparsekit.packed.cslt import cslt_shape
from sparsekit.packed.sp24 import SP_STRIP_WORDS, SP_TILE_WORDS, SP_VALUE_WORDS

from . import kcache
from ._sp_intrinsics import stg128

THREADS = 128
_KERNEL = []


def _build():
    i64 = np.int64

    @cuda.jit
    def kernel(sp, tiles, out, gk_n, row_words, meta0):
        g = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        tr = g // gk_n
        tc = g - tr * gk_n
        base = i64(tiles[g] >> 1) * SP_TILE_WORDS
        j = tid & 3                              # groups 4j .. 4j+3 of the tile row: chunk c = j >> 1, half kh = j & 1
        for half in range(2):
            row = (tid >> 2) + 32 * half
            b = (base + (row >> 4) * SP_STRIP_WORDS + (((j >> 1) * 8 + (row & 7)) * 4 * 2 + (j & 1)) * 2
                 + ((row >> 3) & 1))                     # the group's word of t = 0; t = 1-3 follow 4 words apart
            stg128(out, i64(tr * 64 + row) * row_words + tc * 16 + j * 4, sp[b], sp[b + 4], sp[b + 8], sp[b + 12])
        c = tid >> 6                             # metadata: block c of the tile, word w = t1 | gg << 1 | s << 4
        w = tid & 63
        t1 = w & 1
        mb = base + (w >> 4) * SP_STRIP_WORDS + SP_VALUE_WORDS + (((w >> 1) & 7) * 2 + c) * 2
        m0 = i64(sp[mb]) & 0xFFFFFFFF
        m1 = i64(sp[mb + 1]) & 0xFFFFFFFF
        r = i64(0)
        for q in range(8):                       # nibble q = rh | kh << 1 | t0 << 2: nibble rh * 4 + t0 + 2 t1, word kh
            src = m1 if (q >> 1) & 1 else m0
            r |= ((src >> (4 * ((q & 1) * 4 + (q >> 2) + 2 * t1))) & 15) << (4 * q)
        out[meta0 + (i64(tr) * (gk_n * 2) + tc * 2 + c) * 64 + w] = np.int32(r - (r >> 31 << 32))

    return kernel


def get_kernel():
    """The transcode kernel (built once)."""
    if not _KERNEL:
        _KERNEL.append(kcache.tag(_build(), "sp24_cslt", ()))
    return _KERNEL[0]


def sp24_to_cslt(layout) -> torch.Tensor:
    """cuSPARSELt's compressed buffer (``packed.cslt``, ``[M, K/2 + K/16]`` fp16) of an all-2:4 layout whose M and K
    are multiples of 64, on torch's current stream with no host synchronization (capturable)."""
    from . import launch

    m, k = layout.shape
    shape = cslt_shape(m, k)
    if layout.dense.numel():
        raise ValueError("sp24_to_cslt takes layouts whose tiles are all 2:4 (this one has dense tiles)")
    out = torch.empty(shape, dtype=torch.float16, device=layout.tiles.device)
    gk = k // 64
    words = out.view(-1).view(torch.int32)
    launch.launch_tensors(get_kernel(), (m // 64) * gk, THREADS, (layout.sp, layout.tiles, words),
                          (gk, gk * 16, m * k // 4))
    return out
