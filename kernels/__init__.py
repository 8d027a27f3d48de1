"""Numba CUDA kernels for TCA-BME sparse x dense products (installed as ``sparsekit.kernels``).

    tcabme_matmul(x, w, out=None)  # y[N, M] = x[N, K] @ W^T, W packed (sparsekit.packed.tcabme.TcaBme)
    reference_matmul(x, w)          # decode + matmul, any device
    kernels_available()             # True when the GPU kernels can run here
    decode.tcabme_decode(w)         # the dense [M, K] weight, one GPU kernel (import it from .decode)

Importing this package is cheap and safe on a CPU-only machine: numba.cuda and the kernels load
on first use.
"""
from __future__ import annotations

import numpy

# numba-cuda 0.30.4 still calls numpy.row_stack, which numpy 2.5 removed: restore the alias.
if not hasattr(numpy, "row_stack"):
    numpy.row_stack = numpy.vstack

from .matmul import kernels_available, tcabme_matmul  # noqa: E402
from .reference import reference_matmul  # noqa: E402

__all__ = ["tcabme_matmul", "reference_matmul", "kernels_available"]
