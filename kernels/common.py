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


def quarter_regs(warps: int, blocks: int = 1) -> int:
    """The most registers a thread may take for ``blocks`` blocks of ``warps`` warps to fit an SM: the warps are
    spread over its four quarters, each with 16K registers, so the fullest quarter (``ceil(blocks x warps / 4)``
    warps) sets the limit, not the SM's 64K (H100: 9- and 10-warp blocks of 184-186 registers, 55-59K in all,
    failed to launch for want of resources; docs/kernels-notes.md "v29"). A multiple of 8."""
    return min(255, 16384 // (32 * -(-(warps * blocks) // 4))) & ~7
