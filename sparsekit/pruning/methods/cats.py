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

import fnmatch
import json
from pathlib import Path

import torch
from torch import nn

from sparsekit.errors import SparsekitError

SAMPLE_SIZE = 2**20
GATED_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


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
        a = self.act(x)
        return a.masked_fill(a.abs() < self.threshold.to(a.dtype), 0)

    def extra_repr(self) -> str:
        return f"threshold={float(self.threshold):.6g}"


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


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name.rsplit(".", 1)[-1], p) for p in patterns)


def is_gated_mlp(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, part, None), nn.Module) for part in GATED_MLP_PARTS)


def find_gated_mlps(module: nn.Module, prefix: str = "", skip=()) -> dict[str, nn.Module]:
    """Every submodule with ``gate_proj``, ``up_proj``, ``down_proj`` and ``act_fn`` (a module),
    by qualified name (``prefix`` + name), except those whose name matches a ``skip`` pattern."""
    found = {}
    for name, mod in module.named_modules():
        full = ".".join(p for p in (prefix, name) if p)
        if is_gated_mlp(mod) and not _matches(full, skip):
            found[full] = mod
    return found


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
