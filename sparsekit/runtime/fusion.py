"""Fusions that shorten a decode step, applied once to a loaded model before it is decoded.

* ``fuse_rms_norms``: HF's Llama-form RMSNorm -> ``FusedRMSNorm`` (two launches instead of eight).
* ``fuse_projections``: q/k/v and gate/up -> one matmul each (``FusedProjection``).
* ``equalize_packed_sizes``: pad the packed values (and any 2:4 layouts: ``equalize_sp24_layouts``) of
  same-shaped ``SparseLinear`` layers to one length, so that one compiled decoder layer serves the whole
  stack (``GreedyDecoder(compile=True)`` expects it; it does not change the model it is given).

``prepare_for_decode`` runs them in that order (``sparsekit eval --speed`` does, for both models).
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from sparsekit.hf.compat import is_llama_rms_norm
from sparsekit.hf.modules import set_submodule
from sparsekit.packed.tcabme import decode_dense, encode
from sparsekit.runtime.sparse_linear import SparseLinear, release_kernel_caches


def prepare_for_decode(model: nn.Module, *, fuse_norms: bool = True, fuse_proj: bool = True,
                       equalize: bool = True, cats: bool = True) -> dict:
    """The fusions chosen, in place, in their one order; returns what each did. ``cats``: gated
    MLPs with a CATS threshold run the activation-sparse kernels (``cats_mlp.enable_cats_kernels``),
    first, so that their gate and up stay separate."""
    done = {}
    if cats:
        from sparsekit.runtime.cats import CatsActivation

        done["cats_mlps"] = 0
        if any(isinstance(m, CatsActivation) for m in model.modules()):  # else numba is not even imported
            from sparsekit.runtime.cats_mlp import enable_cats_kernels

            done["cats_mlps"] = enable_cats_kernels(model)
    if fuse_norms:
        done["fused_norms"] = fuse_rms_norms(model)
    if fuse_proj:
        done["fused_projections"] = fuse_projections(model)
    if equalize:
        done["padding"] = equalize_packed_sizes(model)
    return done


class FusedRMSNorm(nn.Module):
    """RMSNorm as ``weight * rms_norm(x)``: one fused kernel (``F.rms_norm``, fp32 inside) and one
    multiply, instead of the eight elementwise launches of the HF modules. Same rounding points
    as the HF Llama/Mistral/Qwen2 norm (normalise in fp32, round to the input dtype, scale)."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.rms_norm(x, (x.shape[-1],), None, self.eps)
        return self.weight * y


def fuse_rms_norms(model: nn.Module) -> int:
    """Swap, in place, the HF ``*RMSNorm`` modules of the Llama form (``weight * norm(x)``, eps in
    ``variance_epsilon``) for ``FusedRMSNorm``; returns how many. Decode steps are launch-bound
    outside the matmuls, so this shortens every step, dense and sparse alike. Gemma-style norms
    (``1 + weight``) are left alone."""
    swapped = 0
    for name, mod in list(model.named_modules()):
        if is_llama_rms_norm(mod):  # any other formula keeps the original
            set_submodule(model, name, FusedRMSNorm(mod.weight, mod.variance_epsilon))
            swapped += 1
    return swapped


# fusing projections that read the same input ----------------------------------------------------
PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProjection(nn.Module):
    """One linear (dense or SparseLinear) computing several projections of the same input at
    once; ``ProjectionPart`` modules stand in for the original projections and hand out slices."""

    def __init__(self, fused: nn.Module, sizes: list[int]):
        super().__init__()
        self.fused = fused
        self.sizes = list(sizes)
        self._last: tuple | None = None  # (input, outputs) of the latest call

    def part_output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        last = self._last
        if index == 0 or last is None or last[0] is not x:
            outs = self.fused(x).split(self.sizes, dim=-1)
            self._last = last = (x, outs)
        if index == len(self.sizes) - 1:
            self._last = None  # the last part has been handed out: keep no activations alive
        return last[1][index]


class ProjectionPart(nn.Module):
    def __init__(self, owner: FusedProjection, index: int, in_features: int, out_features: int):
        super().__init__()
        self._owner = (owner,)  # not a submodule: the owner is registered on the parent
        self.index = index
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._owner[0].part_output(x, self.index)


def _concat_linears(mods: list[nn.Module]) -> nn.Module:
    """One linear whose outputs are those of ``mods`` stacked (same input features)."""
    bias = None
    if any(m.bias is not None for m in mods):
        ref = next(m.bias for m in mods if m.bias is not None)
        bias = torch.cat([m.bias if m.bias is not None else ref.new_zeros(m.out_features) for m in mods])
    if all(isinstance(m, SparseLinear) for m in mods):
        weight = torch.cat([decode_dense(m.packed) for m in mods])
        return SparseLinear(encode(weight.contiguous()), bias)
    lin = nn.Linear(mods[0].in_features, sum(m.out_features for m in mods), bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(torch.cat([m.weight.detach() for m in mods]), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return lin


def fuse_projections(model: nn.Module) -> int:
    """Merge, in place, q/k/v and gate/up projections of each decoder layer into one linear
    (one SparseLinear when all were packed, re-encoded exactly; one nn.Linear when all were
    dense). Fewer, larger matmuls per step: fixed per-call costs are paid 4 times per layer
    instead of 7. Returns how many groups were merged; mixed or odd groups are left alone."""
    merged = 0
    cats_mlp = sys.modules.get("sparsekit.runtime.cats_mlp")   # not imported: no CatsMLP exists (nor numba)
    inside_cats = ({id(m.mlp) for m in model.modules() if isinstance(m, cats_mlp.CatsMLP)}  # gate and up stay apart
                   if cats_mlp is not None else set())
    for parent in list(model.modules()):
        if id(parent) in inside_cats:
            continue
        for names in PROJECTION_GROUPS:
            mods = [getattr(parent, n, None) for n in names]
            if any(m is None for m in mods):
                continue
            kinds = {type(m) for m in mods}
            if kinds != {SparseLinear} and kinds != {nn.Linear}:
                continue
            if len({m.in_features for m in mods}) != 1:
                continue
            owner = FusedProjection(_concat_linears(mods), [m.out_features for m in mods])
            setattr(parent, "fused_" + "_".join(n.split("_")[0] for n in names), owner)
            for i, (n, m) in enumerate(zip(names, mods)):
                setattr(parent, n, ProjectionPart(owner, i, m.in_features, m.out_features))
            merged += 1
    if merged:
        release_kernel_caches()
    return merged


def equalize_packed_sizes(model: nn.Module) -> float:
    """Pad the ``values`` buffer of every SparseLinear to the longest one of its shape, in place.

    Layers of one shape then look alike to ``torch.compile`` (a tensor's size is part of what a
    compiled graph is specialised to), so the one compiled decoder layer serves the whole stack.
    The padding sits past ``gtile_offsets[-1]`` and is never read. The 2:4 layouts a layer holds
    already are padded too (``equalize_sp24_layouts``). Returns the added fraction of packed bytes
    (small: layers pruned to one sparsity differ by a fraction of a percent).
    """
    groups: dict = {}
    for mod in model.modules():
        if isinstance(mod, SparseLinear) and not mod.sp24_only:   # (a freed TCA-BME form stays empty)
            groups.setdefault((mod.out_features, mod.in_features, mod.values.dtype), []).append(mod)
    added, total = _pad_to_longest(groups, ("values",))
    sp_added, sp_total = _equalize_sp24(model)
    if added or sp_added:
        release_kernel_caches()  # else the kernels' cached views keep the unpadded copies alive
    return (added + sp_added) / max(1, total + sp_total)


def equalize_sp24_layouts(model: nn.Module) -> float:
    """Pad the 2:4 layouts (``runtime.sp24``) of same-shaped ``SparseLinear`` layers to one size, in place, as
    ``equalize_packed_sizes`` does for the packed values: a hybrid mask's layers hold different numbers of 2:4 and
    dense tiles, so without it every layer of a stack compiles its own variant of the decoder layer (H100, a 7B-shaped
    hybrid model: torch's limit of 64 variants hit at the third batch size, the rest decoded uncompiled). Layers whose
    dense (or 2:4) tile buffer is empty stay empty, so the kernels still see an all-2:4 weight as one. The padding
    sits past the last slot the tile table names and is never read. Returns the added fraction of layout bytes."""
    added, total = _equalize_sp24(model)
    if added:
        release_kernel_caches()
    return added / max(1, total)


def _equalize_sp24(model: nn.Module) -> tuple[int, int]:
    groups: dict = {}
    for mod in model.modules():
        if isinstance(mod, SparseLinear) and mod.sp24_tiles is not None:
            key = (mod.out_features, mod.in_features, mod.sp24_dense.numel() > 0, mod.sp24_sp.numel() > 0)
            groups.setdefault(key, []).append(mod)
    return _pad_to_longest(groups, ("sp24_dense", "sp24_sp"))


def _pad_to_longest(groups: dict, names: tuple[str, ...]) -> tuple[int, int]:
    """Pad the 1-D buffers ``names`` of every module of each group with zeros to the longest of the group;
    returns (bytes added, bytes before)."""
    added = total = 0
    for mods in groups.values():
        for name in names:
            longest = max(getattr(m, name).numel() for m in mods)
            for m in mods:
                t = getattr(m, name)
                n = t.numel()
                total += n * t.element_size()
                if n < longest:
                    padded = t.new_zeros(longest)
                    padded[:n] = t
                    setattr(m, name, padded)
                    added += (longest - n) * t.element_size()
    return added, total
