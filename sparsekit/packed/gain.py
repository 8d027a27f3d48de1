"""Whether packing a linear as TCA-BME gains anything: the rule ``encode`` and the runtime's in-memory
``sparsify`` use by default.

What a packed layer gains at run time follows from its bytes: the packed weight is what stays in
memory (``--prefer memory``) and what the sparse kernels read, so a layer is worth packing when its
TCA-BME bytes are below the dense bytes by at least ``PACK_MARGIN``. TCA-BME costs one bitmap bit per
weight plus the nonzero values (padded to 8 per 64x64 tile), so for 16-bit weights the break-even
sparsity is about 1/16; with the margin, a layer packs from about 11% zeros on, whatever its pattern
(unstructured, 2:4, or hybrid tiles, whose dense tiles still cost their bitmap bits).
"""
from __future__ import annotations

import torch

from sparsekit.packed.tcabme import ALIGN, BT_PER_GT, GROUP

PACK_MARGIN = 0.05  # pack when the packed bytes are at most (1 - PACK_MARGIN) x the dense bytes


def packed_nbytes(weight: torch.Tensor, itemsize: int = 2) -> int:
    """The bytes ``tcabme.encode(weight).nbytes`` gives for ``weight`` in a 16-bit dtype (``itemsize``
    bytes a value), counted without encoding (a -0.0 counts as zero, as ``encode`` stores it)."""
    m, k = (int(s) for s in weight.shape)
    gm, gk = -(-m // GROUP), -(-k // GROUP)
    nonzero = torch.zeros(gm * GROUP, gk * GROUP, dtype=torch.int32, device=weight.device)
    nonzero[:m, :k] = weight.detach() != 0
    per_tile = nonzero.reshape(gm, GROUP, gk, GROUP).sum(dim=(1, 3)).reshape(-1)
    values = int((per_tile + (-per_tile) % ALIGN).sum())
    ngt = gm * gk
    return ngt * BT_PER_GT * 8 + values * itemsize + (ngt + 1) * 4 + ngt * 4 * 4 + 16


def worth_packing(weight: torch.Tensor, pattern: str | None = None) -> tuple[bool, float, str]:
    """``(pack, packed/dense bytes ratio, reason)`` for one [out, in] weight, stored 16-bit."""
    dense = weight.numel() * 2
    ratio = packed_nbytes(weight) / dense if dense else 1.0
    what = f"{pattern} layer" if pattern else "layer"
    if ratio <= 1.0 - PACK_MARGIN:
        return True, ratio, (f"{what}: packed takes {ratio:.3f}x the dense bytes "
                             f"(at most {1 - PACK_MARGIN:.2f}x gains memory and kernel reads)")
    return False, ratio, (f"{what}: packed would take {ratio:.3f}x the dense bytes, above the "
                          f"{1 - PACK_MARGIN:.2f}x the runtime needs to gain anything; kept dense "
                          "(--force packs it anyway)")
