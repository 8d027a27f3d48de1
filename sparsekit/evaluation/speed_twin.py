"""The dense twin that ``sparsekit eval --speed`` measures beside a packed model, and whether it fits.

:func:`dense_twin` makes it without touching the packed model and shares every tensor it can;
:func:`pairing_obstacle` says, before it is made, when it and both models' working memory would not fit
on the GPU (``eval --speed`` then measures the two models one after the other and says so).
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from torch import nn

from sparsekit.runtime.cats import remove_thresholds
from sparsekit.runtime.fusion import fuse_projections
from sparsekit.runtime.sparse_linear import SparseLinear

PAIR_HEADROOM = 0.10  # share of the GPU's memory left unplanned when deciding whether both models fit
GIB = 2**30


def _dense_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype ``swap.densify`` gives decoded weights: that of the model's first floating parameter."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _as_linear(sl: SparseLinear, dtype: torch.dtype | None) -> nn.Linear:
    """``sl`` as an ``nn.Linear``: its weight the dispatch plan's dense copy where that is in ``dtype``
    (the same decoded values, no new memory), else decoded afresh (``SparseLinear.to_linear``)."""
    copy_ = sl.dense_copy
    if copy_ is None or copy_.dtype != (dtype or copy_.dtype):
        return sl.to_linear(dtype)
    lin = nn.Linear(sl.in_features, sl.out_features, bias=sl.bias is not None, device="meta")
    lin.weight = nn.Parameter(copy_, requires_grad=False)
    if sl.bias is not None:
        lin.bias = nn.Parameter(sl.bias.detach().clone().to(copy_.dtype), requires_grad=False)
    return lin


def dense_twin(model: nn.Module, cats_mlps: dict[str, nn.Module] | None = None, *, cats_kernels: int = 0,
               fuse_proj: bool = True) -> nn.Module:
    """The dense counterpart of ``model`` as a second model beside it, ``model`` left as it is: what
    ``swap.densify`` (and, with CATS, ``speed.restore_dense_mlps`` and ``fuse_projections``) make of it in
    place. Every ``SparseLinear`` becomes an ``nn.Linear`` (:func:`_as_linear`); every other parameter and
    buffer is *shared* with ``model``, not copied (one ``copy.deepcopy`` whose memo maps them to
    themselves), so the twin costs only the decoded weights that have no dense copy yet. ``cats_mlps``:
    ``{name: gated MLP}`` taken before ``speed.enable_cats``; the twin gets copies of them back, without
    thresholds, their gate and up merged when ``cats_kernels`` ran and ``fuse_proj``."""
    cats_mlps = cats_mlps or {}
    dtype = _dense_dtype(model)
    trees = [model, *cats_mlps.values()]
    memo: dict[int, Any] = {}
    for tree in trees:
        for m in tree.modules():
            if isinstance(m, SparseLinear) and id(m) not in memo:
                memo[id(m)] = _as_linear(m, dtype)
    for tree in trees:
        for m in tree.modules():
            if not isinstance(m, SparseLinear):
                for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                    memo.setdefault(id(t), t)
    for name, original in cats_mlps.items():
        current = model.get_submodule(name)
        if current is not original:  # on the CATS kernels: the twin gets (a copy of) the original back
            memo[id(current)] = copy.deepcopy(original, memo)
    twin = copy.deepcopy(model, memo)
    if cats_mlps:
        remove_thresholds(twin)
        if cats_kernels and fuse_proj:
            fuse_projections(twin)  # the restored MLPs' gate/up, as prepare_for_decode fused the others'
    return twin


def twin_bytes(model: nn.Module, cats_mlps: dict[str, nn.Module] | None = None, *, cats_kernels: int = 0,
               fuse_proj: bool = True) -> int:
    """GPU bytes :func:`dense_twin` would add beside ``model`` (an estimate from the shapes): the decoded
    weights of its ``SparseLinear`` layers without a dense copy in the twin's dtype, their biases, and
    the merged gate/up of CATS MLPs restored from the kernels."""
    cats_mlps = cats_mlps or {}
    dtype = _dense_dtype(model) or torch.float16
    size = torch.empty((), dtype=dtype).element_size()
    seen: set[int] = set()
    total = 0
    for tree in [model, *cats_mlps.values()]:
        for m in tree.modules():
            if isinstance(m, SparseLinear) and id(m) not in seen:
                seen.add(id(m))
                if m.dense_copy is None or m.dense_copy.dtype != dtype:
                    total += m.out_features * m.in_features * size
                total += 0 if m.bias is None else m.out_features * size
    if cats_kernels and fuse_proj:
        for name, original in cats_mlps.items():
            if model.get_submodule(name) is not original:
                for proj in ("gate_proj", "up_proj"):
                    lin = getattr(original, proj, None)
                    total += 0 if lin is None else lin.out_features * lin.in_features * size
    return total


def working_bytes(model: nn.Module, batch_size: int, prompt_len: int, max_len: int) -> tuple[int, int]:
    """``(KV cache, prefill activations)``: GPU bytes one decoder of ``model`` takes at ``batch_size``,
    estimated from the config (static cache of ``max_len`` positions; logits in fp32 and the MLP's
    and attention's intermediates of one layer for ``prompt_len`` tokens)."""
    cfg = model.config.get_text_config()
    size = torch.empty((), dtype=_dense_dtype(model) or torch.float16).element_size()
    hidden = int(getattr(cfg, "hidden_size", 0) or 4096)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 32)
    kv_heads = int(getattr(cfg, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(cfg, "head_dim", 0) or hidden // heads)
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 32)
    inter = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden)
    vocab = int(getattr(cfg, "vocab_size", 0) or 32000)
    kv = 2 * layers * batch_size * max_len * kv_heads * head_dim * size
    act = batch_size * prompt_len * (4 * vocab + (3 * inter + 6 * hidden) * size)
    return kv, act


def pairing_obstacle(model: nn.Module, cats_mlps: dict[str, nn.Module] | None = None, *,
                     batch_sizes: Sequence[int], prompt_len: int, new_tokens: int, device,
                     cats_kernels: int = 0, fuse_proj: bool = True) -> str | None:
    """Why the dense twin cannot be measured beside ``model`` (one clause), or None when it fits: the
    twin's bytes (:func:`twin_bytes`), two decoders' KV caches and one prefill's activations at the
    largest batch size (:func:`working_bytes`) and ``PAIR_HEADROOM`` of the GPU's memory, against what
    is free on it now (the driver's free memory and what torch's allocator holds unused)."""
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    twin = twin_bytes(model, cats_mlps, cats_kernels=cats_kernels, fuse_proj=fuse_proj)
    b = max(batch_sizes)
    kv, act = working_bytes(model, b, prompt_len, prompt_len + new_tokens + 1)
    need = twin + 2 * kv + act + PAIR_HEADROOM * total
    if need <= free:
        return None
    return (f"the dense twin ({twin / GIB:.2f} GiB) with two KV caches and the activations at batch {b} "
            f"({(2 * kv + act) / GIB:.2f} GiB) and {PAIR_HEADROOM:.0%} headroom needs {need / GIB:.2f} GiB "
            f"beside the packed model, {free / GIB:.2f} GiB is free")
