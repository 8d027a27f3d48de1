"""Which tiles become 2:4: ``layer`` allocation (every linear at the target sparsity) or ``global``
(one ranking over the tiles of all pruned linears, so that sensitive linears stay denser).

A unit (one linear for ``layer``, the whole model for ``global``) makes ``n_sparse_tiles(n, s)`` of
its ``n`` tiles 2:4: those with the highest *preference*. One-shot, the preference is minus the
tile's cost, the score that 2:4 pruning removes from it; for ``global`` that cost is divided by the
linear's mean score per tile, so costs compare across linears whose score scales differ. While
learning, the preference is the tile logit plus noise.
"""
from __future__ import annotations

import torch

from sparsekit.errors import SparsekitError
from sparsekit.pruning.patterns import n_sparse_tiles, nm_mask, tile_sums

ALLOCATIONS = ("layer", "global", "owl")


def check_allocation(allocation: str) -> str:
    a = str(allocation).strip().lower()
    if a not in ALLOCATIONS:
        raise SparsekitError(f"unknown allocation {allocation!r}: use 'layer' (every linear at the target), "
                             "'global' (one ranking of the tiles of the whole model) or 'owl' (per-layer sparsity "
                             "from the layer's outliers)")
    return a


def tile_costs(scores: torch.Tensor, tile: int, normalize: bool) -> torch.Tensor:
    """[R/T, C/T]: the score 2:4 pruning removes from each tile (relative to the mean tile score
    of this linear when ``normalize``)."""
    removed = tile_sums(scores * ~nm_mask(scores, 2, 4), tile)
    if not normalize:
        return removed
    mean = tile_sums(scores, tile).mean().clamp_min(torch.finfo(scores.dtype).tiny)
    return removed / mean


def select_tiles(pref: dict[str, torch.Tensor], sparsity: float, allocation: str
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The tiles of highest preference, per unit: ``(sparse, threshold)`` per linear name.

    ``sparse[name]`` is a bool [R/T, C/T]; ``threshold[name]`` a 0-d tensor halfway between the
    lowest chosen and the highest unchosen preference of the linear's unit (where the relaxed tile
    indicator is 1/2).
    """
    units = {n: [n] for n in pref} if allocation == "layer" else {"*": list(pref)}
    sparse, thresh = {}, {}
    for names in units.values():
        flat = torch.cat([pref[n].detach().reshape(-1) for n in names])
        k = n_sparse_tiles(flat.numel(), sparsity)
        chosen = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        if k:
            chosen[torch.topk(flat, k, sorted=False).indices] = True
        lo = flat[chosen].min() if k else flat.max() + 1
        hi = flat[~chosen].max() if k < flat.numel() else flat.min() - 1
        t = (lo + hi) / 2
        at = 0
        for n in names:
            size = pref[n].numel()
            sparse[n] = chosen[at:at + size].reshape(pref[n].shape)
            thresh[n] = t
            at += size
    return sparse, thresh
