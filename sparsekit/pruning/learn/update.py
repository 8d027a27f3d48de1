"""The SparseGPT weight update on a mask that is already chosen (a learned or globally allocated one).

``KeptMaskSparseGPT`` is a ``Method`` for the layer-sequential engine: it gathers the same input
Hessians as SparseGPT (on the inputs of the already-updated layers before it) and runs SparseGPT's
OBS sweep with the mask fixed to the weights that are nonzero: the zeroed weights stay zero, the
others absorb the error. The engine and its layer offload are reused unchanged.
"""
from __future__ import annotations

from sparsekit.errors import SparsekitError
from sparsekit.pruning.methods.base import Method, Observes, PruneResult
from sparsekit.pruning.methods.sparsegpt import sparsegpt_prune
from sparsekit.pruning.patterns import Pattern

UNSTRUCTURED = Pattern("unstructured")


class KeptMaskSparseGPT(Method):
    name = "sparsegpt-update"
    observes = Observes.HESSIAN
    progress_stage = "update"

    def prune(self, weight, sparsity, pattern, stats, *, blocksize, percdamp, warn) -> PruneResult:
        if getattr(stats, "hessian", None) is None:
            raise SparsekitError("the SparseGPT update needs the input Hessian")
        keep = weight != 0
        new_w, _, info = sparsegpt_prune(weight, stats.hessian, 0.0, UNSTRUCTURED, blocksize=blocksize,
                                         percdamp=percdamp, warn=warn, keep=keep)
        return PruneResult(new_w.masked_fill(~keep, 0), keep, info)


def sparsegpt_update(model, calib, *, skip, device, blocksize: int, percdamp: float, batch_size, progress, warn) -> dict:
    """Update the weights of ``model`` (on the CPU) for the masks its zeros spell; the engine's report."""
    from sparsekit.pruning.engine import prune_model

    return prune_model(model, calib, method=KeptMaskSparseGPT(), sparsity=0.0, pattern=UNSTRUCTURED, skip=skip,
                       device=device, blocksize=blocksize, percdamp=percdamp, batch_size=batch_size,
                       progress=progress, warn=warn)
