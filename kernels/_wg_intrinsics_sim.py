"""The warpgroup kernel's device primitives (``_wg_intrinsics``) as plain Python, for numba's simulator.

``wg_mma2`` computes the contract the GPU probe pinned down (``_wg_intrinsics_ptx``): the 128 threads of
a warpgroup publish their A registers and metadata words in the block's scratch array, then each computes
its own accumulators from everyone's, reading B through the descriptor (start address, leading byte
offset = step between core matrices along K, stride byte offset = step along N) from the block's dynamic
shared memory. Shared "addresses" are ``_SMEM_BASE`` plus byte offsets into that array, as in
``_warp_intrinsics_sim``. The
products complete at once: the waits return their operand.
"""
from __future__ import annotations

import numpy as np

import threading

from ._sp_intrinsics_sim import _a_dense, _a_sp
from ._intrinsics_sim import _SMEM_BASE, _soff
from .common import STRIP_LUT
from .compat_numba import sim_kernel

__all__ = ["lds_a8", "regs_dec40", "regs_dec168", "regs_inc168", "regs_inc232", "strip_a16", "wscan", "wsync", "wg_bar",
           "wg_commit", "wg_hold", "wg_keep", "wg_mma2", "wg_mmad", "wg_mmss", "wg_wait0", "wg_wait1", "wshfl_idx"]

_W = 16   # scratch words per thread: 8 A registers and 2 metadata words (wg_mma2) or 16 A registers
          # (wg_mmad); one stride for both, as two warpgroups of a block may run one of each at once
_WD = _W
_BARRIERS: dict = {}
_LOCK = threading.Lock()


def _wg_sync(scr, tid: int) -> None:
    """A barrier of the 128 threads of ``tid``'s warpgroup (the instruction is warpgroup-wide; a block may
    hold warps that never issue it, such as sp24_ws's producer)."""
    key = (id(scr), tid >> 7)
    with _LOCK:
        bar = _BARRIERS.get(key)
        if bar is None:
            bar = _BARRIERS[key] = threading.Barrier(128)
    bar.wait()


_SHFL = 4608   # scratch words from here: two rounds of one word per thread (up to 384 threads) for the warp
               # shuffles (clear of the products' region); rounds alternate, so one barrier per shuffle suffices
_ROUND: dict = {}


def _warp_sync(scr, tid: int) -> None:
    key = (id(scr), "warp", tid >> 5)
    with _LOCK:
        bar = _BARRIERS.get(key)
        if bar is None:
            bar = _BARRIERS[key] = threading.Barrier(32)
    bar.wait()


def _publish(scr, tid: int, val) -> int:
    """Write ``val`` in this thread's word of the next round and wait for the warp; the round's base. A round's
    words are rewritten two shuffles later, after every lane has passed the barrier in between."""
    key = (id(scr), tid)
    r = _ROUND.get(key, 0)
    _ROUND[key] = r ^ 1
    base = _SHFL + r * 384
    scr[base + tid] = int(val)
    _warp_sync(scr, tid)
    return base


def wshfl_idx(scr, tid, val, src):
    """Lane ``src``'s uint32, within ``tid``'s warp only."""
    tid = int(tid)
    base = _publish(scr, tid, val)
    return np.uint32(int(scr[base + (tid & ~31) + int(src)]))


def wscan(scr, tid, c):
    """Inclusive prefix sum of the uint32 ``c`` over the lanes of ``tid``'s warp (warp-scoped)."""
    tid = int(tid)
    base = _publish(scr, tid, c)
    w = tid & ~31
    return np.uint32(sum(int(scr[base + q]) for q in range(w, tid + 1)) & 0xFFFFFFFF)


def _prmt(a: int, b: int, c: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte i of the result is byte ``c``'s nibble i of {b, a}, or that byte's
    sign replicated when the nibble's top bit is set."""
    src = (int(b) << 32) | int(a)
    out = 0
    for i in range(4):
        n = (int(c) >> (4 * i)) & 0xF
        byte = (src >> (8 * (n & 7))) & 0xFF
        if n & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def strip_a16(scr, tid, tab, d32, wvaddr, aaddr, lmask, pos):
    """The 16 A registers of a warp's strip of a staged TCA-BME GroupTile (see ``_wg_intrinsics_ptx``): per
    BitmapTile pair, 16 bytes at ``wvaddr`` (the two half-words, then their selector words) and 8 at ``aaddr``
    (the two value addresses), computed as the PTX does: the popcount, both loads, the forward extract and
    the permute."""
    words = d32.view(np.uint32)
    lut = (STRIP_LUT[1] << 32) | STRIP_LUT[0]

    def u16(byte):
        return (int(words[byte >> 2]) >> (16 * ((byte >> 1) & 1))) & 0xFFFF

    out = []
    for j in range(16):
        wv = (_soff(wvaddr) >> 2) + 4 * (j >> 1) + (j & 1)
        w, v = int(words[wv]), int(words[wv + 2])
        a = _soff(int(words[(_soff(aaddr) >> 2) + 2 * (j >> 1) + (j & 1)])) + 2 * bin(w & int(lmask)).count("1")
        q = (lut >> (8 * ((v >> int(pos)) & 3))) & 0xFFFFFFFF
        out.append(np.uint32(_prmt(u16(a), u16(a + 2), q)))
    return tuple(out)


def wsync(scr, tid):
    """``bar.warp.sync``: wait for the lanes of ``tid``'s warp."""
    _warp_sync(scr, int(tid))




def lds_a8(d64, addr):
    """The 8 words at shared byte addresses ``addr`` .. +15 and ``addr + 512`` .. +15."""
    d32 = d64.view(np.uint32)
    i, j = _soff(addr) >> 2, (_soff(addr) + 512) >> 2
    return tuple(np.uint32(d32[i + q]) for q in range(4)) + tuple(np.uint32(d32[j + q]) for q in range(4))


def _b_reader(desc: int):
    start = (((desc & 0x3FFF) << 4) - _SMEM_BASE) & 0x3FFFF   # the descriptor keeps address bits 4-17
    lbo = ((desc >> 16) & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    h = sim_kernel().shared.array(0, np.dtype(np.uint16)).view(np.float16)

    def b(k: int, col: int) -> float:
        return float(h[(start + (k >> 3) * lbo + (col >> 3) * sbo + (col & 7) * 16 + (k & 7) * 2) >> 1])

    return b


def wg_mma2(scr, tid, a, m0, m1, desc0, desc1, acc):
    """acc += A[:, 0:32] B0 + A[:, 32:64] B1 for this thread's rows and tokens (see the module docstring)."""
    tid = int(tid)
    _wg_sync(scr, tid)
    for j in range(8):
        scr[tid * _W + j] = int(a[j]) & 0xFFFFFFFF
    scr[tid * _W + 8] = int(m0) & 0xFFFFFFFF
    scr[tid * _W + 9] = int(m1) & 0xFFFFFFFF
    _wg_sync(scr, tid)
    wbase = tid & ~31
    lane = tid & 31
    g, t = lane >> 2, lane & 3
    out = [float(v) for v in acc]
    for half, desc in ((0, desc0), (1, desc1)):
        b = _b_reader(int(desc))

        def reg(ln, j, half=half):
            word = scr[(wbase + ln) * _W + (8 + half if j == 12 else 4 * half + j)]
            return int(word)

        for e in range(len(out)):
            jb, oi = e >> 2, e & 3
            row, col = g + 8 * (oi >> 1), 8 * jb + 2 * t + (oi & 1)
            s = 0.0
            for k in range(32):
                av = _a_sp(reg, row, k)
                if av:
                    s += av * b(k, col)
            out[e] = float(np.float32(out[e]) + np.float32(s))
    _wg_sync(scr, tid)
    return tuple(np.float32(v) for v in out)


def wg_mmad(scr, tid, a, desc0, desc1, desc2, desc3, acc):
    """acc += A[:, 16q:16q+16] B_q over q = 0..3, A dense in ``mma.sync.m16n8k16``'s per-warp fragment
    (registers 4q .. 4q+3: columns 16q ..), B_q read through ``desc_q``."""
    tid = int(tid)
    _wg_sync(scr, tid)
    for j in range(16):
        scr[tid * _WD + j] = int(a[j]) & 0xFFFFFFFF
    _wg_sync(scr, tid)
    wbase = tid & ~31
    lane = tid & 31
    g, t = lane >> 2, lane & 3
    out = [float(v) for v in acc]
    for q, desc in enumerate((desc0, desc1, desc2, desc3)):
        b = _b_reader(int(desc))

        def reg(ln, j, q=q):
            return int(scr[(wbase + ln) * _WD + 4 * q + j])

        for e in range(len(out)):
            jb, oi = e >> 2, e & 3
            row, col = g + 8 * (oi >> 1), 8 * jb + 2 * t + (oi & 1)
            s = 0.0
            for k in range(16):
                s += _a_dense(reg, row, k) * b(k, col)
            out[e] = float(np.float32(out[e]) + np.float32(s))
    _wg_sync(scr, tid)
    return tuple(np.float32(v) for v in out)


def wg_mmss(a0, a1, a2, a3, b0, b1, b2, b3, acc):
    """acc += A_q B_q over q = 0..3, both read through their descriptors (A: rows of the thread's warp of its
    warpgroup, K-major core matrices as B's)."""
    ctx = sim_kernel()
    tid = int(ctx.threadIdx.x)
    w, lane = (tid >> 5) & 3, tid & 31
    g, t = lane >> 2, lane & 3
    out = [float(v) for v in acc]
    for adesc, bdesc in ((a0, b0), (a1, b1), (a2, b2), (a3, b3)):
        a, b = _b_reader(int(adesc)), _b_reader(int(bdesc))
        for e in range(len(out)):
            jb, oi = e >> 2, e & 3
            row, col = 16 * w + g + 8 * (oi >> 1), 8 * jb + 2 * t + (oi & 1)
            s = 0.0
            for k in range(16):
                s += a(k, row) * b(k, col)
            out[e] = float(np.float32(out[e]) + np.float32(s))
    return tuple(np.float32(v) for v in out)


def wg_bar(scr, tid):
    """The 128 threads of ``tid``'s warpgroup meet."""
    _wg_sync(scr, int(tid))


def wg_commit():
    """Close a group of products (the simulator computes them at once)."""


def wg_wait0(acc):
    return acc


wg_hold = wg_wait0
wg_wait1 = wg_wait0


def wg_keep(a, m0, m1, guard):
    """Registers kept live (the simulator has none to guard)."""


def _regs():
    """setmaxnreg: the simulator has no register file."""


regs_inc232 = regs_dec40 = regs_inc168 = regs_dec168 = _regs
