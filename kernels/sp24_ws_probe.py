"""What each part of sp24_ws's step costs, and candidate variants of it: its kernels built with one part of every
step left out, or built another way (docs/kernels-notes.md "v24"). A diagnostic, never on a product path.

An **ablation** computes a wrong product (or none), and only its time means anything:

======================  =====================================================================================
ablation                left out
======================  =====================================================================================
``no_products``         the products and A loads: consumers wait for each stage and release it at once
``no_copies``           the producer and every wait on it: the consumers load A and multiply stale shared memory
``no_x``                the X slab's copy (the weights' copies and every wait stay)
``no_weights``          the weight tiles' copies (X's copy and every wait stay)
``no_loop``             the step loop (set-up, the end of the tile, the launch, the host's ``x_slabs``)
======================  =====================================================================================

A **variant** is the whole kernel, correct, built another way: ``early_release`` and ``late_release`` (at every
tile width, each step retires the previous step's products and frees their stage before / after waiting for its
own copies; the default does the first from 64 tokens a tile, docs/kernels-notes.md "v25") and ``two_blocks``
(registers capped so that two blocks fit an SM: 112 for two warpgroups, where 128-token tiles otherwise take one
SM each; no faster, v25).

Usage (``scripts/bench/probe_sp24_ablate.py`` times each beside the default build)::

    with built_as("no_products"):
        sp24_matmul(x, layout, kernel="ws")

**Time stamps** (``ws_stamps``; ``scripts/bench/probe_ws_stamps.py`` summarizes them, its kernel set to sp24): one
launch of the whole kernel, no K split, whose roles write per block and step the SM cycles since the block started
into a float32 buffer, in the slots of ``spmm_ws_probe`` where the roles match:

====  ==========================================================================================
slot  when
====  ==========================================================================================
0     consumer (warp 0, lane 0): the step begins
1     consumer: the previous step's products retired and its stage released
2     consumer: the stage is "full" (its copies landed; before slot 1 where the release is late)
3     consumer: the A and metadata loads issued
4     consumer: the products issued and committed
5     producer (lane 0): the stage is free to refill ("empty"; steps < stages: at once)
6     producer: the step's bulk copies issued
7     (unused: no table warp)
====  ==========================================================================================
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import sp24_ws

ABLATIONS = sp24_ws.ABLATIONS
VARIANTS = sp24_ws.VARIANTS


@contextlib.contextmanager
def built_as(mode: str | None) -> Iterator[None]:
    """sp24_ws launches inside the block run kernels built as ``mode`` (one of ABLATIONS or VARIANTS; None: the
    default build). Weights with dense tiles and thread-block clusters are refused there (``AssertionError`` at
    the build)."""
    if mode is not None and mode not in ABLATIONS + VARIANTS + (sp24_ws.STAMPS,):
        raise ValueError(f"unknown sp24_ws build {mode!r}: one of {', '.join(ABLATIONS + VARIANTS)}")
    from . import launch

    before = sp24_ws.probe_build[0]
    sp24_ws.probe_build[0] = mode
    launch.planned.clear()            # launches kept for eager calls name the kernels of the build they ran
    try:
        yield
    finally:
        sp24_ws.probe_build[0] = before
        launch.planned.clear()


def ws_stamps(x: torch.Tensor, layout, tokens: int | None = None, stages: int | None = None,
              strips: int | None = None, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(y, stamps, plan)``: ``y = x @ W^T`` as ``sp24_matmul(kernel="ws")`` computes it with K not split, for a
    weight whose tiles are all 2:4; ``stamps`` [blocks, steps, 8] float32 cycles (the slots above; steps past a
    block's own are zero); ``plan``: the plan's numbers, whether the release is late (slot 2 before slot 1), each
    block's SM (``sm``) and its start and end on the GPU's nanosecond timer (low 32 bits, int64)."""
    from . import launch
    from .io import padded
    from .sp24 import _launch_wg

    if x.dim() != 2 or x.shape[0] == 0 or x.dtype != torch.float16:
        raise ValueError("ws_stamps expects fp16 x [N, K] with N > 0")
    if layout.dense.numel() > 0:
        raise ValueError("ws_stamps takes weights whose tiles are all 2:4")
    (m, _), (_, gk), n = layout.shape, layout.grid, x.shape[0]
    y = torch.empty(n, m, dtype=torch.float16, device=x.device)
    with built_as(sp24_ws.STAMPS):
        p, r, wg, buf = _launch_wg(padded(x, gk * 64), layout, y, m, n, gk, gk * 64, launch, tokens, 1, stages,
                                   strips, groups, None, specialized=True, stamps=True)
    st = buf.view(p.blocks, p.per + 1, 8)
    row = st[:, -1].to(torch.int64)
    return y, st[:, :-1], {"tokens": p.nt, "stages": p.stages, "strips": r, "groups": wg, "blocks": p.blocks,
                           "steps": p.per, "late": p.nt <= sp24_ws.LATE_UP_TO, "sm": row[:, 0],
                           "start_ns": row[:, 1] | (row[:, 2] << 16), "end_ns": row[:, 3] | (row[:, 4] << 16)}
