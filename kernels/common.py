"""What every kernel file shares: the target numba compiles for, and the staged X row layout."""
from __future__ import annotations

from numba import config

SIM = bool(config.ENABLE_CUDASIM)    # NUMBA_ENABLE_CUDASIM=1: numba's CUDA simulator, no GPU

# Per-block scratch words each emulated warp exchange needs (0 on the GPU: the array is unused).
SCRATCH_WORDS = 1024 * 6 if SIM else 1

XROW = 18                 # uint64 per staged X row: 16 + 2 pad (144 B), conflict-free 4-byte B loads
XROW_BYTES = 8 * XROW
