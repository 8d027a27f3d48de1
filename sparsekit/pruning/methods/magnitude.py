"""Magnitude pruning: score |W|; for unstructured sparsity the whole layer is one comparison group
(the magnitude baseline of the Wanda paper); N:M and hybrid groups are as in ``patterns``."""
from __future__ import annotations

import torch

from sparsekit.pruning.methods.base import Method, Observes, PruneResult
from sparsekit.pruning.patterns import Pattern, select_mask


def magnitude_scores(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().float().abs()


def magnitude_mask(weight: torch.Tensor, sparsity: float, pattern: Pattern) -> torch.Tensor:
    """Keep-mask [out, in] for ``weight`` [out, in] at a resolved ``sparsity``."""
    return select_mask(magnitude_scores(weight), pattern, sparsity, group="layer")


class Magnitude(Method):
    """No calibration data; the only method that may prune linears outside the decoder stack."""

    name = "magnitude"
    observes = Observes.NOTHING

    def prune(self, weight, sparsity, pattern, stats, *, blocksize, percdamp, warn) -> PruneResult:
        keep = magnitude_mask(weight, sparsity, pattern)
        return PruneResult(weight.detach().masked_fill(~keep, 0), keep)
