"""How fast one producer lane's bulk copies stream global memory into a block's ring, by copy size (issue 21,
docs/kernels-notes.md "v23"): the skeleton of ``spmm_ws`` with the decode, the table and the products taken out.
A diagnostic, never on a product path.

``bulk_stream`` launches blocks of two warps. Lane 0 of the first copies block ``b``'s contiguous share of
``src``, ``step_bytes`` a step in ``pieces`` equal bulk copies, into a ring of ``stages`` (waiting "empty",
completing on "full"); lane 0 of the second waits "full", reads the stage's first word, keeps the stage
``hold`` more SM cycles (a stand-in for a consumer's work on it) and frees it. ``sink[b]`` gets the sum of the
words read, so a test can see that every step landed.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import cuda

from ._intrinsics import bulk_copy, clock32, mbar_arrive, mbar_expect, mbar_init, mbar_wait
from .block import dynamic_smem

_KERNELS: dict = {}


def _build(STAGES: int, PIECES: int):
    @cuda.jit
    def kernel(src, sink, SW, NSTEP, HOLD, LAPS):
        d64, _, _ = dynamic_smem()
        full = cuda.shared.array(STAGES, np.uint64)
        empty = cuda.shared.array(STAGES, np.uint64)
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x
        if tid == 0:
            for s in range(STAGES):
                mbar_init(full, s, 1)
                mbar_init(empty, s, 1)
        cuda.syncthreads()
        base = b * NSTEP * SW                        # this block's first word; SW words a step
        pw = SW // PIECES
        if tid == 0:
            for i in range(NSTEP * LAPS):
                s = i % STAGES
                if i >= STAGES:
                    mbar_wait(empty, s, ((i // STAGES) - 1) & 1)
                mbar_expect(full, s, SW * 8)
                at = base + (i % NSTEP) * SW             # each lap reads the block's share again
                for p in range(PIECES):
                    bulk_copy(d64, s * SW + p * pw, src, at + p * pw, pw * 8, full, s)
        elif tid == 32:
            acc = np.int64(0)
            for i in range(NSTEP * LAPS):
                s = i % STAGES
                mbar_wait(full, s, (i // STAGES) & 1)
                acc += np.int64(d64[s * SW])
                t = clock32()
                while np.int64(np.uint32(clock32() - t)) < HOLD:
                    pass
                mbar_arrive(empty, s)
            sink[b] = acc
        cuda.syncthreads()

    return kernel


def bulk_stream(src: torch.Tensor, blocks: int, step_bytes: int, stages: int = 4, pieces: int = 1,
                hold: int = 0, laps: int = 1) -> torch.Tensor:
    """Stream ``src`` (int64, ``blocks * steps * step_bytes`` bytes) through ``blocks`` rings, ``laps`` times (each
    block reads its share again: a ``src`` that fits the L2 is then read from it); returns ``sink`` [blocks] int64
    (the sum of each step's first word over the laps)."""
    from . import launch

    if step_bytes % (16 * pieces) or src.dtype != torch.int64:
        raise ValueError("step_bytes must split into pieces of a multiple of 16 bytes, src must be int64")
    sw = step_bytes // 8
    nstep = src.numel() // (blocks * sw)
    if nstep < 1:
        raise ValueError("src is smaller than one step per block")
    key = (stages, pieces)
    if key not in _KERNELS:
        _KERNELS[key] = _build(stages, pieces)
    sink = torch.zeros(blocks, dtype=torch.int64, device=src.device)
    if laps < 1:
        raise ValueError(f"laps must be 1 or more, got {laps}")
    launch.launch_tensors(_KERNELS[key], blocks, 64, (src, sink), (sw, nstep, hold, laps), dyn=stages * step_bytes)
    return sink
