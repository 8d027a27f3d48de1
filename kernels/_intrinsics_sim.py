"""The device primitives of ``_intrinsics`` as plain Python, for numba's CUDA simulator.

Under ``NUMBA_ENABLE_CUDASIM=1`` there is no PTX and the simulator has no warp shuffles, so warp
exchanges go through a per-block shared scratch array and ``syncthreads`` (every kernel calls them
uniformly across the block, which the emulation requires), and ``mma`` computes exactly the
fragment contract of m16n8k16 (each lane publishes its A/B registers, then computes its own four C
elements from everyone's). Same public names and signatures as ``_intrinsics_ptx`` (checked by
tests/test_kernels_layout.py).
"""
from __future__ import annotations

import threading
import time

import numpy as np

from .compat_numba import sim_syncthreads

__all__ = ["bulk_copy", "bulk_copy_mc", "clock32", "cluster_rank", "cluster_sync", "cp_wait0", "cp_wait1",
           "cp_wait2", "decode_pair", "f2h", "fence_proxy_async", "gtimer32", "h2f", "lds32", "mbar_arrive",
           "mbar_arrive_remote", "mbar_expect", "mbar_init", "mbar_wait", "mma", "ptr_of", "shfl_idx", "shfl_up",
           "shfl_xor", "smem_base", "smid", "stg_h4", "syncwarp"]


def _f16(bits) -> float:
    return float(np.array([int(bits) & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def h2f(bits):
    """fp16 bit pattern (low 16 bits of ``bits``) -> float32."""
    return np.float32(_f16(bits))


def f2h(x):
    """float32 -> fp16 bit pattern (round to nearest even), as uint16."""
    return np.array([x], dtype=np.float32).astype(np.float16).view(np.uint16)[0]


def syncwarp():
    sim_syncthreads()


# mbarriers, emulated: pending arrivals, pending transaction bytes and the phase bit of each barrier,
# under one lock (the simulator runs a block's threads as Python threads). A phase completes when its
# arrivals and its bulk copies' bytes are all in; ``mbar_wait(parity)`` returns once the phase of that
# parity has completed (the current phase bit differs from ``parity``), as ``mbarrier.try_wait.parity``.
_MBARS: dict = {}
_MBAR_LOCK = threading.Lock()


def _mbar_state(mbar, i) -> list:
    return _MBARS[(id(mbar), int(i))]


def _mbar_settle(st: list) -> None:
    if st[0] == 0 and st[1] == 0:
        st[2] ^= 1
        st[0] = st[3]


def mbar_init(mbar, i, count):
    with _MBAR_LOCK:
        _MBARS[(id(mbar), int(i))] = [int(count), 0, 0, int(count)]   # pending, tx bytes, phase, count


def mbar_expect(mbar, i, nbytes):
    """Arrive, expecting ``nbytes`` more bytes of bulk copies on this phase."""
    with _MBAR_LOCK:
        st = _mbar_state(mbar, i)
        st[1] += int(nbytes)
        st[0] -= 1
        _mbar_settle(st)


def mbar_arrive(mbar, i):
    with _MBAR_LOCK:
        st = _mbar_state(mbar, i)
        st[0] -= 1
        _mbar_settle(st)


def mbar_wait(mbar, i, parity):
    while True:
        with _MBAR_LOCK:
            if _mbar_state(mbar, i)[2] != int(parity):
                return
        time.sleep(0)


def fence_proxy_async():
    pass


def bulk_copy(dst, di, src, si, nbytes, mbar, mi):
    """dst[di:di+nbytes/8] = src[si:...] (uint64 views): one TMA bulk copy on the GPU, whose bytes count
    toward the transaction of barrier ``mi``'s current phase."""
    for k in range(nbytes // 8):
        dst[di + k] = np.int64(src[si + k]).view(np.uint64)
    with _MBAR_LOCK:
        st = _mbar_state(mbar, mi)
        st[1] -= int(nbytes)
        _mbar_settle(st)


_CLOCK0 = time.perf_counter_ns()


def clock32():
    """A cycle-counter stand-in for the simulator: microseconds (1024 ns) since this module was imported, which
    takes 73 minutes to wrap; only differences mean anything."""
    return np.uint32(((time.perf_counter_ns() - _CLOCK0) >> 10) & 0xFFFFFFFF)


def smid():
    """The SM of the block: the simulator has one."""
    return np.uint32(0)


def gtimer32():
    """The GPU timer's stand-in: nanoseconds since this module was imported, low 32 bits."""
    return np.uint32((time.perf_counter_ns() - _CLOCK0) & 0xFFFFFFFF)


def cluster_rank():
    """This block's rank in its cluster: the simulator runs one block at a time, so clusters of one block."""
    return np.uint32(0)


def mbar_arrive_remote(mbar, i, rank):
    """An arrival on barrier ``i`` of the cluster's block ``rank``: in a cluster of one, this block's."""
    if int(rank) != 0:
        raise RuntimeError("the simulator runs clusters of one block: no block of rank > 0")
    mbar_arrive(mbar, i)


def bulk_copy_mc(dst, di, src, si, nbytes, mbar, mi, mask):
    """The multicast bulk copy into the blocks of ``mask``: in a cluster of one, ``bulk_copy``."""
    if int(mask) != 1:
        raise RuntimeError("the simulator runs clusters of one block: a multicast mask other than 1")
    bulk_copy(dst, di, src, si, nbytes, mbar, mi)


def cluster_sync():
    """Every thread of the cluster meets: in a cluster of one, the block's barrier."""
    sim_syncthreads()


_SMEM_BASE = 4096   # the simulator's shared "addresses" start here, not at 0, as on a GPU (static arrays come
                   # first): an address used where an array offset belongs then fails in CI too


def _soff(addr) -> int:
    """The byte offset into its array of a simulated shared address (``byte_addr``)."""
    return int(addr) - _SMEM_BASE


def smem_base(arr, i):
    """Shared-memory "address" of uint64 element ``i`` (simulator: a uint32 word index past _SMEM_BASE)."""
    return _SMEM_BASE // 4 + 2 * i


def lds32(d32, base, woff):
    """The uint32 word ``woff`` words past ``base`` (a ``smem_base`` address)."""
    return np.uint32(d32[base - _SMEM_BASE // 4 + woff])


def decode_pair(d32, e, lmask, pos, vbase):
    """SMBD: this lane's A-fragment register from its half-bitmap entry ``e``.

    ``e`` = bitmap half-word (low 32 bits) | value offset of that half-word (high 32 bits).
    The lane's two elements are bits ``pos`` and ``pos + 1`` of the word; the first set one is
    value ``offset + popc(word & lmask)``; the register holds (low, high) = (element 0,
    element 1), zeros for unset bits.
    """
    e = int(e)
    w = e & 0xFFFFFFFF
    idx = (e >> 32) + bin(w & int(lmask)).count("1")
    a = vbase - _SMEM_BASE // 4 + (idx >> 1)
    pair = (int(d32[a]) | (int(d32[a + 1]) << 32)) >> (16 * (idx & 1))
    return _select_pair(w, pos, pair & 0xFFFF, (pair >> 16) & 0xFFFF)


def _select_pair(w, pos, first, second):
    """The A register of the lane's elements at bits ``pos``, ``pos + 1`` of ``w``: the set ones
    take the next values in order (``first``, then ``second``), the unset ones are zero."""
    b0, b1 = (int(w) >> int(pos)) & 1, (int(w) >> (int(pos) + 1)) & 1
    if b0 and b1:
        return np.uint32(first | (second << 16))
    if b0:
        return np.uint32(first)
    if b1:
        return np.uint32(first << 16)
    return np.uint32(0)


def cp_wait0():
    pass


cp_wait1 = cp_wait2 = cp_wait0


def stg_h4(y, i, a, b, c, d):
    """``y[i .. i + 3]`` (fp16 bits, int16; ``i`` a multiple of 4) = ``a, b, c, d`` rounded to fp16 (GPU: one
    8-byte ``st.global``)."""
    if i % 4:
        raise ValueError(f"stg_h4: index {i} is not a multiple of 4 (the GPU store would be misaligned)")
    for j, v in enumerate((a, b, c, d)):
        y[i + j] = np.int16(f2h(v))


def ptr_of(arr):
    """Raw device address of ``arr``'s data (simulator: 0; offsets index the array)."""
    return 0


def shfl_idx(scr, tid, val, src_lane):
    """Warp broadcast of lane ``src_lane``'s uint32 (GPU: shfl.sync.idx)."""
    scr[tid] = val
    sim_syncthreads()
    out = scr[(tid & ~31) + int(src_lane)]
    sim_syncthreads()
    return type(val)(out)


def shfl_up(scr, tid, val, delta):
    """Warp shuffle-up of a uint32 (GPU: shfl.sync.up)."""
    lane = tid & 31
    scr[tid] = val
    sim_syncthreads()
    out = scr[tid - delta] if lane >= delta else scr[tid]
    sim_syncthreads()
    return type(val)(out)


def shfl_xor(scr, tid, val, mask):
    """Butterfly shuffle of a float32 (GPU: shfl.sync.bfly)."""
    scr[tid] = val
    sim_syncthreads()
    out = scr[tid ^ mask]
    sim_syncthreads()
    return type(val)(out)


def _half_pair(word):
    w = int(word)
    return _f16(w & 0xFFFF), _f16(w >> 16)


def _fragment_index():
    """Where each element of the lane's two A rows and two B columns sits in the warp's registers,
    as (lane, half) indices into the [32 lanes, 12 halves] view of the six registers (m16n8k16):
    A[row][k] is lane (row%8)*4 + (k%8)//2, register (row>=8) + 2*(k>=8), half k%2;
    B[k][col] is lane col*4 + (k%8)//2, register 4 + (k>=8), half k%2."""
    k = np.arange(16)
    a_lane = np.array([[(g * 4 + ((k & 7) >> 1)) for _ in (0, 1)] for g in range(8)])
    a_half = np.array([[2 * (hi + 2 * (k >> 3)) + (k & 1) for hi in (0, 1)] for _ in range(8)])
    b_lane = np.array([[(2 * t + c) * 4 + ((k & 7) >> 1) for c in (0, 1)] for t in range(4)])
    b_half = np.array([[2 * (4 + (k >> 3)) + (k & 1) for _ in (0, 1)] for _ in range(4)])
    return a_lane, a_half, b_lane, b_half


_A_LANE, _A_HALF, _B_LANE, _B_HALF = _fragment_index()


def mma(scr, tid, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A(16x16, row) * B(16x8, col) + C with the m16n8k16 register layout (fp32 math)."""
    base = (tid >> 5) * 32 * 6
    lane = tid & 31
    for j, r in enumerate((a0, a1, a2, a3, b0, b1)):
        scr[base + lane * 6 + j] = np.uint32(r)
    sim_syncthreads()
    halves = scr[base:base + 32 * 6].astype(np.uint32).reshape(32, 6).view(np.float16).astype(np.float64)
    gid, tig = lane >> 2, lane & 3
    a = halves[_A_LANE[gid], _A_HALF[gid]]          # [2 rows (gid, gid + 8), 16 k]
    b = halves[_B_LANE[tig], _B_HALF[tig]]          # [2 columns (2 tig, 2 tig + 1), 16 k]
    d = a @ b.T
    out = [np.float32(c + np.float32(d[oi >> 1, oi & 1])) for oi, c in enumerate((c0, c1, c2, c3))]
    sim_syncthreads()
    return out[0], out[1], out[2], out[3]
