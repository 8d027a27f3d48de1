"""The inline-PTX pieces of spmm_warp (``_warp_intrinsics``) as plain Python, for the simulator.

Addresses: ``byte_addr(d64, i)`` is ``_SMEM_BASE`` + 8*i: a byte offset into the array, moved off 0 as a GPU's
shared addresses are (its static arrays come first), so that a kernel indexing an array with an address
fails under the simulator too; each twin subtracts the base (``_soff``). Global "pointers" (``ptr_of``)
are 0, so sources are byte offsets into the arrays. Same public
names and signatures as ``_warp_intrinsics_ptx`` (checked by tests/test_kernels_layout.py).
"""
from __future__ import annotations

import numpy as np

from ._intrinsics_sim import _SMEM_BASE, _select_pair, _soff, shfl_idx
from .plan import XROW_BYTES
from .compat_numba import sim_syncthreads

__all__ = ["byte_addr", "decode_at", "lds128b", "lds32b", "lds_f4", "make_step_issue", "scan_counts", "sts64b"]


def byte_addr(d64, i):
    return _SMEM_BASE + 8 * int(i)


def _copy16(d64, dst, src, src_off):
    di = _soff(dst) // 8
    si = int(src_off) // 8
    d64[di] = np.int64(src[si]).view(np.uint64)
    d64[di + 1] = np.int64(src[si + 1]).view(np.uint64)


def lds32b(d32, addr):
    """uint32 at shared byte address ``addr``."""
    return np.uint32(d32[_soff(addr) >> 2])


def sts64b(d64, addr, val):
    d64[_soff(addr) >> 3] = np.uint64(val)


def lds128b(d64, addr):
    i = _soff(addr) >> 3
    return np.uint64(d64[i]), np.uint64(d64[i + 1])


def lds_f4(df, i):
    """``df[i .. i + 3]`` (GPU: one 16-byte ``ld.shared.v4.f32``, so ``i`` must be a multiple of 4)."""
    if i % 4:
        raise ValueError(f"lds_f4: index {i} is not a multiple of 4 (the GPU load would be misaligned)")
    return np.float32(df[i]), np.float32(df[i + 1]), np.float32(df[i + 2]), np.float32(df[i + 3])


def make_step_issue(cmax: int, xit: int, nbm: int = 8):
    issue = _make_issue(cmax, xit)

    def step_issue(scr, tid, d64, lstart, lend, j, nsw, lane, vdst, vals, vp, bm, bdst, bsrc, x, xdst, xsrc,
                   xrem, xstride):
        st = int(shfl_idx(scr, tid, lstart, int(j) & 31))
        en = int(shfl_idx(scr, tid, lend, int(j) & 31))
        ok = int(j) < int(nsw)
        a0 = st >> 3
        rem = ((en + 7) >> 3) - a0 - int(lane)
        issue(d64, vdst, vals, int(vp) + (a0 + int(lane)) * 16, rem if ok else 0, bm, bdst, bsrc,
              ok and int(lane) < nbm, x, xdst, xsrc, int(xrem) if ok else 0, xstride)
    return step_issue


def _make_issue(cmax: int, xit: int):
    def issue_copies(d64, dst, vals, vsrc, vrem, bm, bdst, bsrc, bpred, x, xdst, xsrc, xrem, xstride):
        for c in range(cmax):
            if int(vrem) > 32 * c:
                _copy16(d64, int(dst) + 512 * c, vals, int(vsrc) + 512 * c)
        if bpred:
            _copy16(d64, bdst, bm, bsrc)
        for c in range(xit):
            if int(xrem) > 32 * c:
                _copy16(d64, int(xdst) + 4 * XROW_BYTES * c, x, int(xsrc) + int(xstride) * c)
    return issue_copies


def scan_counts(scr, tid, c):
    """Exclusive prefix sum over the warp's lanes of ``c`` (GPU: five shfl.sync.up)."""
    scr[tid] = int(c)
    sim_syncthreads()
    base = tid & ~31
    excl = sum(int(scr[base + q]) for q in range(tid - base))
    sim_syncthreads()
    return np.uint32(excl)


def decode_at(d32, e, lmask, pos):
    e = int(e)
    w = e & 0xFFFFFFFF
    b = _soff(e >> 32) + 2 * bin(w & int(lmask)).count("1")

    def u16(byte):
        return (int(d32[byte >> 2]) >> (16 * ((byte >> 1) & 1))) & 0xFFFF

    return _select_pair(w, pos, u16(b), u16(b + 2))
