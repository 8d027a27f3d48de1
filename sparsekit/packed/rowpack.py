"""Row-packed layout: a sparse weight whose rows are contiguous, for activation-sparse MLPs (CATS).

A gated MLP under CATS reads only the rows of ``up`` (and of ``down`` transposed) that belong to
active neurons, so skipping a neuron must skip its bytes: each row of the weight is stored on its
own, never interleaved with other rows as TCA-BME's tiles are. A row of ``cols`` weights is cut
into groups of 256 columns (padded to a multiple of 4 groups), each group into 32 segments of 8
columns:

* ``masks``  uint8 ``[rows, groups * 32]``: bit ``b`` of segment ``s``'s byte says that column
  ``8 s + b`` of the group holds a stored value (any nonzero fp16 bit pattern, -0.0 included, so the
  round trip is bit-exact). The bytes of 4 consecutive groups are interleaved per segment
  (``[rows, groups / 4, 32 segments, 4 groups]``), so one 4-byte load gives a lane its segment's
  masks in 4 groups;
* ``values`` fp16: the stored values in row-major order (row, then column), padded to a multiple of 4;
* ``goff``   int32 ``[rows * groups]``: the index in ``values`` of each group's first value.

A lane reading segment ``s`` of a group finds its values at ``goff + popcount(masks of segments
< s)``, from the group's 32 mask bytes alone: no per-segment offsets. Storage at sparsity ``p``:
``(1 - p) * 2 + 1/8 + 1/64`` bytes per weight (1.14 at 50%, against 2.0 dense). The runtime makes
this layout at load time from the dense weight or from TCA-BME (``sparsekit.runtime.cats_mlp``);
it is never written to disk.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 256      # columns per group (32 lanes x 8 columns)
SEGMENT = 8      # columns per mask byte


@dataclass
class RowPacked:
    masks: torch.Tensor    # uint8 [rows, groups * 32]
    values: torch.Tensor   # fp16 [nnz, padded to a multiple of 4]
    goff: torch.Tensor     # int32 [rows * groups]
    shape: tuple[int, int]

    @property
    def groups(self) -> int:
        return self.masks.shape[1] // 32

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.masks, self.values, self.goff))

    def to(self, device) -> "RowPacked":
        return RowPacked(self.masks.to(device), self.values.to(device), self.goff.to(device), self.shape)


def rowpack(w: torch.Tensor) -> RowPacked:
    """Pack a 2-D fp16 weight ``[rows, cols]`` (on any device; the work stays there)."""
    if w.dim() != 2 or w.dtype != torch.float16:
        raise ValueError(f"rowpack needs a 2-D fp16 weight, got {tuple(w.shape)} {w.dtype}")
    rows, cols = w.shape
    groups = -(-cols // (4 * GROUP)) * 4
    padded = torch.zeros((rows, groups * GROUP), dtype=torch.float16, device=w.device)
    padded[:, :cols] = w
    nz = padded.view(torch.int16) != 0                       # bit patterns: -0.0 is a value
    weights = (1 << torch.arange(SEGMENT, device=w.device, dtype=torch.int32))
    masks = (nz.view(rows, groups * 32, SEGMENT).to(torch.int32) * weights).sum(-1).to(torch.uint8)
    masks = masks.view(rows, groups // 4, 4, 32).transpose(2, 3).reshape(rows, groups * 32)
    counts = nz.view(rows * groups, GROUP).sum(-1, dtype=torch.int64)
    goff = torch.zeros(rows * groups, dtype=torch.int64, device=w.device)
    goff[1:] = torch.cumsum(counts, 0)[:-1]
    flat = padded.reshape(-1)[nz.reshape(-1)]
    values = torch.zeros((-(-max(flat.numel(), 1) // 4) * 4,), dtype=torch.float16, device=w.device)
    values[: flat.numel()] = flat
    if flat.numel() >= 2**31:
        raise ValueError("rowpack: more than 2**31 stored values in one weight")
    return RowPacked(masks, values, goff.to(torch.int32), (rows, cols))


def rowunpack(p: RowPacked) -> torch.Tensor:
    """The dense fp16 weight back, bit-exact."""
    rows, cols = p.shape
    groups = p.groups
    masks = p.masks.view(rows, groups // 4, 32, 4).transpose(2, 3).reshape(rows, groups * 32)
    bits = (masks.to(torch.int32).unsqueeze(-1) >> torch.arange(SEGMENT, device=p.masks.device)) & 1
    nz = bits.reshape(rows, -1).bool()
    out = torch.zeros(nz.shape, dtype=torch.float16, device=p.masks.device)
    out[nz] = p.values[: int(nz.sum())]
    return out[:, :cols].contiguous()
