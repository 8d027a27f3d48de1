"""CATS at run time: the thresholded activation module, and installing thresholds on a loaded model.

The thresholds come from ``sparsekit prune --method cats`` (math in ``sparsekit.pruning.methods.cats``),
recorded in the checkpoint's ``sparsekit.json``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.hf.modules import is_gated_mlp
from sparsekit.pruning.methods.cats import threshold_activation


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
    for name, t in thresholds.items():
        try:
            mlp = model.get_submodule(name)
        except AttributeError:
            mlp = None
        if mlp is None or not is_gated_mlp(mlp):
            raise SparsekitError(f"CATS threshold for {name!r}, which is not a gated MLP of this "
                                 f"{type(model).__name__}: the checkpoint's sparsekit.json does not match its model")
        apply_threshold(mlp, float(t))
        mlp.act_fn.to(next((p.device for p in mlp.parameters()), torch.device("cpu")))


def thresholds_from_metadata(meta: dict) -> dict[str, float]:
    """``{mlp name: threshold}`` from a ``sparsekit.json`` dict (empty when it is not a CATS run)."""
    cats = meta.get("cats") if isinstance(meta, dict) else None
    if not cats:
        return {}
    try:
        return {name: float(v["threshold"]) for name, v in cats["mlps"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise SparsekitError("sparsekit.json has a malformed \"cats\" entry (want mlps: {name: {threshold: t}}): "
                             "re-run `sparsekit prune --method cats`") from None


def install_from_checkpoint(model: nn.Module, directory) -> int:
    """Install the CATS thresholds recorded in ``directory/sparsekit.json``, if any; returns how many."""
    path = Path(directory) / "sparsekit.json"
    if not path.is_file():
        return 0
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SparsekitError(f"{path} cannot be read ({e}): fix or remove it") from None
    thresholds = thresholds_from_metadata(meta)
    install_thresholds(model, thresholds)
    return len(thresholds)
