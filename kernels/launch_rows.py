"""Host side of spmm_rows (issue 21, runtime v3): plan -> one launch on torch's current stream.

Like sp24's ``_launch_rows``: no synchronization and no host<->device copies once the weight has been
seen (its widest strip is read once, eagerly; inside CUDA-graph capture an unseen weight gets the
dense copy count), a direct launch once numba's argument packing is checked, split-K partials in the
shared workspace (two tiles per block) with counters reset by the kernel (graph replays need nothing else). All tokens go in
one launch: ``tokens`` per block, more as further token chunks of the grid. Opt-in
(``tcabme_matmul(kernel="rows")`` or ``SPARSEKIT_KERNEL=rows``) until a GPU session has timed it.
"""
from __future__ import annotations

import torch

from . import launch, plan, spmm_rows


def launch_rows(x: torch.Tensor, w, y: torch.Tensor, *, tokens: int | None = None, splits: int | None = None,
                stages: int | None = None, regs: int | None = None) -> None:
    """y[N, M] = x[N, Kp] @ W^T with spmm_rows; x already padded to Kp columns, contiguous, 16-byte aligned."""
    n = x.shape[0]
    m, _ = w.shape
    _gm, gk = w.grid
    p = plan.rows_plan(m, gk, n, launch.sm_count(x.device), tokens, splits, stages)
    vch = launch._weight_views(w)[5][0]      # 16-byte value chunks of the widest strip (cached per weight)
    kern = spmm_rows.get_kernel(p.nt, p.stages, -(-vch // 32), regs or plan.rows_max_registers(p.nt))
    ws, cnt = launch.workspace(x.device, p.workspace_floats(), p.tiles)
    values = w.values[: w.values.numel() // 8 * 8]     # whole 8-byte words (the kernel never reads the tail)
    if values.data_ptr() % 16:
        values = values.clone()
    tensors = (w.bitmaps.view(torch.int64), values.view(torch.int64), w.gtile_offsets, w.strip_offsets,
               x.reshape(-1).view(torch.int64), y.reshape(-1).view(torch.int16), ws, cnt)
    launch.launch_tensors(kern, p.blocks, spmm_rows.THREADS, tensors, (m, n, gk, gk * 128, p.chunks, p.per),
                          dyn=p.dyn)
