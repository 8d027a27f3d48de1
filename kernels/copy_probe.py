"""How fast one producer lane's bulk copies stream global memory into a block's ring, by copy size (issue 21,
docs/kernels-notes.md "v23"): the skeleton of ``spmm_ws`` with the decode, the table and the products taken out.
A diagnostic, never on a product path.

``bulk_stream`` launches blocks of two warps. Lane 0 of the first copies block ``b``'s contiguous share of
``src``, ``step_bytes`` a step in ``pieces`` equal bulk copies, into a ring of ``stages`` (waiting "empty",
completing on "full"); lane 0 of the second waits "full", reads the stage's first word, keeps the stage
``hold`` more SM cycles (a stand-in for a consumer's work on it) and frees it. ``sink[b]`` gets the sum of the
words read, so a test can see that every step landed.

With ``shared_bytes``, the last ``shared_bytes`` of each step are common to the blocks of a group of ``share``
(an X slab that several row blocks read): each block copies them itself, or, in thread-block clusters of
``cluster`` blocks (GPU only; the group is the cluster), the cluster's first block multicasts them into every
block's stage once every block has freed it (spmm_pf's and spmm_ws's X multicast, docs/kernels-notes.md "v22").
"""
from __future__ import annotations

import numpy as np
import torch
from numba import cuda

from ._intrinsics import (bulk_copy, bulk_copy_mc, clock32, cluster_rank, cluster_sync, mbar_arrive,
                          mbar_arrive_remote, mbar_expect, mbar_init, mbar_wait, smem_base, smid)
from .block import dynamic_smem
from .common import SIM

_KERNELS: dict = {}
_MAPS: dict = {}   # (source pointer, size, device, box, swizzle) -> its tensor map, in global memory and as a record


def _make_reader(STAGES: int, CL: int, ONE: bool):
    """The reading lane's loop: wait "full", add the stage's first word (and its shared part's), hold, free the
    stage (``ONE``: in every block of the cluster, on its ``xempty``), then the block's sum and SM into ``sink``."""
    @cuda.jit(device=True, inline=True)
    def read(d64, r0, full, empty, xempty, sink, b, SW, ow, XW, steps, HOLD):
        acc = np.int64(0)
        for i in range(steps):
            s = i % STAGES
            mbar_wait(full, s, (i // STAGES) & 1)
            if ow > 0:
                acc += np.int64(d64[r0 + s * SW])
            if XW > 0:
                acc += np.int64(d64[r0 + s * SW + ow])
            t = clock32()
            while np.int64(np.uint32(clock32() - t)) < HOLD:
                pass
            if ONE:
                for r in range(CL):
                    mbar_arrive_remote(xempty, s, r)
            else:
                mbar_arrive(empty, s)
        sink[b] = acc
        sink[cuda.gridDim.x + b] = np.int64(smid())   # where the block ran (placement, the probe's report)

    return read


def _build(STAGES: int, PIECES: int, CL: int = 1, SPLIT: bool = False):
    ONE = SPLIT and CL > 1                           # each block multicasts a slice, the readers freeing it in one hop
    read = _make_reader(STAGES, CL, ONE)

    @cuda.jit
    def kernel(src, sink, SW, NSTEP, HOLD, LAPS, XW, SHARE):
        d64, _, _ = dynamic_smem()
        full = cuda.shared.array(STAGES, np.uint64)
        empty = cuda.shared.array(STAGES, np.uint64)
        xempty = cuda.shared.array(STAGES, np.uint64)  # (clusters) every block's stage free: the first block's
        # (ONE: each block's own, for its slice, from every block's reader)
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x
        rank = cluster_rank() if CL > 1 else np.uint32(0)
        if tid == 0:
            for s in range(STAGES):
                mbar_init(full, s, 1)
                mbar_init(empty, s, 1)
                mbar_init(xempty, s, CL)
        cuda.syncthreads()
        if CL > 1:
            cluster_sync()                           # every block's barriers set up before any remote use
        ow = SW - XW                                 # words of the block's own part of a step
        base = b * NSTEP * SW                        # this block's first word; SW words a step
        xbase = (b // SHARE) * NSTEP * SW + ow       # its group's shared part of the first step
        pw = ow // PIECES
        if tid == 0:
            for i in range(NSTEP * LAPS):
                s = i % STAGES
                if i >= STAGES:                          # (SPLIT: every block's reader freed it, one hop)
                    mbar_wait(xempty if ONE else empty, s, ((i // STAGES) - 1) & 1)
                mbar_expect(full, s, SW * 8)             # (SPLIT: others' slices may have landed before it)
                if CL > 1 and not ONE:
                    mbar_arrive_remote(xempty, s, 0)   # after the expect: the shared bytes may land from now on
                at = base + (i % NSTEP) * SW             # each lap reads the block's share again
                for p in range(PIECES):
                    if pw > 0:
                        bulk_copy(d64, s * SW + p * pw, src, at + p * pw, pw * 8, full, s)
                xat = xbase + (i % NSTEP) * SW
                if XW > 0 and CL == 1:
                    bulk_copy(d64, s * SW + ow, src, xat, XW * 8, full, s)
                elif XW > 0 and ONE:                     # slice `rank` of the shared part, into every block
                    xs = XW // CL
                    bulk_copy_mc(d64, s * SW + ow + rank * xs, src, xat + rank * xs, xs * 8, full, s, (1 << CL) - 1)
                elif XW > 0 and rank == 0:
                    mbar_wait(xempty, s, (i // STAGES) & 1)
                    bulk_copy_mc(d64, s * SW + ow, src, xat, XW * 8, full, s, (1 << CL) - 1)
        elif tid == 32:
            read(d64, 0, full, empty, xempty, sink, b, SW, ow, XW, NSTEP * LAPS, HOLD)
        cuda.syncthreads()
        if CL > 1:
            cluster_sync()                           # no block leaves while another may still signal it

    return kernel


def _build_tma(STAGES: int, CL: int, BOX: int, CMAP=None):
    """``_build``'s kernel with tensor copies of ``BOX`` 128-byte rows (``tma_probe``; GPU only), multicast over
    clusters with the one-hop hand-off (``SPLIT``). ``CMAP`` (a one-record array from ``tma_probe.const_map``): the
    tensor map baked into the kernel's constant memory, where the ``tmap`` argument is ignored (one build per map)."""
    from .tma_probe import tma_prefetch, tma_rows, tma_rows_mc

    BW = BOX * 16                                    # words a box
    read = _make_reader(STAGES, CL, CL > 1)          # one block: freed by a local arrive, as the 1D kernel's

    @cuda.jit
    def kernel(src, gmap, sink, SW, NSTEP, HOLD, LAPS, XW, SHARE):
        tmap = gmap if CMAP is None else cuda.const.array_like(CMAP)
        d64, _, _ = dynamic_smem()
        full = cuda.shared.array(STAGES, np.uint64)
        xempty = cuda.shared.array(STAGES, np.uint64)  # every block's reader freed the stage
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x
        rank = cluster_rank() if CL > 1 else np.uint32(0)
        if tid == 0:
            for s in range(STAGES):
                mbar_init(full, s, 1)
                mbar_init(xempty, s, CL)
        cuda.syncthreads()
        if CL > 1:
            cluster_sync()
        ow = SW - XW
        base = b * NSTEP * SW
        xbase = (b // SHARE) * NSTEP * SW + ow
        r0 = np.int64(((1024 - (smem_base(d64, 0) & 1023)) & 1023) >> 3)   # the ring from a 1024-byte boundary
        if tid == 0:
            tma_prefetch(tmap)
            for i in range(NSTEP * LAPS):
                s = i % STAGES
                if i >= STAGES:
                    mbar_wait(xempty, s, ((i // STAGES) - 1) & 1)
                mbar_expect(full, s, SW * 8)
                at = base + (i % NSTEP) * SW
                for p in range(ow // BW):
                    tma_rows(d64, r0 + s * SW + p * BW, tmap, (at + p * BW) // 16, full, s)
                xat = xbase + (i % NSTEP) * SW
                if CL == 1:
                    for p in range(XW // BW):
                        tma_rows(d64, r0 + s * SW + ow + p * BW, tmap, (xat + p * BW) // 16, full, s)
                else:
                    xs = XW // CL
                    for p in range(xs // BW):
                        o = rank * xs + p * BW
                        tma_rows_mc(d64, r0 + s * SW + ow + o, tmap, (xat + o) // 16, full, s, (1 << CL) - 1)
        elif tid == 32:
            read(d64, r0, full, xempty, xempty, sink, b, SW, ow, XW, NSTEP * LAPS, HOLD)
        cuda.syncthreads()
        if CL > 1:
            cluster_sync()

    return kernel


def bulk_stream(src: torch.Tensor, blocks: int, step_bytes: int, stages: int = 4, pieces: int = 1,
                hold: int = 0, laps: int = 1, shared_bytes: int = 0, share: int = 1,
                cluster: int = 1, sms: torch.Tensor | None = None, split: bool = False,
                tma_box: int = 0, tma_swizzle: bool = False, tma_const: bool = False) -> torch.Tensor:
    """Stream ``src`` (int64, ``blocks * steps * step_bytes`` bytes) through ``blocks`` rings, ``laps`` times (each
    block reads its share again: a ``src`` that fits the L2 is then read from it); returns ``sink`` [blocks] int64
    (the sum over the laps of each step's first word and, with ``shared_bytes``, the first word of its shared
    part, which block ``b`` reads from block ``b // share``'s share: see :func:`stream_sums`). ``cluster`` > 1
    (GPU only): clusters of that many blocks, the first multicasting the shared part (``share`` is then
    ``cluster``); with ``split`` each block multicasts a slice, once every block's reader has freed the stage (its
    arrival goes straight to every block, as CUTLASS's consumers do; ``shared_bytes`` a multiple of ``16 *
    cluster``). ``sms`` (int64 [blocks], optional) gets the SM each block ran on. ``tma_box`` (GPU only): tensor
    copies of that many 128-byte rows instead (``tma_probe``; the own part and each block's slice of the shared
    part whole boxes; clusters as with ``split``; ``tma_swizzle``: swizzled 128-byte rows; ``tma_const``: the map
    in the kernel's constant memory instead of global memory, one build per map)."""
    from . import launch

    if step_bytes % (16 * pieces) or src.dtype != torch.int64:
        raise ValueError("step_bytes must split into pieces of a multiple of 16 bytes, src must be int64")
    if shared_bytes % 16 or not 0 <= shared_bytes <= step_bytes or (step_bytes - shared_bytes) % (16 * pieces):
        raise ValueError("shared_bytes must be a multiple of 16 within the step, leaving whole pieces")
    if cluster not in (1, 2, 4) or blocks % cluster or share < 1 or (split and shared_bytes % (16 * cluster)):
        raise ValueError(f"cluster must be 1, 2 or 4 and divide the blocks (split: its slices of the shared bytes "
                         f"whole 16-byte pieces), share at least 1; got {cluster}, {share}")
    share = cluster if cluster > 1 else share
    sw = step_bytes // 8
    nstep = src.numel() // (blocks * sw)
    if nstep < 1:
        raise ValueError("src is smaller than one step per block")
    split = split and cluster > 1
    if tma_box:
        if SIM:
            raise RuntimeError("the simulator has no tensor maps: tensor copies (tma_box) need a GPU")
        bw = tma_box * 128
        if (step_bytes - shared_bytes) % bw or shared_bytes % (bw * cluster):
            raise ValueError(f"with tensor copies the own part and each block's slice of the shared part must be whole "
                             f"boxes of {bw} bytes")
    if laps < 1:
        raise ValueError(f"laps must be 1 or more, got {laps}")
    key = (stages, pieces, cluster, split, tma_box)
    if tma_box:
        from .tma_probe import const_map, tensor_map_rows

        mkey = (src.data_ptr(), src.numel(), src.device, tma_box, tma_swizzle)
        if mkey not in _MAPS:   # made once: a host-to-device copy per call would sync the stream and break capture
            gmap = tensor_map_rows(src, tma_box, tma_swizzle)
            _MAPS[mkey] = (gmap, const_map(gmap))
        gmap, cmap = _MAPS[mkey]
        cmap = cmap if tma_const else None
        key += (None if cmap is None else cmap.tobytes(),)
    if key not in _KERNELS:
        _KERNELS[key] = (_build_tma(stages, cluster, tma_box, cmap) if tma_box
                         else _build(stages, pieces, cluster, split))
    sink = torch.zeros(2 * blocks, dtype=torch.int64, device=src.device)
    if tma_box:
        tensors = (src, gmap, sink)
    else:
        tensors = (src, sink)
    launch.launch_tensors(_KERNELS[key], blocks, 64, tensors, (sw, nstep, hold, laps, shared_bytes // 8, share),
                          dyn=stages * step_bytes + (1024 if tma_box else 0), cluster=cluster)
    if sms is not None:
        sms.copy_(sink[blocks:])
    return sink[:blocks]


def stream_sums(src: torch.Tensor, blocks: int, step_bytes: int, laps: int = 1, shared_bytes: int = 0,
                share: int = 1) -> torch.Tensor:
    """What :func:`bulk_stream` must return for these arguments (its reference, on ``src``'s device)."""
    sw, xw = step_bytes // 8, shared_bytes // 8
    nstep = src.numel() // (blocks * sw)
    steps = src[: blocks * nstep * sw].view(blocks, nstep, sw)
    own = steps[:, :, 0] if xw < sw else torch.zeros_like(steps[:, :, 0])
    group = torch.arange(blocks, device=src.device) // share
    shared = steps[group, :, sw - xw] if xw else torch.zeros_like(own)
    return (own + shared).sum(dim=1) * laps
