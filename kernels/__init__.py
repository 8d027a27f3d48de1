"""Numba CUDA kernels for TCA-BME sparse x dense products (installed as ``sparsekit.kernels``).

Owns the GPU kernels, their launch planning and launches, and every reach into numba's internals.
May import only ``sparsekit.errors``, ``sparsekit.packed.tcabme`` (the format) and ``sparsekit.packed.sp24``
(the runtime layout of 2:4 and hybrid weights); never the runtime.

    tcabme_matmul(x, w, out=None)  # y[N, M] = x[N, K] @ W^T, W packed (sparsekit.packed.tcabme.TcaBme)
    reference_matmul(x, w)          # decode + matmul, any device
    kernels_available()             # True when the GPU kernels can run here
    decode.tcabme_decode(w)         # the dense [M, K] weight, one GPU kernel (import it from .decode)

Modules: ``plan`` (pure launch planning: grids, warps, stages, shared memory, tuning knobs),
``launch`` (plan -> numba launches on torch's stream), ``compat_numba`` (numba / numba-cuda /
cuda-core internals, with the versions checked), ``common`` (``SIM``: simulator or GPU), ``spmm`` /
``spmm_warp`` / ``decode`` (the kernels), ``_intrinsics*`` / ``_warp_intrinsics*`` (their device
primitives: ``_ptx`` on a GPU, ``_sim`` under the simulator), ``health`` (can the kernels run here).
Opt-in TCA-BME kernel (``tcabme_matmul(kernel="rows")`` or ``SPARSEKIT_KERNEL=rows``): ``spmm_rows`` /
``launch_rows`` (a GroupTile row per block, the X slice shared by its 4 warps).
2:4 and hybrid weights: ``sp24`` (``sp24_matmul``, host side), ``sp24_plan``, ``sp24_kernel`` (mma.sp for
2:4 tiles, mma.sync for dense ones), ``_sp_intrinsics*``, ``sp24_probe`` (one mma.sp, for checks).

Importing this package is cheap and safe on a CPU-only machine: numba.cuda and the kernels load
on first use.
"""
from __future__ import annotations

from . import compat_numba  # noqa: F401 - numpy shims numba-cuda needs, before numba.cuda loads
from .matmul import kernels_available, tcabme_matmul  # noqa: E402
from .reference import reference_matmul  # noqa: E402

__all__ = ["tcabme_matmul", "reference_matmul", "kernels_available"]
