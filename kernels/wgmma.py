"""The shared-memory matrix descriptor of Hopper's warpgroup MMA (``wgmma.mma_async``): pure Python."""
from __future__ import annotations


def descriptor(lbo: int, sbo: int, swizzle: int = 0, base: int = 0) -> int:
    """A shared-memory matrix descriptor without its start address (the kernel adds the operand's shared
    address >> 4 in bits 0-13): leading byte offset (bits 16-29) and stride byte offset (bits 32-45), each
    >> 4; base offset (bits 49-51); swizzle (bits 62-63: 0 none, 1 128 B, 2 64 B, 3 32 B). With no swizzle
    and a K-major operand, the leading byte offset is the step between 8x8 core matrices along K and the
    stride byte offset the step along N (M) (pinned down on an H100: docs/kernels-notes.md "v16 outcome")."""
    return ((lbo >> 4) & 0x3FFF) << 16 | ((sbo >> 4) & 0x3FFF) << 32 | (base & 7) << 49 | (swizzle & 3) << 62
