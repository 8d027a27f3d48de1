"""One entry point for the pruning methods: ``prune_weight(weight, method, sparsity, pattern, stats)``.

The model plumbing (which layers, where the statistics come from) lives in ``sparsekit.pruning.engine``;
here is only the math on a single [out, in] weight matrix, on the weight's device.

``METHODS`` lists every method of ``sparsekit prune``; ``WEIGHT_METHODS`` those that prune weights.
CATS (``sparsekit.pruning.methods.cats``) changes no weight: it thresholds the gate activations of gated MLPs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from sparsekit.errors import SparsekitError
from sparsekit.pruning.patterns import Pattern

WEIGHT_METHODS = ("magnitude", "wanda", "sparsegpt")
METHODS = WEIGHT_METHODS + ("cats",)


@dataclass
class PruneResult:
    weight: torch.Tensor  # pruned weight [out, in], in the input dtype
    mask: torch.Tensor  # bool keep-mask [out, in]
    info: dict = field(default_factory=dict)


def _check_method(method: str) -> str:
    if method not in METHODS:
        raise SparsekitError(f"unknown pruning method '{method}': use one of {', '.join(METHODS)}")
    return method


def needs_calibration(method: str) -> bool:
    """Whether the method runs calibration data through the model (all but magnitude)."""
    return _check_method(method) != "magnitude"


def needs_stats(method: str) -> bool:
    """Whether the method needs calibration statistics (an ``InputStats``)."""
    return _check_method(method) in ("wanda", "sparsegpt")


def needs_hessian(method: str) -> bool:
    """Whether the statistics must include the Hessian (``InputStats(..., hessian=True)``)."""
    return _check_method(method) == "sparsegpt"


def prune_weight(
    weight: torch.Tensor,
    method: str,
    sparsity: "float | None",
    pattern: "Pattern | str",
    stats=None,
    *,
    blocksize: int = 128,
    percdamp: float = 0.01,
    warn: Callable[[str], object] = print,
) -> PruneResult:
    """Prune one weight [out, in]; returns the pruned weight (input dtype), keep-mask and info.

    ``info`` holds ``method``, ``pattern``, ``target`` (the requested sparsity), ``sparsity`` (the
    fraction of zeros in the returned weight) and method extras (SparseGPT: ``damp``, ``dead``,
    ``loss``, ``blocksize``; hybrid: ``sparse_tiles``, ``tiles``).
    """
    if _check_method(method) not in WEIGHT_METHODS:
        raise SparsekitError(f"method '{method}' changes no weight: it runs on whole models (sparsekit.prune(..., method='{method}'))")
    pattern = Pattern.parse(pattern)
    s = pattern.resolve_sparsity(sparsity)
    if weight.dim() != 2:
        raise SparsekitError(f"expected a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    pattern.check_shape(out_f, in_f)
    if needs_stats(method) and stats is None:
        raise SparsekitError(f"method '{method}' needs calibration statistics: pass stats=InputStats(...)")

    info: dict = {"method": method, "pattern": str(pattern), "target": s}
    if method == "sparsegpt":
        from sparsekit.pruning.methods.sparsegpt import sparsegpt_prune

        if getattr(stats, "hessian", None) is None:
            raise SparsekitError("sparsegpt needs the input Hessian: gather stats with InputStats(..., hessian=True)")
        new_w, keep, extra = sparsegpt_prune(
            weight, stats.hessian, s, pattern, blocksize=blocksize, percdamp=percdamp, warn=warn
        )
        info.update(extra)
    else:
        if method == "magnitude":
            from sparsekit.pruning.methods.magnitude import magnitude_mask

            keep = magnitude_mask(weight, s, pattern)
        else:
            from sparsekit.pruning.methods.wanda import wanda_mask

            keep = wanda_mask(weight, stats.col_sq_sum, s, pattern)
        new_w = weight.detach().masked_fill(~keep, 0)
    new_w = new_w.to(weight.dtype)
    if pattern.is_hybrid:
        t = pattern.tile
        info["tiles"] = (out_f // t) * (in_f // t)
        if "sparse_tiles" not in info:
            from sparsekit.pruning.patterns import tile_sums

            info["sparse_tiles"] = int((tile_sums((~keep).float(), t) > 0).sum().item())
    info["sparsity"] = float((new_w == 0).sum().item()) / max(1, new_w.numel())
    return PruneResult(new_w, keep, info)
