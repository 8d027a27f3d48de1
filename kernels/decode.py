"""TCA-BME -> dense on the GPU in one kernel: the prefill path (decode once, then cuBLAS).

One block per GroupTile, one warp per strip, one lane per half-BitmapTile (4 rows x 8 columns):
the lane's values are contiguous in the format, so after a warp scan of the 32 popcounts each
lane walks its own bits, reads its values in order and writes its four 16-byte row pieces of the
dense weight (eight lanes write one 128-byte row of the strip). Values are copied as bit
patterns: fp16 and bf16 alike, bit-exact.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import cuda

from . import kcache
from ._intrinsics import SCRATCH_WORDS
from ._warp_intrinsics import scan_counts

THREADS = 128   # 4 warps: the 4 strips of a GroupTile
_KERNEL = []


def _build():
    @cuda.jit
    def kernel(bm, vals, soff, out, gk_n, ldo):
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        tid = cuda.threadIdx.x
        s = tid >> 5
        h = tid & 31
        g = cuda.blockIdx.x
        gm = g // gk_n
        gk = g - gm * gk_n
        b = h >> 1                     # BitmapTile in the strip: TCTile b >> 2, quadrant b & 3
        half = h & 1                   # rows 0-3 or 4-7 of it
        word = bm[64 * g + 16 * s + b]
        bits = np.uint32((word >> (32 * half)) & 0xFFFFFFFF)
        ptr = np.int64(soff[4 * g + s]) + np.int64(scan_counts(scr, tid, np.uint32(cuda.popc(bits))))
        q = b & 3
        row = 64 * gm + 16 * s + 8 * (q & 1) + 4 * half
        col = (64 * gk + 16 * (b >> 2) + 8 * (q >> 1)) >> 1     # in 32-bit words (2 values)
        for i in range(4):
            for jw in range(4):
                lo = np.int32(0)
                hi = np.int32(0)
                if (bits >> np.uint32(8 * i + 2 * jw)) & np.uint32(1):
                    lo = np.int32(vals[ptr]) & 0xFFFF
                    ptr += 1
                if (bits >> np.uint32(8 * i + 2 * jw + 1)) & np.uint32(1):
                    hi = np.int32(vals[ptr]) << 16
                    ptr += 1
                out[(row + i) * ldo + col + jw] = hi | lo

    return kernel


def get_kernel():
    """The decode kernel (built once)."""
    if not _KERNEL:
        _KERNEL.append(kcache.tag(_build(), "decode", ()))
    return _KERNEL[0]


def tcabme_decode(w, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense ``[M, K]`` weight of a CUDA TCA-BME weight ``w`` (bit-exact, in its values' dtype), on
    torch's current stream. ``out``: a contiguous buffer of the values' dtype with at least
    ``padded_numel(w)`` elements to write into (the result is a view of it, rows padded to a multiple of 64
    columns); else a new tensor."""
    from . import launch

    m, k = w.shape
    gm, gk = w.grid
    if out is None:
        out = torch.empty((gm * 64, gk * 64), dtype=w.values.dtype, device=w.values.device)
    else:
        if out.dtype != w.values.dtype or not out.is_contiguous() or out.numel() < gm * gk * 4096:
            raise ValueError(f"tcabme_decode: out must be a contiguous {w.values.dtype} buffer of at least "
                             f"{gm * gk * 4096} elements")
        out = out.reshape(-1)[: gm * gk * 4096].view(gm * 64, gk * 64)
    if gm * gk and w.values.numel():
        launch.launch_tensors(get_kernel(), gm * gk, THREADS,
                              (w.bitmaps.view(torch.int64), w.values.view(torch.int16), w.strip_offsets,
                               out.view(-1).view(torch.int32)),
                              (gk, gk * 32))
    else:
        out.zero_()
    return out[:m, :k]


def padded_numel(w) -> int:
    """Elements of the decoded weight padded to whole 64x64 tiles (what ``tcabme_decode`` writes)."""
    gm, gk = w.grid
    return gm * gk * 4096
