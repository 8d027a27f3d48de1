"""TCA-BME -> dense on the GPU in one kernel: the prefill path (decode once, then cuBLAS).

One block of 4 warps per GroupTile (64x64), one warp per strip, one lane per half-BitmapTile (4 rows x 8
columns). The GroupTile's values are contiguous in the format: the block first copies them into shared memory
with 16-byte ``cp.async`` copies (one per thread and 16 bytes, coalesced; aligned to 16-byte boundaries of
the address space, so the first piece may start up to 14 bytes before the values, inside the same 16 bytes,
and the last one reads only up to the values' end), while each lane counts its bits and a warp scan gives it
the offset of its first value. Then each lane walks its own 32 bits, takes its values from
shared memory in order and writes its four 16-byte row pieces of the dense weight with one 16-byte store
each (eight lanes write one 128-byte row). Values are copied as bit patterns: fp16 and bf16 alike, bit-exact.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import cuda

from . import kcache
from ._intrinsics import SCRATCH_WORDS, cp_wait0
from ._sp_intrinsics import cp16, cp_commit, stg128
from ._warp_intrinsics import byte_addr, scan_counts
from .block import dynamic_smem

THREADS = 128   # 4 warps: the 4 strips of a GroupTile
CHUNKS = 4096 // 8 + 1   # 16-byte pieces of one GroupTile's values (at most 4096 halves), one more for the offset
DYN = 16 * CHUNKS
_KERNEL = []


def _build():
    u32 = np.uint32

    @cuda.jit(device=True, inline=True)
    def pair(d32, bits, sh, p):
        """The 32-bit word of the two columns at bits ``sh``, ``sh + 1`` (zero where a bit is clear), and the
        next value's index. Branch-free: both halves are read (past the tile's values, stale shared memory,
        masked off), so the warp's lanes never diverge."""
        b0 = (bits >> u32(sh)) & u32(1)
        lo = (d32[p >> 1] >> u32(16 * (p & 1))) & u32(0xFFFF) & (u32(0xFFFFFFFF) * b0)
        p += b0
        b1 = (bits >> u32(sh + 1)) & u32(1)
        hi = ((d32[p >> 1] >> u32(16 * (p & 1))) << u32(16)) & (u32(0xFFFFFFFF) * b1)
        return hi | lo, p + b1

    @cuda.jit
    def kernel(bm, v16, goff, soff, out, gk_n, ldo, mis, n):
        d64, d32, _ = dynamic_smem()
        scr = cuda.shared.array(SCRATCH_WORDS, np.float64)
        tid = cuda.threadIdx.x
        g = cuda.blockIdx.x
        gm = g // gk_n
        gk = g - gm * gk_n
        start = mis + np.int64(goff[g])            # halves from the 16-byte boundary at or before values[0]
        end = mis + np.int64(goff[g + 1])
        c0 = start >> 3
        c = c0 + tid
        sb = byte_addr(d64, 0)
        while c < (end + 7) >> 3:                  # this tile's 16-byte pieces
            first = 8 * c - mis                    # the piece's first half (before values[0] for the first piece)
            nb = 2 * (n - first)                   # the bytes left before the values' end: no read past it
            cp16(d32, sb + u32(16 * (c - c0)), v16, first, 16 if nb > 16 else nb)
            c += THREADS
        cp_commit()
        s = tid >> 5
        h = tid & 31
        b = h >> 1                     # BitmapTile in the strip: TCTile b >> 2, quadrant b & 3
        half = h & 1                   # rows 0-3 or 4-7 of it
        word64 = bm[64 * g + 16 * s + b]
        bits = u32((word64 >> (32 * half)) & 0xFFFFFFFF)
        p = (start - 8 * c0) + np.int64(soff[4 * g + s] - goff[g])   # the strip's first value in shared memory
        p += np.int64(scan_counts(scr, tid, u32(cuda.popc(bits))))   # ... and this lane's
        cp_wait0()
        cuda.syncthreads()
        q = b & 3
        row = 64 * gm + 16 * s + 8 * (q & 1) + 4 * half
        col = (64 * gk + 16 * (b >> 2) + 8 * (q >> 1)) >> 1     # in 32-bit words (2 values)
        for i in range(4):
            a0, p = pair(d32, bits, 8 * i, p)
            a1, p = pair(d32, bits, 8 * i + 2, p)
            a2, p = pair(d32, bits, 8 * i + 4, p)
            a3, p = pair(d32, bits, 8 * i + 6, p)
            stg128(out, (row + i) * ldo + col, a0, a1, a2, a3)

    return kernel


def get_kernel():
    """The decode kernel (built once)."""
    if not _KERNEL:
        _KERNEL.append(kcache.tag(_build(), "decode", ()))
    return _KERNEL[0]


def tcabme_decode(w, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense ``[M, K]`` weight of a CUDA TCA-BME weight ``w`` (bit-exact, in its values' dtype), on
    torch's current stream. ``out``: a contiguous buffer of the values' dtype with at least
    ``padded_numel(w)`` elements to write into, starting on a 16-byte boundary (the result is a view of it,
    rows padded to a multiple of 64 columns); else a new tensor."""
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
    if out.data_ptr() % 16:
        raise ValueError("tcabme_decode: out must start on a 16-byte boundary (the kernel's 16-byte stores)")
    if gm * gk and w.values.numel():
        v16 = w.values.view(torch.int16)
        launch.launch_tensors(get_kernel(), gm * gk, THREADS,
                              (w.bitmaps.view(torch.int64), v16, w.gtile_offsets, w.strip_offsets,
                               out.view(-1).view(torch.int32)),
                              (gk, gk * 32, (v16.data_ptr() % 16) // 2, v16.numel()), dyn=DYN)
    else:
        out.zero_()
    return out[:m, :k]


def padded_numel(w) -> int:
    """Elements of the decoded weight padded to whole 64x64 tiles (what ``tcabme_decode`` writes)."""
    gm, gk = w.grid
    return gm * gk * 4096
