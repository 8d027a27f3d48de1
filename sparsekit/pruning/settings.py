"""``PruneSettings``: the resolved, validated settings of one ``sparsekit prune`` run.

Built by ``sparsekit.pruning.recipes.resolve_settings`` (defaults < recipe < arguments); the report's
``settings`` entry is :meth:`PruneSettings.as_dict`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class PruneSettings:
    method: str  # a name of sparsekit.pruning.methods.METHODS
    pattern: str  # canonical pattern text: unstructured, N:M, hybrid[:T]
    sparsity: float  # resolved: the pattern's default when none was given
    dataset: str  # calibration text
    nsamples: int  # calibration windows
    seqlen: int  # tokens per window (prune() caps it to the model context)
    seed: int
    skip: list[str]  # module-name patterns left dense (lm_head included unless prune_lm_head)
    prune_lm_head: bool
    blocksize: int  # SparseGPT column block size
    damp: float  # SparseGPT dampening, fraction of the mean Hessian diagonal
    cats: float | None = None  # CATS activation sparsity stacked on a weight method (--cats), or None
    allocation: str = "layer"  # per linear ("layer"), hybrid tiles ranked over the model ("global"), or per-layer OWL ("owl")
    owl_lambda: float = 0.08  # OWL: the spread of the per-layer sparsities (target +- lambda)
    owl_m: float = 5.0  # OWL: outlier threshold, in multiples of the layer's mean Wanda score
    owl_windows: int | None = 16  # OWL: calibration windows of the outlier scan (None: all)
    update: str | None = None  # weight update on the method's mask: None (the method's own) or "admm"
    admm_iters: int = 20  # ADMM iterations (--update admm, --method admm)
    refine: str | None = None  # mask refinement after the method: None or "dsnot"
    dsnot_cycles: int = 50  # DSnoT: at most this many prune-and-regrow swaps per row
    recipe: str | None = None  # the recipe file, if one was used

    def as_dict(self) -> dict[str, Any]:
        """The settings as a plain dict, in field order; ``recipe`` only when one was used."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["recipe"] is None:
            del out["recipe"]
        out["skip"] = list(out["skip"])
        return out

    def ignored_calibration(self, **given: Any) -> str | None:
        """A note when calibration settings were passed explicitly (``given``: name -> value, None
        when not passed) to a method that reads no calibration data (magnitude), else None."""
        from sparsekit.pruning.methods import METHODS

        names = [name for name, value in given.items() if value is not None]
        uses = self.cats is not None or self.allocation == "owl" or self.update is not None or self.refine is not None
        if not names or METHODS[self.method].needs_calibration or uses:
            return None
        return (f"method {self.method} uses no calibration data: {', '.join(names)} "
                f"{'is' if len(names) == 1 else 'are'} ignored")
