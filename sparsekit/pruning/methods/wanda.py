"""Wanda (Sun et al., 2023): score |W_ij| * ||X_j||_2 with X_j the j-th input feature over all
calibration tokens; for unstructured sparsity each output row is one comparison group."""
from __future__ import annotations

import torch

from sparsekit.errors import SparsekitError
from sparsekit.pruning.methods.base import Method, Observes, PruneResult
from sparsekit.pruning.patterns import Pattern, select_mask


def wanda_scores(weight: torch.Tensor, col_sq_sum: torch.Tensor) -> torch.Tensor:
    if col_sq_sum.shape != (weight.shape[1],):
        raise SparsekitError(
            f"wanda statistics have {tuple(col_sq_sum.shape)} features but the weight is {tuple(weight.shape)}: "
            "gather the statistics on this layer's inputs"
        )
    norms = col_sq_sum.detach().to(device=weight.device, dtype=torch.float32).clamp_min(0).sqrt()
    return weight.detach().float().abs() * norms.unsqueeze(0)


def wanda_mask(weight: torch.Tensor, col_sq_sum: torch.Tensor, sparsity: float, pattern: Pattern) -> torch.Tensor:
    """Keep-mask [out, in] for ``weight`` [out, in] at a resolved ``sparsity``."""
    return select_mask(wanda_scores(weight, col_sq_sum), pattern, sparsity, group="row")


class Wanda(Method):
    name = "wanda"
    observes = Observes.INPUT_COLUMNS

    def prune(self, weight, sparsity, pattern, stats, *, blocksize, percdamp, warn) -> PruneResult:
        keep = wanda_mask(weight, stats.col_sq_sum, sparsity, pattern)
        return PruneResult(weight.detach().masked_fill(~keep, 0), keep)
