"""Find the pieces of a model generically: the decoder stack, its linears and gated MLPs, the skip rule.

No architecture is hard-coded: the decoder stack is the longest ``nn.ModuleList`` whose children
are all blocks of one class holding at least one linear layer. That finds ``model.layers``
(Llama, Mistral, Qwen2, SmolLM), ``model.decoder.layers`` (OPT), ``gpt_neox.layers`` (GPT-NeoX)
and ``transformer.h`` (GPT-2) alike.
"""
from __future__ import annotations

import fnmatch
import sys
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from sparsekit.errors import SparsekitError

_CONV1D_MODULE = "transformers.pytorch_utils"


def __getattr__(name: str):
    """``Conv1D``: transformers' GPT-2 style linear (weights stored [in, out]), imported on first use so
    that importing this module does not import transformers (seconds); ``()`` if it cannot be imported."""
    if name == "Conv1D":
        try:
            from transformers.pytorch_utils import Conv1D
        except Exception:  # pragma: no cover - transformers always has it, but keep the module usable
            return ()
        return Conv1D
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``Conv1D``: never when transformers' module defining it is not
    imported (then no model holds one), so this imports nothing."""
    conv1d = getattr(sys.modules.get(_CONV1D_MODULE), "Conv1D", None)
    return conv1d is not None and isinstance(module, conv1d)


GATED_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def matches_skip(name: str, patterns: Iterable[str]) -> bool:
    """The one skip rule: an fnmatch pattern matches a module's full name or its last component."""
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(last, p) for p in patterns)


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule at dotted ``name`` with ``new``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def find_decoder_layers(model: nn.Module, is_layer: Optional[Callable[[nn.Module], bool]] = None) -> tuple[str, nn.ModuleList]:
    """Return ``(qualified_name, module_list)`` of the decoder stack.

    ``is_layer`` says what counts as a linear layer (default ``is_linear``; the runtime adds its
    packed ``SparseLinear``)."""
    is_layer = is_layer or is_linear
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if len({type(c) for c in mod}) != 1:
            continue
        if not any(is_layer(m) for m in mod[0].modules()):
            continue
        if best is None or len(mod) > len(best[1]):
            best = (name, mod)
    if best is None:
        raise SparsekitError(
            f"could not find a decoder layer stack in {type(model).__name__}: "
            "sparsekit needs a causal LM whose blocks sit in an nn.ModuleList"
        )
    return best


def find_linears(module: nn.Module, prefix: str = "", skip: Iterable[str] = ()) -> dict[str, nn.Module]:
    """All ``nn.Linear`` / ``Conv1D`` modules under ``module`` by qualified name, minus ``skip``.

    ``skip`` holds fnmatch patterns matched against the full name and its last component,
    e.g. ``"lm_head"``, ``"*.mlp.down_proj"``, ``"model.layers.0.*"``.
    """
    skip = list(skip)
    found = {}
    for name, mod in module.named_modules():
        if not is_linear(mod):
            continue
        full = f"{prefix}.{name}" if prefix and name else (prefix or name)
        if matches_skip(full, skip):
            continue
        found[full] = mod
    return found


def weight_out_in(module: nn.Module) -> torch.Tensor:
    """The weight as ``[out_features, in_features]`` (a view; Conv1D stores ``[in, out]``)."""
    w = module.weight.data
    return w.t() if is_conv1d(module) else w


def set_weight_out_in(module: nn.Module, weight: torch.Tensor) -> None:
    """Write an ``[out, in]`` weight back into the module, in the module's own layout and dtype."""
    if is_conv1d(module):
        weight = weight.t()
    module.weight.data.copy_(weight.to(module.weight.dtype))


def is_gated_mlp(module: nn.Module) -> bool:
    """A Llama-style gated MLP: ``gate_proj``, ``up_proj``, ``down_proj`` and ``act_fn`` (modules)."""
    return all(isinstance(getattr(module, part, None), nn.Module) for part in GATED_MLP_PARTS)


def find_gated_mlps(module: nn.Module, prefix: str = "", skip: Iterable[str] = ()) -> dict[str, nn.Module]:
    """Every gated MLP under ``module`` by qualified name (``prefix`` + name), minus ``skip``."""
    skip = list(skip)
    found = {}
    for name, mod in module.named_modules():
        full = ".".join(p for p in (prefix, name) if p)
        if is_gated_mlp(mod) and not matches_skip(full, skip):
            found[full] = mod
    return found
