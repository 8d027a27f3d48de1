"""cuSPARSELt's compressed form of a 2:4 weight, as ``torch._cslt_compress`` writes it for fp16 (the buffer
``runtime.cusparselt`` multiplies), written down so that a 2:4 tile-mosaic layout can be turned into it on the GPU
without a dense weight or cuSPARSELt's own compress (3.1 ms on a 22016x4096 weight on an H100, docs/kernels-notes.md
"v38"). Pure torch; the reference of ``sparsekit.kernels.sp24_cslt``.

For ``[M, K]`` with M and K multiples of 64 it is ``[M, K/2 + K/16]`` fp16, flat:

- the kept values, row-major ``[M, K/2]``: each group of 4 columns gives its two kept values, the lower column first;
- then the metadata, ``M * K / 8`` bytes: one nibble ``i0 | i1 << 2`` a group (``i0 < i1`` the kept columns), in
  blocks of 64 rows x 8 groups (32 columns) of 256 bytes, the blocks in row-block-major order (block ``(r // 64) *
  K/32 + g // 8`` for row r, group g). Within a block, nibble ``p`` (the low nibble of a byte first) holds row r,
  group g where, bit by bit from bit 0, p = (r bit 3, g bit 2, g bit 0, g bit 1, r bits 0-2, r bits 4-5).

Read off ``torch._cslt_compress`` on an H100 (torch 2.11, cuSPARSELt 0.8.0) with one compress per bit of a group's
index, on weights of 64-22016 rows ("v38", "v39"); equal to it byte for byte on the four 7B shapes
(``scripts/checks/gpu_sp24.py``, its cslt kernel) and checked once per device at load (``runtime.sp24.cslt_check``)
before the runtime uses it. A group with fewer than two nonzeros has free slots, and cuSPARSELt may fill other ones
than the lowest (other bytes, the same product): the byte checks use kept values that are never zero. Shapes that
are not multiples of 64 are padded by cuSPARSELt in another way and are not covered.
"""
from __future__ import annotations

import torch


def cslt_shape(m: int, k: int) -> tuple[int, int]:
    """The fp16 shape of the compressed buffer of an ``[m, k]`` weight (multiples of 64)."""
    if m % 64 or k % 64 or m <= 0 or k <= 0:
        raise ValueError(f"cuSPARSELt's layout is written down only for multiples of 64, not {m}x{k}")
    return m, k // 2 + k // 16


def compress(w: torch.Tensor) -> torch.Tensor:
    """The compressed buffer of a dense ``[M, K]`` fp16 weight whose every group of 4 (along K) has at most 2
    nonzeros. Kept slots: the nonzero ones, then the lowest zero ones (as ``packed.sp24.transcode``; cuSPARSELt may
    pick other free slots, which hold zeros either way); a pruned ``-0.0`` is stored as ``+0.0``."""
    m, k = w.shape
    shape = cslt_shape(m, k)
    grp = w.contiguous().view(torch.int16).reshape(m, k // 4, 4)
    nz = w.reshape(m, k // 4, 4) != 0
    if int(nz.sum(-1).max()) > 2:
        raise ValueError("a group of 4 has more than 2 nonzeros: not a 2:4 weight")
    pos = torch.arange(4, device=w.device, dtype=torch.int32)
    idx = torch.sort(torch.argsort((~nz).to(torch.int32) * 4 + pos, dim=-1)[..., :2], dim=-1).values
    vals = torch.where(torch.gather(nz, -1, idx), torch.gather(grp, -1, idx), 0).to(torch.int16).reshape(-1)
    code = (idx[..., 0] | (idx[..., 1] << 2)).to(torch.uint8)                   # [M, K/4]
    # rows (rb, r45, r3, r02), groups (cb, g2, g1, g0) -> (rb, cb, r45, r02, g1, g0, g2, r3)
    code = code.reshape(m // 64, 4, 2, 8, k // 32, 2, 2, 2).permute(0, 4, 1, 3, 6, 7, 5, 2).reshape(-1, 2)
    meta = (code[:, 0] | (code[:, 1] << 4)).view(torch.int8).view(torch.int16)
    # ``rb, r45, r3, r02`` above reads row r as r = 64 rb + 16 r45 + 8 r3 + r02 (bits 4-5, 3, 0-2)
    return torch.cat([vals, meta]).view(torch.float16).reshape(shape)
