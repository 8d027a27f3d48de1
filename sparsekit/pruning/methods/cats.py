"""CATS (Lee et al. 2024): one activation threshold per gated MLP; the weights stay as they are.

A gated MLP (Llama, Mistral, Qwen2, SmolLM2: modules ``gate_proj``, ``up_proj``, ``down_proj`` and
``act_fn``) computes ``down(act(gate(x)) * up(x))``. CATS replaces ``a = act(gate(x))`` by
``a * (|a| >= t)``: gate activations smaller in magnitude than the MLP's threshold ``t`` are zeroed,
so the matching columns of ``down`` (and rows of ``up``) need not be read at all. ``t`` is the
k-quantile of ``|a|`` over calibration activations of that MLP, where ``k`` is the target
activation sparsity (0.5 zeroes half of the gate activations).

The quantile comes from a sample. Calibration produces far more values per MLP than
``torch.quantile`` accepts (128 x 2048 tokens x 11008 for a 7B model, against a limit of 2**24):
:class:`ActivationSample` keeps a seeded, uniform random sample of fixed size (``SAMPLE_SIZE``
values drawn with replacement, each mini-batch contributing in proportion to its share of the
values), or every value, and so the exact quantile, when there are no more than that. With 2**20
values the fraction of ``|a|`` below ``t`` is off by sqrt(k (1 - k) / 2**20) ~ 5e-4 (one standard
error) at most k.

Here are the math and the module; the calibration pass (one decoder layer at a time) is in
``sparsekit.pruning.engine``. Installing thresholds on a loaded model: :func:`install_thresholds`, or
:func:`install_from_checkpoint` with the ``sparsekit.json`` that ``sparsekit prune --method cats``
wrote.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn  # noqa: F401

from sparsekit.errors import SparsekitError
from sparsekit.hf.modules import GATED_MLP_PARTS, find_gated_mlps, is_gated_mlp  # noqa: F401 (re-exported)

SAMPLE_SIZE = 2**20


def threshold_activation(a: torch.Tensor, threshold: torch.Tensor | float) -> torch.Tensor:
    """CATS on gate activations ``a``: the values of magnitude below ``threshold`` set to zero."""
    t = threshold.to(a.dtype) if isinstance(threshold, torch.Tensor) else threshold
    return a.masked_fill(a.abs() < t, 0)


def threshold_for(values: torch.Tensor, sparsity: float) -> float:
    """The ``sparsity``-quantile of ``values`` (magnitudes; linear interpolation, as ``torch.quantile``)."""
    if not 0.0 <= float(sparsity) < 1.0:
        raise SparsekitError(f"activation sparsity {sparsity} is out of range: use a fraction in [0, 1), e.g. 0.5")
    if values.numel() == 0:
        raise SparsekitError("no activation values to take a threshold from: pass calibration data")
    return float(torch.quantile(values.reshape(-1).float(), float(sparsity)))


class ActivationSample:
    """A seeded uniform sample of ``size`` values out of ``total`` (all of them when ``total <= size``).

    Feed it with :meth:`add` in order; mini-batch ``i`` draws (with replacement, from its own
    values) the number of samples that brings the running count to ``size * seen / total``.
    """

    def __init__(self, total: int, size: int = SAMPLE_SIZE, seed: int = 0):
        if size < 1:
            raise SparsekitError(f"CATS sample size must be positive, got {size}")
        self.total, self.size = int(total), int(size)
        self.exact = self.total <= self.size
        self.seen = 0
        self.parts: list[torch.Tensor] = []
        self.gen = torch.Generator().manual_seed(int(seed))

    def add(self, values: torch.Tensor) -> None:
        flat = values.detach().reshape(-1)
        start, self.seen = self.seen, self.seen + flat.numel()
        if self.exact:
            self.parts.append(flat.float())
            return
        end = min(self.seen, self.total)
        n = round(self.size * end / self.total) - round(self.size * min(start, self.total) / self.total)
        if n > 0:
            idx = torch.randint(flat.numel(), (n,), generator=self.gen).to(flat.device)
            self.parts.append(flat[idx].float())

    def values(self) -> torch.Tensor:
        return torch.cat(self.parts) if self.parts else torch.empty(0)

    def threshold(self, sparsity: float) -> float:
        return threshold_for(self.values(), sparsity)


def require_gated_mlps(model: nn.Module, skip=()) -> dict[str, nn.Module]:
    """:func:`find_gated_mlps`, refusing a model without one."""
    mlps = find_gated_mlps(model, skip=skip)
    if not mlps:
        what = "left after --skip" if find_gated_mlps(model) else "in this model"
        raise SparsekitError(
            f"CATS needs gated MLPs (gate_proj/up_proj/down_proj/act_fn, as in Llama, Mistral, Qwen2, SmolLM2), "
            f"and there is none {what} ({type(model).__name__}): use --method wanda or sparsegpt"
        )
    return mlps
