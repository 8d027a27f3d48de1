"""Pruning a set of named linears in place, and their ``layers`` entries for the report and sparsekit.json."""
from __future__ import annotations

from typing import Callable

from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.hf import modules as L
from sparsekit.pruning.methods import Method, prune_weight


def layer_entry(module: nn.Module) -> dict:
    """A linear's ``layers`` entry as stored: its fraction of zeros, [out, in] shape and kind."""
    w = L.weight_out_in(module)
    return {"sparsity": float((w == 0).sum().item() / w.numel()), "shape": [int(w.shape[0]), int(w.shape[1])],
            "kind": "linear" if isinstance(module, nn.Linear) else "conv1d"}


def weight_report(linears: dict[str, nn.Module]) -> dict[str, dict]:
    """The ``layers`` entries of linears left as they are (a method that changes no weight)."""
    return {name: layer_entry(mod) for name, mod in linears.items()}


def prune_linears(linears: dict[str, nn.Module], stats: dict, method: Method, sparsity: float, pattern,
                  warn: Callable[[str], object], blocksize: int = 128, percdamp: float = 0.01) -> dict[str, dict]:
    """Prune each linear with its ``stats`` entry; returns the ``layers`` entries, with the scalar
    items of ``prune_weight``'s info under ``info``."""
    report = {}
    for name, mod in linears.items():
        if method.needs_stats and name not in stats:
            raise SparsekitError(f"{name} received no calibration input: add it to --skip or use --method magnitude")
        w = L.weight_out_in(mod)
        res = prune_weight(w, method, sparsity, pattern, stats.get(name), blocksize=blocksize,
                           percdamp=percdamp, warn=lambda msg, _n=name: warn(f"{_n}: {msg}"))
        L.set_weight_out_in(mod, res.weight)
        report[name] = layer_entry(mod)
        if res.info:
            report[name]["info"] = {k: v for k, v in res.info.items() if isinstance(v, (int, float, str, bool))}
    return report
