"""OWL: outlier-weighted layerwise sparsity (Yin et al., ICML 2024), the math.

Each decoder layer ``i`` gets its own sparsity from its share of *outliers*: the weights whose Wanda
score ``|W_jk| * ||X_k||_2`` (``X_k``: input feature k over the calibration tokens of the dense model)
exceeds ``M`` times the mean score of all the layer's pruned linears together. With ``D_i`` the
outlier ratio of layer ``i`` (in percent), the paper maps the ratios linearly onto ``[0, 2*lambda]``
and subtracts them from the target, centred so that the global sparsity is kept::

    r_i = 2 * lambda * (D_i - min D) / (max D - min D)
    s_i = s - (r_i - mean(r))

so layers rich in outliers are pruned less, and every s_i lies within ``s +- lambda``. Here the mean
is weighted by each layer's number of pruned weights (the paper's plain mean when all layers are
the same size, as in a Llama stack), so that the global sparsity, counted over weights, is ``s``.
Where a layer's sparsity would leave ``[0, hi]`` (e.g. hybrid caps at 0.5) it is clipped and the
shift ``c`` in ``s_i = clip(s - r_i + c)`` is re-solved so that the weighted mean is still ``s``.

:class:`Allotment` turns the per-layer targets into per-linear ones while the layers are pruned,
carrying each linear's rounding (per-row counts are whole numbers) into the next one, so the
global sparsity ends within a row of the target whatever the shapes.

The paper's defaults (its LLaMA scripts): ``lambda = 0.08``, ``M = 5``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from sparsekit.errors import SparsekitError

DEFAULT_LAMBDA = 0.08
DEFAULT_M = 5.0
DEFAULT_WINDOWS = 16  # calibration windows the outlier scan reads (the dense model's statistics)


@dataclass(frozen=True)
class OwlSettings:
    """OWL's knobs: ``lam`` (lambda, the spread: sparsities lie within target +- lam), ``m`` (M, the
    outlier threshold in multiples of the layer's mean score) and ``windows`` (how many of the
    calibration windows the outlier scan of the dense model reads; None: all of them)."""

    lam: float = DEFAULT_LAMBDA
    m: float = DEFAULT_M
    windows: int | None = DEFAULT_WINDOWS

    def check(self) -> "OwlSettings":
        try:
            lam, m = float(self.lam), float(self.m)
        except (TypeError, ValueError):
            raise SparsekitError(f"OWL lambda and M must be numbers, got {self.lam!r} and {self.m!r}") from None
        if not 0.0 <= lam < 0.5:
            raise SparsekitError(f"OWL lambda {lam:g} is out of range: use a value in [0, 0.5), e.g. {DEFAULT_LAMBDA}")
        if not m > 0:
            raise SparsekitError(f"OWL M {m:g} must be positive (the outlier threshold in multiples of the mean score), e.g. {DEFAULT_M:g}")
        w = self.windows
        if w is not None:
            if isinstance(w, bool) or int(w) != w or w < 1:
                raise SparsekitError(f"OWL windows must be a positive number of calibration windows, got {w!r}")
            w = int(w)
        return OwlSettings(lam, m, w)

    def as_dict(self) -> dict:
        return {"lambda": self.lam, "m": self.m, "windows": self.windows}


def outlier_ratio(scores: Iterable[torch.Tensor], m: float) -> float:
    """Percent of all entries of ``scores`` (the layer's score matrices, taken together) above ``m``
    times their common mean."""
    scores = list(scores)
    total = sum(s.numel() for s in scores)
    if not total:
        return 0.0
    mean = sum(float(s.sum(dtype=torch.float64)) for s in scores) / total   # no float64 copy of the scores
    above = sum(int((s > m * mean).sum()) for s in scores)
    return 100.0 * above / total


def owl_sparsities(ratios: Sequence[float], sparsity: float, lam: float, params: Sequence[int] | None = None,
                   hi: float = 1.0) -> list[float]:
    """Per-layer sparsities from the outlier ratios (module doc); ``params`` weights the mean (default:
    equal layers), ``hi`` caps each layer (its pattern's maximum). The weighted mean is ``sparsity``."""
    d = torch.tensor([float(x) for x in ratios], dtype=torch.float64)
    n = torch.tensor([float(x) for x in params] if params is not None else [1.0] * len(d), dtype=torch.float64)
    if len(d) == 0:
        return []
    if n.sum() <= 0:
        return [float(sparsity)] * len(d)
    spread = float(d.max() - d.min())
    r = 2 * lam * (d - d.min()) / spread if spread > 0 else torch.zeros_like(d)
    c = float((n * r).sum() / n.sum())
    s = sparsity - r + c
    if bool((s >= 0).all()) and bool((s <= hi).all()):
        return s.tolist()
    lo_c, hi_c = -1.0 - 2 * lam - hi, 1.0 + 2 * lam + hi  # the weighted mean of clip(s - r + c) grows with c

    def mean_at(c: float) -> float:
        return float((n * (sparsity - r + c).clamp(0.0, hi)).sum() / n.sum())

    for _ in range(200):
        mid = (lo_c + hi_c) / 2
        if mean_at(mid) < sparsity:
            lo_c = mid
        else:
            hi_c = mid
    return (sparsity - r + (lo_c + hi_c) / 2).clamp(0.0, hi).tolist()


class Allotment:
    """Per-linear sparsities that add up to the per-layer targets over the whole model.

    :meth:`take` gives a linear the sparsity that brings the pruned count up to date: the targets of
    the layers so far (``layer_targets[i] * n`` for each linear of ``n`` weights) minus what was
    really pruned before (:meth:`record`), clipped to ``[0, hi]``."""

    def __init__(self, layer_targets: Sequence[float], hi: float):
        self.targets, self.hi = list(layer_targets), hi
        self.want = 0.0  # weights the targets asked for so far
        self.done = 0.0  # weights really pruned so far

    def take(self, layer: int, numel: int) -> float:
        self.want += self.targets[layer] * numel
        return min(self.hi, max(0.0, (self.want - self.done) / numel)) if numel else 0.0

    def record(self, zeros: float) -> None:
        self.done += zeros
