"""Pruning scores of every linear from one pass of the calibration windows through the dense model.

The statistics are those of the one-shot methods (``sparsekit.pruning.stats``), gathered on the
dense model's activations: Wanda ``|W_ij| * ||X_j||``, SparseGPT ``W_ij^2 / [H^-1]_jj`` (from the
Cholesky factor SparseGPT itself uses), magnitude ``|W_ij|``. They seed the masks that learning starts
from, and rank tiles for ``--allocation global``.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.hf import modules as L
from sparsekit.progress import Progress, report
from sparsekit.pruning.methods import Method
from sparsekit.pruning.methods.sparsegpt import inverse_hessian_cholesky
from sparsekit.pruning.methods.wanda import wanda_scores
from sparsekit.pruning.stats import StatsCollector


@torch.no_grad()
def collect_all_stats(model: nn.Module, linears: dict[str, nn.Module], calib: torch.Tensor, hessian: bool,
                      device: torch.device, batch_size: int, progress: Progress | None = None) -> dict:
    """Input statistics of every linear of ``linears`` over ``calib`` [n, seqlen] (model on ``device``)."""
    collector = StatsCollector(linears, hessian, device)
    spans = list(range(0, calib.shape[0], batch_size))
    try:
        for i, a in enumerate(spans):
            model(input_ids=calib[a:a + batch_size].to(device), use_cache=False)
            if i == 0:
                collector.end_batch()
            report(progress, "scores", i + 1, len(spans))
    finally:
        collector.remove()
    missing = [n for n in linears if n not in collector.stats]
    if missing:
        raise SparsekitError(f"{missing[0]} received no calibration input: add it to --skip")
    return collector.stats


def linear_scores(weight: torch.Tensor, method: Method, stats, percdamp: float,
                  warn: Callable[[str], object]) -> torch.Tensor:
    """float32 scores [out, in] of one weight under ``method``'s criterion."""
    w = weight.detach().float()
    if method.needs_hessian:
        u, _ = inverse_hessian_cholesky(stats.hessian.to(w.device), percdamp, warn)
        return (w / u.diagonal().unsqueeze(0)).square()
    if method.needs_stats:
        return wanda_scores(w, stats.col_sq_sum)
    return w.abs()


def model_scores(model: nn.Module, linears: dict[str, nn.Module], calib: torch.Tensor | None, method: Method,
                 device: torch.device, batch_size: int, percdamp: float, warn: Callable[[str], object],
                 progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """``{name: scores [out, in]}`` for every linear (on ``device``)."""
    stats = {}
    if method.needs_stats:
        stats = collect_all_stats(model, linears, calib, method.needs_hessian, device, batch_size, progress)
    out = {}
    for name, mod in linears.items():
        out[name] = linear_scores(L.weight_out_in(mod), method, stats.get(name), percdamp,
                                  lambda m, _n=name: warn(f"{_n}: {m}"))
    return out
