"""The 2:4 kernel's device primitives (``_sp_intrinsics``) as plain Python, for numba's simulator.

``mma_sp`` / ``mma_k32`` compute exactly the documented fragment contract: every lane publishes its
A, B and metadata registers in the block's scratch array, then computes its own four C elements from
everyone's (one exchange, two block barriers, whichever kind of tile: the kernel's warps may multiply
tiles of different kinds at the same time, and the simulator's barriers are block-wide).
``ldmatrix_x4`` exchanges the lanes' row addresses the same way. Shared "addresses" are
``_SMEM_BASE`` plus byte offsets into the dynamic shared array (``byte_addr``), as in ``_warp_intrinsics_sim``.
"""
from __future__ import annotations

import numpy as np

from ._intrinsics_sim import _soff
from .compat_numba import sim_syncthreads

__all__ = ["cp16", "cp_commit", "cp_wait3", "cp_wait4", "cp_wait5", "cp_wait6", "ldg128", "ldmatrix_x4", "mma_k32", "mma_sp", "stg128", "sts128"]

_W = 13   # scratch words per lane of one exchange: a0..a7, b0..b3, metadata


def _half(word: int, h: int) -> float:
    return float(np.array([(int(word) >> (16 * h)) & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def _a_dense(reg, row: int, k: int) -> float:
    """A[row, k] (k < 32) of two m16n8k16 A fragments (registers 0-3: k < 16, 4-7: k >= 16)."""
    lane = (row & 7) * 4 + ((k & 7) >> 1)
    return _half(reg(lane, 4 * (k >> 4) + (row >> 3) + 2 * ((k >> 3) & 1)), k & 1)


def _a_sp(reg, row: int, k: int) -> float:
    """A[row, k] of the 2:4 operand: the metadata of (row, group k // 4) says which kept value, if any."""
    j = k >> 2
    word = int(reg(4 * (row & 7) + (j >> 2), 12))          # threads t = 0 (groups 0-3), 1 (groups 4-7)
    code = (word >> (16 * (row >> 3) + 4 * (j & 3))) & 0xF
    pos = k & 3
    if pos == code & 3:
        cc = 2 * j
    elif pos == code >> 2:
        cc = 2 * j + 1
    else:
        return 0.0
    lane = (row & 7) * 4 + ((cc & 7) >> 1)                 # compressed A: the m16n8k16 layout
    return _half(reg(lane, (row >> 3) + 2 * (cc >> 3)), cc & 1)


def _b(reg, k: int, col: int) -> float:
    """B[k, col] (B stored transposed, n x k): register k // 8 of lane col * 4 + (k % 8) // 2."""
    return _half(reg(col * 4 + ((k & 7) >> 1), 8 + (k >> 3)), k & 1)


def _exchange_k32(scr, tid, sp, regs, c):
    base = (tid >> 5) * 32 * _W
    lane = tid & 31
    for j, r in enumerate(regs):
        scr[base + lane * _W + j] = int(r) & 0xFFFFFFFF
    sim_syncthreads()

    def reg(ln, j):
        return int(scr[base + ln * _W + j])

    a = _a_sp if sp else _a_dense
    g, t = lane >> 2, lane & 3
    out = list(c)
    for oi in range(4):
        row, col = g + 8 * (oi >> 1), 2 * t + (oi & 1)
        acc = 0.0
        for k in range(32):
            acc += a(reg, row, k) * _b(reg, k, col)
        out[oi] = np.float32(out[oi] + np.float32(acc))
    sim_syncthreads()
    return out[0], out[1], out[2], out[3]


def mma_sp(scr, tid, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, meta):
    """D = A(16x32, 2:4, compressed to 16x16) * B(32x8) + C, selector 0, fp32 accumulate."""
    return _exchange_k32(scr, tid, True, (a0, a1, a2, a3, 0, 0, 0, 0, b0, b1, b2, b3, meta), (c0, c1, c2, c3))


def mma_k32(scr, tid, sp, a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, c0, c1, c2, c3, meta):
    """One k = 32 step: ``mma_sp`` (a0..a3, meta) if ``sp``, else two m16n8k16 (a0..a3 with b0, b1;
    a4..a7 with b2, b3)."""
    return _exchange_k32(scr, tid, bool(sp), (a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, meta),
                         (c0, c1, c2, c3))


def ldmatrix_x4(scr, tid, d32, addr):
    """Lane (g, t) gets, for matrix j = 0..3, the word t of the 16-byte row whose address lane 8j + g gave."""
    lane = tid & 31
    scr[tid] = int(addr)
    sim_syncthreads()
    base = tid - lane
    g, t = lane >> 2, lane & 3
    out = [np.uint32(d32[(_soff(scr[base + 8 * j + g]) >> 2) + t]) for j in range(4)]
    sim_syncthreads()
    return out[0], out[1], out[2], out[3]


def ldg128(arr, i):
    """Words ``i .. i+3`` of a 32-bit array (16 bytes, ``i`` a multiple of 4)."""
    i = int(i)
    return tuple(np.uint32(int(arr[i + q]) & 0xFFFFFFFF) for q in range(4))


def stg128(arr, i, w0, w1, w2, w3):
    """Words ``i .. i+3`` of a 32-bit global array (16 bytes, ``i`` a multiple of 4) = ``w0 .. w3``."""
    i = int(i)
    if i % 4:
        raise ValueError(f"stg128: word {i} is not a multiple of 4 (the GPU store would be misaligned)")
    for q, w in enumerate((w0, w1, w2, w3)):
        arr[i + q] = np.uint32(int(w) & 0xFFFFFFFF).view(arr.dtype)


def sts128(d32, addr, w0, w1, w2, w3):
    """Four words to shared byte address ``addr`` (16-byte aligned)."""
    i = _soff(addr) >> 2
    for q, w in enumerate((w0, w1, w2, w3)):
        d32[i + q] = np.uint32(int(w) & 0xFFFFFFFF)


def cp16(d32, addr, arr, i, nbytes):
    """16 bytes from element ``i`` of ``arr`` on (words ``i .. i+3`` of a 32-bit array, halves ``i .. i+7`` of a
    16-bit one) to shared byte address ``addr``: the first ``nbytes`` of them, zeros after (GPU: ``cp.async.cg``
    with a source size, completing at ``cp_wait*``). A 16-bit array's halves before its start (``i`` < 0: the
    GPU reads them from the same aligned 16 bytes) and past ``nbytes`` come out zero."""
    d = _soff(addr) >> 2
    i, nbytes = int(i), int(nbytes)
    if arr.dtype.itemsize == 2:
        h = [int(arr[i + q]) & 0xFFFF if 0 <= i + q < len(arr) and 2 * q < nbytes else 0 for q in range(8)]
        for q in range(4):
            d32[d + q] = np.uint32(h[2 * q] | (h[2 * q + 1] << 16))
        return
    for q in range(4):
        d32[d + q] = np.uint32(int(arr[i + q]) & 0xFFFFFFFF) if 4 * q < nbytes else np.uint32(0)


def cp_commit():
    """Close a group of ``cp16`` copies (the simulator copies at once)."""


def cp_wait3():
    """Wait until at most 3 copy groups are pending (the simulator has none)."""


cp_wait4 = cp_wait5 = cp_wait6 = cp_wait3

