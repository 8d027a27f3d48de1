"""A weight method followed by optional steps on its result: DSnoT mask refinement, then an ADMM
weight update on the final mask (``--refine dsnot``, ``--update admm``).

:func:`with_steps` wraps a ``Method`` into one that the engine drives like any other: it observes the
input Hessian (both steps need it, whatever the base method observes), prunes with the base method,
then refines the mask (``dsnot.dsnot_refine``) and recomputes the kept weights from the dense ones
(``admm.admm_prune`` with the mask fixed). The name, checks and metadata stay the base method's.
"""
from __future__ import annotations

from sparsekit.errors import SparsekitError
from sparsekit.pruning.methods.base import Method, Observes, PruneResult


class WithSteps(Method):
    observes = Observes.HESSIAN

    def __init__(self, base: Method, update: str | None, admm_iters: int, refine: str | None, dsnot_cycles: int):
        self.base, self.update, self.admm_iters, self.refine, self.dsnot_cycles = base, update, admm_iters, refine, dsnot_cycles
        self.name = base.name
        self.changes_weights = base.changes_weights
        self.report_key, self.progress_stage = base.report_key, base.progress_stage

    def check_pattern(self, pattern) -> None:
        self.base.check_pattern(pattern)

    def check_model(self, model, skip) -> None:
        self.base.check_model(model, skip)

    def skip_targets(self, model) -> list[str]:
        return self.base.skip_targets(model)

    def metadata(self, report: dict, sparsity: float) -> dict:
        return self.base.metadata(report, sparsity)

    def prune(self, weight, sparsity, pattern, stats, *, blocksize, percdamp, warn) -> PruneResult:
        from sparsekit.pruning.methods.admm import admm_prune
        from sparsekit.pruning.methods.dsnot import dsnot_refine

        if getattr(stats, "hessian", None) is None:
            raise SparsekitError(f"--update / --refine need the input Hessian: gather stats with InputStats(..., hessian=True)")
        res = self.base.prune(weight, sparsity, pattern, stats, blocksize=blocksize, percdamp=percdamp, warn=warn)
        new_w, keep, info = res.weight, res.mask, dict(res.info)
        if self.refine == "dsnot":
            new_w, keep, rinfo = dsnot_refine(weight, new_w, keep, stats.hessian, pattern, cycles=self.dsnot_cycles)
            info.update(rinfo)
        if self.update == "admm":
            new_w, keep, uinfo = admm_prune(weight, stats.hessian, sparsity, pattern, keep=keep, iters=self.admm_iters,
                                            init=new_w)
            info.update(uinfo)
        return PruneResult(new_w, keep, info)


def with_steps(method: Method, *, update: str | None = None, admm_iters: int = 20, refine: str | None = None,
               dsnot_cycles: int = 50) -> Method:
    """``method`` itself when no step is asked for, else a ``WithSteps`` around it (a method with its
    own iteration count, ``--method admm``, gets ``admm_iters``)."""
    if hasattr(method, "with_iters"):
        method = method.with_iters(admm_iters)
    if update is None and refine is None:
        return method
    return WithSteps(method, update, admm_iters, refine, dsnot_cycles)
