"""The pruning methods of ``sparsekit prune``: the table ``METHODS`` and ``prune_weight``.

Each method is a ``Method`` (``base.py``) in its own file: magnitude, wanda, sparsegpt, admm prune weights;
cats changes none (it thresholds the gate activations of gated MLPs). ``METHODS`` maps each name
to its instance (adding a method: a new file and one line here); ``WEIGHT_METHODS`` names those that
prune weights. ``prune_weight`` is the math on a single [out, in] weight matrix, on the weight's
device; the model plumbing (which layers, where the statistics come from) is ``sparsekit.pruning.engine``.
"""
from __future__ import annotations

from typing import Callable

import torch

from sparsekit.errors import SparsekitError
from sparsekit.pruning.methods.admm import Admm
from sparsekit.pruning.methods.base import Method, Observes, PruneResult
from sparsekit.pruning.methods.cats import Cats
from sparsekit.pruning.methods.magnitude import Magnitude
from sparsekit.pruning.methods.sparsegpt import SparseGPT
from sparsekit.pruning.methods.wanda import Wanda
from sparsekit.pruning.patterns import Pattern, tile_sums

METHODS: dict[str, Method] = {m.name: m for m in (Magnitude(), Wanda(), SparseGPT(), Admm(), Cats())}
WEIGHT_METHODS = tuple(name for name, m in METHODS.items() if m.changes_weights)

__all__ = ["METHODS", "WEIGHT_METHODS", "Method", "Observes", "PruneResult", "get_method", "prune_weight"]


def get_method(method: "str | Method") -> Method:
    """The ``Method`` called ``method`` (a ``Method`` is returned as it is)."""
    if isinstance(method, Method):
        return method
    if method not in METHODS:
        raise SparsekitError(f"unknown pruning method '{method}': use one of {', '.join(METHODS)}")
    return METHODS[method]


def prune_weight(
    weight: torch.Tensor,
    method: "str | Method",
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
    m = get_method(method)
    if not m.changes_weights:
        raise SparsekitError(f"method '{m.name}' changes no weight: it runs on whole models (sparsekit.prune(..., method='{m.name}'))")
    pattern = Pattern.parse(pattern)
    s = pattern.resolve_sparsity(sparsity)
    if weight.dim() != 2:
        raise SparsekitError(f"expected a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    pattern.check_shape(out_f, in_f)
    if m.needs_stats and stats is None:
        raise SparsekitError(f"method '{m.name}' needs calibration statistics: pass stats=InputStats(...)")

    res = m.prune(weight, s, pattern, stats, blocksize=blocksize, percdamp=percdamp, warn=warn)
    info: dict = {"method": m.name, "pattern": str(pattern), "target": s, **res.info}
    new_w, keep = res.weight.to(weight.dtype), res.mask
    if pattern.is_hybrid:
        t = pattern.tile
        info["tiles"] = (out_f // t) * (in_f // t)
        if "sparse_tiles" not in info:
            info["sparse_tiles"] = int((tile_sums((~keep).float(), t) > 0).sum().item())
    info["sparsity"] = float((new_w == 0).sum().item()) / max(1, new_w.numel())
    return PruneResult(new_w, keep, info)
