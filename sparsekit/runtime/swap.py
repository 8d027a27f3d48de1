"""Swapping whole models between dense and packed linears, in place.

``sparsify`` encodes the pruned linears of a model already in memory (benchmarks, tests, and
``sparsekit eval --speed`` on an unpacked checkpoint); ``densify`` decodes every ``SparseLinear``
back into an ``nn.Linear`` (the dense twin ``eval --speed`` compares against). Packed
checkpoints are loaded with ``sparsekit.runtime.loader``.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from sparsekit.packed.gain import worth_packing
from sparsekit.hf.modules import find_decoder_layers, find_linears, set_submodule, weight_out_in
from sparsekit.progress import Progress, report
from sparsekit.runtime.sparse_linear import SparseLinear, release_kernel_caches


def sparsify(model: nn.Module, *, min_sparsity: float | None = None, skip: Iterable[str] = ("lm_head",),
             dtype: torch.dtype | None = None, progress: Progress | None = None) -> list[str]:
    """Replace, in place, every linear of the decoder stack that packing gains for (the rule of
    ``encode``, ``sparsekit.packed.gain.worth_packing``; or, given ``min_sparsity``, whose zero
    fraction is at least that) by a SparseLinear encoded on the layer's device. Returns the swapped names.

    ``progress("sparsify", done, total)`` is called after each linear looked at.
    """
    stack_name, stack = find_decoder_layers(model)
    linears = find_linears(stack, prefix=stack_name, skip=skip)
    swapped = []
    for done, (name, mod) in enumerate(linears.items(), 1):
        w = weight_out_in(mod)
        if min_sparsity is None:
            gains = worth_packing(w)[0]
        else:
            gains = 1.0 - float(torch.count_nonzero(w)) / max(1, w.numel()) >= min_sparsity
        if gains:
            set_submodule(model, name, SparseLinear.from_linear(mod, dtype=dtype))
            swapped.append(name)
        del mod, w
        report(progress, "sparsify", done, len(linears))
    return swapped


def densify(model: nn.Module, dtype: torch.dtype | None = None) -> list[str]:
    """Replace, in place, every SparseLinear by the equivalent ``nn.Linear`` (decoded weight).

    ``dtype`` defaults to the dtype of the model's dense parameters (embeddings, norms).
    """
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    names = [n for n, m in model.named_modules() if isinstance(m, SparseLinear)]
    for name in names:
        sl = model.get_submodule(name)
        set_submodule(model, name, sl.to_linear(dtype))
        del sl
    release_kernel_caches()
    return names
