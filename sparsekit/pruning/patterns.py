"""Sparsity patterns and the score -> keep-mask selection every method shares.

A pattern says which weights may be zeroed together:

- ``unstructured``: any weights, at any sparsity in [0, 1).
- ``N:M``: at most N nonzeros in each group of M consecutive weights along the input dimension
  (so ``2:4`` is 50%, ``1:4`` is 75%). The sparsity is fixed by N and M.
- ``hybrid`` / ``hybrid:T``: the weight is cut into TxT tiles (default T=64); each tile is either
  dense or 2:4. A total sparsity s in [0, 0.5] makes round(s / 0.5 * n_tiles) tiles 2:4, chosen as
  the tiles whose 2:4 pruning removes the least score (PATCH-like).

Masks are *keep*-masks (True = weight stays). Every comparison group prunes exactly
``n_pruned(group_size, s)`` weights: selection is by sort/top-k on the scores, never by a threshold,
so ties cannot change the count. Everything here is vectorized and runs on the scores' device.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from sparsekit.errors import SparsekitError

HYBRID_TILE = 64
HYBRID_MAX_SPARSITY = 0.5
DEFAULT_SPARSITY = 0.5
DEFAULT_HYBRID_SPARSITY = 0.25

_NM = re.compile(r"^(\d+):(\d+)$")
_HYBRID = re.compile(r"^hybrid(?::(\d+))?$")


@dataclass(frozen=True)
class Pattern:
    """A parsed sparsity pattern; build it with :meth:`Pattern.parse`."""

    kind: str  # "unstructured" | "nm" | "hybrid"
    n: int = 0  # N:M (hybrid tiles are always 2:4)
    m: int = 0
    tile: int = 0  # hybrid only

    @classmethod
    def parse(cls, text: "str | Pattern") -> "Pattern":
        if isinstance(text, Pattern):
            return text
        s = str(text).strip().lower()
        if s in ("unstructured", "dense", "u"):
            return cls("unstructured")
        if (mo := _NM.match(s)) is not None:
            n, m = int(mo.group(1)), int(mo.group(2))
            if not 1 <= n < m:
                raise SparsekitError(
                    f"bad N:M pattern '{text}': need 1 <= N < M (N nonzeros kept per M weights), e.g. 2:4 or 4:8"
                )
            return cls("nm", n, m)
        if (mo := _HYBRID.match(s)) is not None:
            t = int(mo.group(1)) if mo.group(1) else HYBRID_TILE
            if t <= 0 or t % 4:
                raise SparsekitError(
                    f"bad hybrid tile size in '{text}': the tile must be a positive multiple of 4, e.g. hybrid:64"
                )
            return cls("hybrid", 2, 4, t)
        raise SparsekitError(
            f"unknown sparsity pattern '{text}': use 'unstructured', 'N:M' (e.g. 2:4, 4:8), 'hybrid' or 'hybrid:T'"
        )

    def __str__(self) -> str:
        if self.kind == "nm":
            return f"{self.n}:{self.m}"
        if self.kind == "hybrid":
            return "hybrid" if self.tile == HYBRID_TILE else f"hybrid:{self.tile}"
        return "unstructured"

    @property
    def is_unstructured(self) -> bool:
        return self.kind == "unstructured"

    @property
    def is_nm(self) -> bool:
        return self.kind == "nm"

    @property
    def is_hybrid(self) -> bool:
        return self.kind == "hybrid"

    @property
    def default_sparsity(self) -> float:
        if self.kind == "nm":
            return 1.0 - self.n / self.m
        if self.kind == "hybrid":
            return DEFAULT_HYBRID_SPARSITY
        return DEFAULT_SPARSITY

    def resolve_sparsity(self, sparsity: "float | None" = None) -> float:
        """The sparsity this pattern prunes to; validates ``sparsity`` (None -> the default)."""
        if sparsity is None:
            return self.default_sparsity
        try:
            if isinstance(sparsity, bool):  # float(True) is 1.0: "sparsity 1 is out of range" was wrong
                raise TypeError
            s = float(sparsity)
        except (TypeError, ValueError):
            raise SparsekitError(f"sparsity must be a number, got {sparsity!r}") from None
        if not math.isfinite(s):
            raise SparsekitError(f"sparsity must be a finite number in [0, 1), got {sparsity!r}")
        if self.kind == "nm":
            implied = 1.0 - self.n / self.m
            if abs(s - implied) > 1e-6:
                raise SparsekitError(
                    f"pattern {self} fixes the sparsity at {implied:g}, got {s:g}: "
                    f"drop --sparsity or pass {implied:g}"
                )
            return implied
        if self.kind == "hybrid":
            if not 0.0 <= s <= HYBRID_MAX_SPARSITY:
                raise SparsekitError(
                    f"sparsity {s:g} is out of range for pattern {self}: use a value in [0, 0.5] "
                    "(0.5 makes every tile 2:4)"
                )
            return s
        if not 0.0 <= s < 1.0:
            raise SparsekitError(f"sparsity {s:g} is out of range: use a value in [0, 1), e.g. 0.5")
        return s

    def check_shape(self, out_features: int, in_features: int) -> None:
        """Raise SparsekitError if a [out, in] weight cannot take this pattern."""
        if self.kind == "nm" and in_features % self.m:
            raise SparsekitError(
                f"pattern {self} needs in_features divisible by {self.m}, got a [{out_features}, {in_features}] "
                "weight: skip this layer (--skip) or use an unstructured pattern"
            )
        if self.kind == "hybrid" and (in_features % self.tile or out_features % self.tile):
            raise SparsekitError(
                f"pattern {self} needs both weight dims divisible by the tile size {self.tile}, got "
                f"[{out_features}, {in_features}]: pick hybrid:T with T a multiple of 4 dividing both, "
                "or skip this layer (--skip)"
            )


def n_pruned(group_size: int, sparsity: float) -> int:
    """How many weights a comparison group of ``group_size`` prunes: floor(group_size * sparsity).

    A tiny epsilon keeps decimal ratios exact (0.29 * 100 is 28.999... in binary floating point).
    """
    return min(group_size, int(math.floor(group_size * sparsity + 1e-6)))


def _drop_lowest(scores: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    """Keep-mask that drops exactly the k lowest scores along ``dim``."""
    keep = torch.ones_like(scores, dtype=torch.bool)
    if k > 0:
        idx = torch.topk(scores, k, dim=dim, largest=False, sorted=False).indices
        keep.scatter_(dim, idx, False)
    return keep


def unstructured_mask(scores: torch.Tensor, sparsity: float, group: str = "row") -> torch.Tensor:
    """Keep-mask pruning exactly floor(group_size * sparsity) lowest scores per group.

    ``group="row"``: each output row is a group (Wanda). ``group="layer"``: the whole matrix is one
    group (magnitude).
    """
    if group == "row":
        return _drop_lowest(scores, n_pruned(scores.shape[-1], sparsity), dim=-1)
    if group == "layer":
        flat = scores.reshape(-1)
        return _drop_lowest(flat, n_pruned(flat.numel(), sparsity), dim=0).reshape(scores.shape)
    raise ValueError(f"unknown comparison group {group!r}")


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep-mask with exactly ``n`` kept (the largest scores) in each group of ``m`` consecutive inputs."""
    rows, cols = scores.shape
    if cols % m:
        raise SparsekitError(f"{n}:{m} needs in_features divisible by {m}, got {cols}")
    grouped = scores.reshape(rows, cols // m, m)
    return _drop_lowest(grouped, m - n, dim=-1).reshape(rows, cols)


def tile_sums(x: torch.Tensor, tile: int) -> torch.Tensor:
    """Sum ``x`` [R, C] over TxT tiles -> [R/T, C/T]."""
    r, c = x.shape
    return x.reshape(r // tile, tile, c // tile, tile).sum(dim=(1, 3))


def expand_tiles(tiles: torch.Tensor, tile: int) -> torch.Tensor:
    """Per-tile values [R/T, C/T] -> per-element [R, C]."""
    return tiles.repeat_interleave(tile, dim=0).repeat_interleave(tile, dim=1)


def n_sparse_tiles(n_tiles: int, sparsity: float) -> int:
    """round(s / 0.5 * n_tiles), rounding halves up."""
    return min(n_tiles, int(math.floor(sparsity / HYBRID_MAX_SPARSITY * n_tiles + 0.5 + 1e-9)))


def hybrid_sparse_tiles(scores: torch.Tensor, sparsity: float, tile: int) -> torch.Tensor:
    """Bool [R/T, C/T]: which tiles become 2:4, the ones whose 2:4 pruning removes the least score."""
    removed = tile_sums(scores * ~nm_mask(scores, 2, 4), tile)
    k = n_sparse_tiles(removed.numel(), sparsity)
    flat = torch.zeros(removed.numel(), dtype=torch.bool, device=scores.device)
    if k > 0:
        flat[torch.topk(removed.reshape(-1), k, largest=False, sorted=False).indices] = True
    return flat.reshape(removed.shape)


def hybrid_mask(scores: torch.Tensor, sparsity: float, tile: int) -> torch.Tensor:
    """Keep-mask: 2:4 inside the chosen tiles (see :func:`hybrid_sparse_tiles`), dense elsewhere."""
    sparse = expand_tiles(hybrid_sparse_tiles(scores, sparsity, tile), tile)
    return nm_mask(scores, 2, 4) | ~sparse


def select_mask(scores: torch.Tensor, pattern: Pattern, sparsity: float, group: str = "row") -> torch.Tensor:
    """Keep-mask for ``scores`` [out, in] under ``pattern`` at ``sparsity`` (already resolved)."""
    if pattern.is_nm:
        return nm_mask(scores, pattern.n, pattern.m)
    if pattern.is_hybrid:
        return hybrid_mask(scores, sparsity, pattern.tile)
    return unstructured_mask(scores, sparsity, group)
