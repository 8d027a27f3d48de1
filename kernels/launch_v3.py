"""Host side of spmm_v3 (issue 21): plan -> one launch on torch's current stream.

Like launch.py's spmm_warp path: no synchronization and no host<->device copies (CUDA-graph
capturable once each variant is compiled by an eager call), the weight's numba views cached by
address. All tokens go in one launch: up to ``nt`` tokens per block, more split the grid over
``blockIdx.y``. Opt-in (``SPARSEKIT_KERNEL=v3``, read by ``matmul.kernel_choice``) until a GPU
session has checked and timed it.
"""
from __future__ import annotations

import torch

from . import compat_numba, launch, plan, spmm_v3
from ._intrinsics import SIM


def launch_v3(x: torch.Tensor, w, y: torch.Tensor, *, nt: int | None = None, wr: int | None = None,
              ks: int | None = None, stages: int | None = None, regs: int | None = None) -> None:
    """y[N, M] = x[N, Kp] @ W^T with spmm_v3; x already padded to Kp columns, contiguous, 16-byte aligned."""
    n = x.shape[0]
    m, _ = w.shape
    gm, gk = w.grid
    bm, vals, goff, soff, _vcap, vchs, _flat = launch._weight_views(w)
    vch = vchs[0]
    limit = launch.smem_limit()
    nb, wr, ks, st, ny, dyn = plan.v3_plan(m, gk, n, vch, launch.sm_count(x.device), limit, nt, wr, ks, stages)
    if dyn > limit:
        raise ValueError(f"spmm_v3: no plan fits {limit} bytes of shared memory for a {m}x{64 * gk} weight")
    kern = spmm_v3.get_kernel(nb, st, -(-vch // 32), wr, ks, regs or plan.v3_max_registers(nb))
    grid = (plan.v3_blocks(m, wr), ny)
    scalars = (m, n, gk, 4 * gm, gk * 128, vch, plan.v3_slot_words(vch))
    xv = launch._as_numba(x.reshape(-1).view(torch.int64))
    yv = launch._as_numba(y.reshape(-1).view(torch.int16))
    args = (bm, vals, goff, soff, xv, yv) + scalars
    if SIM:
        kern[grid, 32 * wr * ks, 0, dyn](*args)
        return
    if not launch._allow_smem(kern, args, dyn):
        raise compat_numba.v3_smem_error(dyn)
    kern[grid, 32 * wr * ks, launch._stream(x.device), dyn](*args)
