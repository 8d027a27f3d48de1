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

from . import launch
from .io import output_for, padded
from .sp24_ws import x_slabs
from .spmm_ws import WINDOW, block_warps, get_kernel, slot_bytes, value_room, ws_plan

SLOTS = ("begin", "retired", "full", "decoded", "issued", "empty", "copied", "landed")


def ws_stamps(x: torch.Tensor, w, tokens: int | None = None, stages: int | None = None,
              groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(y, stamps, plan)``: ``y = x @ W^T`` as ``tcabme_ws_matmul`` computes it, ``stamps`` [blocks, steps,
    8] float32 cycles (see the module docstring; steps past a block's own are zero) and the plan's numbers."""
    m, k = w.shape
    n = x.shape[0]
    if x.dim() != 2 or x.dtype != torch.float16 or x.shape[1] != k or n == 0:
        raise ValueError("ws_stamps expects fp16 x [N, K] with N > 0 and K matching the weight")
    gm, gk = w.grid
    xp = padded(x, gk * 64)
    vbytes = value_room(w)
    p, _r, wg = ws_plan(m, gk, n, launch.sm_count(x.device), tokens, stages, groups, 1, vbytes)
    out = output_for(x, m, None)
    stamps = torch.zeros(p.blocks * p.per * 8, dtype=torch.float32, device=x.device)
    cnt = torch.zeros(max(p.tiles, 1), dtype=torch.int32, device=x.device)
    vals = w.values.contiguous() if w.values.numel() else torch.zeros(8, dtype=torch.float16, device=x.device)
    tensors = (w.bitmaps.view(torch.int64), vals.view(torch.int64), w.gtile_offsets, x_slabs(xp, p.nt),
               out.reshape(-1).view(torch.int16), stamps, cnt)
    launch.launch_tensors(get_kernel(p.nt, p.stages, wg, WINDOW, None, 1, stamps=True), p.blocks,
                          32 * block_warps(wg), tensors, (m, n, gk, p.chunks, p.per, slot_bytes(vbytes)), dyn=p.dyn)
    plan = {"tokens": p.nt, "stages": p.stages, "groups": wg, "blocks": p.blocks, "steps": p.per}
    return out, stamps.view(p.blocks, p.per, 8), plan
