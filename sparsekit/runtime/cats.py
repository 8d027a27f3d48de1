"""CATS at run time: the thresholded activation module, and installing thresholds on a loaded model.

The thresholds come from ``sparsekit prune --method cats`` (math in ``sparsekit.pruning.methods.cats``),
recorded in the checkpoint's ``sparsekit.json``.
"""
from __future__ import annotations

import torch
from torch import nn

from sparsekit.errors import SparsekitError
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return threshold_activation(self.act(x), self.threshold)

    def extra_repr(self) -> str:
        return f"threshold={float(self.threshold):.6g}"


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
