"""The policy for linears outside the decoder stack (``lm_head``, OPT's ``project_in``/``project_out``).

No calibration activation reaches them (the capture stops at layer 0), so only a method that
observes nothing (magnitude) may prune them, after the layer loop; a method that changes no weight
leaves them alone. A linear tied to the input embeddings is refused: pruning it would prune them too.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.hf import modules as L
from sparsekit.pruning.linears import prune_linears
from sparsekit.pruning.methods import Method


def outside_linears(model: nn.Module, stack_name: str, skip: list[str]) -> dict[str, nn.Module]:
    """The linears of ``model`` outside the decoder stack ``stack_name``, minus ``skip``."""
    found = L.find_linears(model, skip=skip)
    return {n: m for n, m in found.items() if not (n == stack_name or n.startswith(stack_name + "."))}


def check_outside_linears(model: nn.Module, stack_name: str, skip: list[str], method: Method) -> None:
    """Refuse, before any work, outside linears that ``method`` cannot prune (see module doc)."""
    if not method.changes_weights:
        return
    outside = outside_linears(model, stack_name, skip)
    if not outside:
        return
    head = _output_head(model, outside)  # in play only through --prune-lm-head (lm_head is skipped by default)
    if method.needs_calibration:
        others = [n for n in outside if n != head]
        if not others:
            raise SparsekitError(f"{head} lies outside the decoder stack, where only magnitude pruning applies: "
                                 "drop --prune-lm-head or use --method magnitude")
        raise SparsekitError(
            f"{', '.join(outside)} lie outside the decoder stack, where only magnitude pruning applies: "
            f"add {', '.join(others)} to --skip{' and drop --prune-lm-head' if head else ''}, or use --method magnitude"
        )
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for name, mod in outside.items():
        if emb is not None and mod.weight is getattr(emb, "weight", None):
            fix = "drop --prune-lm-head" if name == head else "add it to --skip"
            raise SparsekitError(f"{name} is tied to the input embeddings, pruning it would prune them too: {fix}")


def _output_head(model: nn.Module, outside: dict[str, nn.Module]) -> str | None:
    """The name of the output head among ``outside`` (``lm_head``, GPT-NeoX's ``embed_out``), if there."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((n for n, m in outside.items() if head is not None and m is head), None)


def prune_outside_linears(model: nn.Module, stack_name: str, skip: list[str], method: Method, sparsity: float,
                          pattern, warn: Callable[[str], object]) -> dict[str, dict]:
    """Prune the outside linears (checked by :func:`check_outside_linears`); their ``layers`` entries."""
    if not method.changes_weights:
        return {}
    return prune_linears(outside_linears(model, stack_name, skip), {}, method, sparsity, pattern, warn)
