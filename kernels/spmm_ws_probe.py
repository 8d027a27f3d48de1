"""Where a spmm_ws launch spends its cycles: the kernel built with time stamps (issue 21, docs/kernels-notes.md
"v21" item 5 and "v22 outcome"). A diagnostic, never on a product path.

``ws_stamps`` runs one launch of ``spmm_ws.get_kernel(..., stamps=True)``, whose roles write, per block and step,
the cycles since the block started (the SM's ``%clock``, after the block's barrier setup) into a float32 buffer:

====  ==========================================================================================
slot  when
====  ==========================================================================================
0     consumer (warp 0, lane 0): the step begins
1     consumer: the previous step's products retired and its stage released
2     consumer: the stage is "full" (copies landed and the table warp published its tables)
3     consumer: the 16 A registers decoded
4     consumer: the products issued and committed
5     copy warp (lane 0): the stage is free to refill ("empty"; steps < stages: at once)
6     copy warp: the step's bulk copies issued
7     table warp (lane 0): the copies landed ("raw")
====  ==========================================================================================

The output is the product as usual (the stamps cost a few instructions per step and role). No K split, so
``y`` is whole and the buffer holds only stamps.
"""
from __future__ import annotations

import torch

from .spmm_ws import ws_launch

SLOTS = ("begin", "retired", "full", "decoded", "issued", "empty", "copied", "landed")


def ws_stamps(x: torch.Tensor, w, tokens: int | None = None, stages: int | None = None,
              groups: int | None = None, alt: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(y, stamps, plan)``: ``y = x @ W^T`` as ``tcabme_ws_matmul`` computes it (K not split), ``stamps``
    [blocks, steps, 8] float32 cycles (see the module docstring; steps past a block's own are zero) and the plan's
    numbers, with each block's SM (``sm``) and its start and end on the GPU's nanosecond timer (``start_ns``,
    ``end_ns``: the timer's low 32 bits, int64). ``alt``: two warpgroups take the tile row's steps in turn (each
    step stamped by its own)."""
    if x.dim() != 2 or x.shape[0] == 0:
        raise ValueError("ws_stamps expects x [N, K] with N > 0")
    y, p, stamps = ws_launch(x, w, None, tokens, stages, groups, 1, stamps=True, alt=alt)
    row = stamps[:, -1].to(torch.int64)
    return y, stamps[:, :-1], {"tokens": p.nt, "stages": p.stages, "groups": 2 if alt else p.r, "blocks": p.blocks,
                               "steps": p.per, "alt": alt, "sm": row[:, 0], "start_ns": row[:, 1] | (row[:, 2] << 16),
                               "end_ns": row[:, 3] | (row[:, 4] << 16)}
