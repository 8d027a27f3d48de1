"""One ``mma.sp`` m16n8k32 (selector 0) on one warp, with every lane's registers given by the caller:
the fragment contract, checked on its own (tests/test_sp24_sim.py under the simulator,
scripts/checks/gpu_sp24.py on the device, where it is the real instruction).

``random_operands`` builds a random case and every lane's registers by plain loops from the layouts of
docs/kernels-notes.md "v13-sp" (as verified on an H100): a statement of the contract independent of
both the simulator twin and the weight transcoder."""
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


def _pack(lo: float, hi: float) -> int:
    b = torch.tensor([lo, hi], dtype=torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    return int(b[0] | (b[1] << 16))


def _i32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


def random_2to4(rows: int, g: torch.Generator):
    """A random 2:4 fp16 ``a [rows, 32]``, its kept values ``comp [rows, 16]`` (two per group of 4, in
    order) and their positions in each group ``idx [rows, 8, 2]``."""
    a = torch.zeros(rows, 32, dtype=torch.float16)
    comp = torch.randn(rows, 16, generator=g).half()
    idx = torch.zeros(rows, 8, 2, dtype=torch.int64)
    for r in range(rows):
        for j in range(8):
            i0, i1 = sorted(torch.randperm(4, generator=g)[:2].tolist())
            idx[r, j] = torch.tensor([i0, i1])
            a[r, 4 * j + i0], a[r, 4 * j + i1] = comp[r, 2 * j], comp[r, 2 * j + 1]
    return a, comp, idx


def random_operands(seed: int):
    """Random 2:4 A [16, 32], B [32, 8], C [16, 8] and every lane's registers as the notes give them."""
    g = torch.Generator().manual_seed(seed)
    a, comp, idx = random_2to4(16, g)
    b = torch.randn(32, 8, generator=g).half()
    c = torch.randn(16, 8, generator=g)
    ar, br, cr, meta = [], [], [], []
    for lane in range(32):
        gg, t = lane >> 2, lane & 3
        ar.append([_pack(comp[gg + 8 * (i & 1), 2 * t + 8 * (i >> 1)], comp[gg + 8 * (i & 1), 2 * t + 8 * (i >> 1) + 1])
                   for i in range(4)])
        br.append([_pack(b[2 * (t + 4 * i), gg], b[2 * (t + 4 * i) + 1, gg]) for i in range(4)])
        cr.append([c[gg, 2 * t], c[gg, 2 * t + 1], c[gg + 8, 2 * t], c[gg + 8, 2 * t + 1]])
        word = 0
        if t < 2:
            for rh in range(2):
                for jj in range(4):
                    i0, i1 = idx[gg + 8 * rh, 4 * t + jj].tolist()
                    word |= (i0 | i1 << 2) << (16 * rh + 4 * jj)
        else:
            word = int(torch.randint(0, 1 << 32, (1,), generator=g))   # selector 0: never read
        meta.append(word)
    regs = (torch.tensor([[_i32(v) for v in r] for r in ar], dtype=torch.int32),
            torch.tensor([[_i32(v) for v in r] for r in br], dtype=torch.int32),
            torch.tensor([_i32(v) for v in meta], dtype=torch.int32), torch.tensor(cr))
    return a, b, c, regs


def c_fragment(d: torch.Tensor) -> torch.Tensor:
    """The C/D fragment of a [16, 8] matrix, [32 lanes, 4]."""
    return torch.stack([torch.stack([d[ln >> 2, 2 * (ln & 3)], d[ln >> 2, 2 * (ln & 3) + 1],
                                     d[(ln >> 2) + 8, 2 * (ln & 3)], d[(ln >> 2) + 8, 2 * (ln & 3) + 1]])
                        for ln in range(32)])


def swap_halves(words: torch.Tensor) -> torch.Tensor:
    """int32 words with their 16-bit halves swapped: for metadata, the planted "row halves swapped" bug."""
    v = words.to(torch.int64) & 0xFFFFFFFF
    v = (v >> 16) | ((v & 0xFFFF) << 16)
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)
