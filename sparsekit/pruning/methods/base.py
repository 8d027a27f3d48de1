"""What a pruning method is to the rest of sparsekit: the ``Method`` base class.

A method says what it observes while the calibration windows run through the model
(:class:`Observes`), and so whether it needs calibration data at all; whether it changes weights;
and how it does its work on one decoder layer at a time:

- a method that changes weights prunes one linear's [out, in] weight given that linear's input
  statistics (:meth:`Method.prune`, wrapped by ``sparsekit.pruning.methods.prune_weight``);
- a method that changes no weight (CATS) calibrates a whole decoder layer instead
  (:meth:`Method.calibrate_layer`) and reports per module under :attr:`Method.report_key`.

The engine and ``prune()`` only ever ask these attributes, never a method's name.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


class Observes(enum.Enum):
    """What a method records from the calibration activations."""

    NOTHING = "nothing"  # the weights alone (no calibration data)
    INPUT_COLUMNS = "input column statistics"  # per input feature, sum of x_j^2 over the tokens
    HESSIAN = "input Hessian"  # the column statistics plus 2/n sum x x^T
    GATED_MLP_ACTIVATIONS = "gated-MLP activations"  # |act(gate(x))| of each gated MLP


@dataclass
class PruneResult:
    weight: torch.Tensor  # pruned weight [out, in], in the input dtype
    mask: torch.Tensor  # bool keep-mask [out, in]
    info: dict = field(default_factory=dict)


class Method:
    """One pruning method; subclasses set the class attributes and override what applies."""

    name: str = ""
    observes: Observes = Observes.NOTHING
    changes_weights: bool = True
    report_key: str | None = None  # engine report / sparsekit.json entry of calibrate_layer's reports
    progress_stage: str = "layers"  # the stage its layer loop reports to ``progress``

    @property
    def needs_calibration(self) -> bool:
        """Whether calibration data runs through the model (all but methods that observe nothing)."""
        return self.observes is not Observes.NOTHING

    @property
    def needs_stats(self) -> bool:
        """Whether each pruned linear needs an ``InputStats`` of its inputs."""
        return self.observes in (Observes.INPUT_COLUMNS, Observes.HESSIAN)

    @property
    def needs_hessian(self) -> bool:
        """Whether those statistics include the Hessian (``InputStats(..., hessian=True)``)."""
        return self.observes is Observes.HESSIAN

    def check_pattern(self, pattern) -> None:
        """Refuse a sparsity pattern (a parsed ``Pattern``) that does not apply to this method."""

    def check_model(self, model: nn.Module, skip) -> None:
        """Refuse a model this method cannot run on (before any calibration data is read)."""

    def skip_targets(self, model: nn.Module) -> list[str]:
        """Module names a --skip pattern can name for this method (a pattern matching none is a typo)."""
        from sparsekit.hf.modules import find_linears

        return list(find_linears(model))

    def prune(self, weight: torch.Tensor, sparsity: float, pattern, stats, *, blocksize: int, percdamp: float,
              warn: Callable[[str], object]) -> PruneResult:
        """Prune ``weight`` [out, in] at a resolved ``sparsity``: the new weight (any float dtype),
        the keep-mask and the method's extra ``info``. Checks of shape, pattern and stats presence
        are done by ``prune_weight`` before."""
        raise NotImplementedError(f"{self.name} changes no weight")

    def calibrate_layer(self, layer: nn.Module, prefix: str, acts, *, sparsity: float, skip: list[str],
                        seed: int, sample_size: int | None, write: bool) -> dict[str, dict]:
        """Calibrate decoder layer ``layer`` (named ``prefix``) on the captured activations ``acts``
        (a ``sparsekit.pruning.capture.Activations``); with ``write``, its outputs replace ``acts``
        as the next layer's inputs. Returns per-module reports (methods that change no weight)."""
        raise NotImplementedError(f"{self.name} prunes weights, it calibrates no layer")

    def metadata(self, report: dict, sparsity: float) -> dict:
        """Extra ``sparsekit.json`` entries (keyword arguments of ``build_metadata``) from the engine report."""
        return {}
