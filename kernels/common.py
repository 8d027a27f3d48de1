"""Which target numba compiles the kernels for: the GPU, or its simulator (``SIM``)."""
from __future__ import annotations

from numba import config

SIM = bool(config.ENABLE_CUDASIM)    # NUMBA_ENABLE_CUDASIM=1: numba's CUDA simulator, no GPU

# Per-block scratch words each emulated warp exchange needs (0 on the GPU: the array is unused).
SCRATCH_WORDS = 1024 * 6 if SIM else 1
