"""CATS at run time: the thresholded activation module, and installing thresholds on a loaded model.

While :func:`counting_zeros` is in force, each ``CatsActivation`` also counts the zeros it outputs,
on its own device (one tensor add per call, no host sync), so that ``eval --ppl`` can report the
activation sparsity each gated MLP reached on the evaluation text.

The thresholds come from ``sparsekit prune --method cats`` (math in ``sparsekit.pruning.methods.cats``),
recorded in the checkpoint's ``sparsekit.json``.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from sparsekit.pruning.methods.cats import named_gated_mlps, read_thresholds, threshold_activation


class CatsActivation(nn.Module):
    """``act(x)`` with the values of magnitude below ``threshold`` set to zero.

    ``mlp.act_fn = CatsActivation(mlp.act_fn, t)`` makes an HF gated MLP run CATS. The threshold
    is a (non-persistent) buffer: it follows ``.to(device/dtype)`` but stays out of the state dict,
    so the checkpoint's weights are those of the dense model; it lives in ``sparsekit.json``.
    """

    def __init__(self, act: nn.Module, threshold: float | torch.Tensor):
        super().__init__()
        if isinstance(act, CatsActivation):
            act = act.act
        self.act = act
        self.register_buffer("threshold", torch.as_tensor(float(threshold), dtype=torch.float32), persistent=False)
        self.zeros: torch.Tensor | None = None  # while counting: zeros output so far (int64, on the device)
        self.values = 0  # while counting: values output so far

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = threshold_activation(self.act(x), self.threshold)
        if self.zeros is not None:
            self.zeros.add_((y == 0).sum())
            self.values += y.numel()
        return y

    def extra_repr(self) -> str:
        return f"threshold={float(self.threshold):.6g}"


def cats_activations(model: nn.Module) -> dict[str, CatsActivation]:
    """``{gated-MLP name: its CatsActivation}`` of ``model`` (empty when no threshold is installed)."""
    return {name.rsplit(".", 1)[0]: m for name, m in model.named_modules() if isinstance(m, CatsActivation)}


class ZeroCounts:
    """The zero counters of a model's ``CatsActivation`` modules (see :func:`counting_zeros`)."""

    def __init__(self, acts: dict[str, CatsActivation]):
        self.acts = acts
        self._saved: dict[str, tuple[torch.Tensor, int]] = {}

    def mark(self) -> None:
        """Remember the counts now (device copies, no sync): :meth:`rollback` returns to them."""
        self._saved = {n: (a.zeros.clone(), a.values) for n, a in self.acts.items()}

    def rollback(self) -> None:
        """Forget what was counted since :meth:`mark` (a batch that failed and is run again)."""
        for n, (z, v) in self._saved.items():
            self.acts[n].zeros.copy_(z)
            self.acts[n].values = v

    def fractions(self) -> dict[str, float]:
        """``{gated-MLP name: fraction of its activations that were zero}`` so far (one host sync)."""
        zeros = torch.stack([a.zeros.cpu() for a in self.acts.values()]).tolist() if self.acts else []
        return {n: (z / a.values if a.values else 0.0) for (n, a), z in zip(self.acts.items(), zeros)}


@contextlib.contextmanager
def counting_zeros(model: nn.Module):
    """Count the zeros every ``CatsActivation`` of ``model`` outputs during the block; yields the
    :class:`ZeroCounts` (with no CATS MLP, an empty one). The counters start at zero and are
    dropped when the block ends."""
    acts = cats_activations(model)
    for a in acts.values():
        a.zeros, a.values = torch.zeros((), dtype=torch.int64, device=a.threshold.device), 0
    try:
        yield ZeroCounts(acts)
    finally:
        for a in acts.values():
            a.zeros, a.values = None, 0


def remove_thresholds(model: nn.Module) -> int:
    """Undo :func:`install_thresholds`: each ``CatsActivation`` gives way to the activation it wraps
    (the dense model again). Returns how many were removed."""
    acts = cats_activations(model)
    for name in acts:
        mlp = model.get_submodule(name)
        mlp.act_fn = mlp.act_fn.act
    return len(acts)


def apply_threshold(mlp: nn.Module, threshold: float) -> CatsActivation:
    """Make ``mlp`` run CATS with ``threshold`` (replacing any threshold it had)."""
    mlp.act_fn = CatsActivation(mlp.act_fn, threshold)
    return mlp.act_fn


def install_thresholds(model: nn.Module, thresholds: dict[str, float]) -> None:
    """Put a :class:`CatsActivation` with ``thresholds[name]`` into each named gated MLP of ``model``."""
    for name, mlp in named_gated_mlps(model, thresholds).items():
        apply_threshold(mlp, float(thresholds[name]))
        mlp.act_fn.to(next((p.device for p in mlp.parameters()), torch.device("cpu")))


def install_from_checkpoint(model: nn.Module, directory) -> int:
    """Install the CATS thresholds recorded in ``directory/sparsekit.json``, if any; returns how many."""
    thresholds = read_thresholds(directory)
    install_thresholds(model, thresholds)
    return len(thresholds)
