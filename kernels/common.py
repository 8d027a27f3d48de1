"""Which target numba compiles the kernels for: the GPU, or its simulator (``SIM``)."""
from __future__ import annotations

from numba import config

SIM = bool(config.ENABLE_CUDASIM)    # NUMBA_ENABLE_CUDASIM=1: numba's CUDA simulator, no GPU

# Per-block scratch words each emulated warp exchange needs (0 on the GPU: the array is unused).
SCRATCH_WORDS = 1024 * 6 if SIM else 1

# spmm_ws's decode selects a lane's A word with two byte permutes (``_wg_intrinsics*.strip_a16p``): a forward
# 4-byte extract (prmt.f4e) at the lane's two transposed bitmap bits from the bytes B0..B4 = 10 32 32 10 54 of
# these two words gives the selector that takes (first, 0), (0, 0), (0, first) or (first, second).
STRIP_LUT = (0x10323210, 0x54)
