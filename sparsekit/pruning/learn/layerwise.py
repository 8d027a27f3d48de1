"""The layer-sequential passes of mask learning: the one-shot mask it starts from, and the final
weights on the mask it learned.

Layer by layer like the one-shot engine (``sparsekit.pruning.engine``): capture the inputs of decoder
layer 0, then for each layer gather its linears' input statistics on the outputs of the layers
already pruned before it, prune every linear, and recompute the layer's outputs for the next one.
Unlike the engine, each linear can be told *which mask to reach*:

- ``tiles[name]`` (bool [out/T, in/T]): which hybrid tiles are 2:4 (a global allocation); 2:4
  inside them is chosen by the method (SparseGPT: during its sweep). None: the method's own one-shot
  choice at the target sparsity (``prune_weight``, as the engine does).
- ``keep[name]`` (bool [out, in]): the exact mask (a learned one). SparseGPT updates the kept weights
  for it (its sweep with the mask fixed), a method with ``update == "admm"`` (``methods.steps``) by
  ADMM; other methods zero the rest.

The model stays on the CPU; one layer at a time visits the device.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from sparsekit.hf import modules as L
from sparsekit.progress import Progress, report
from sparsekit.pruning.capture import capture_inputs, default_batch_size
from sparsekit.pruning.learn.choices import expand_tiles
from sparsekit.pruning.linears import layer_entry
from sparsekit.pruning.methods import Method, prune_weight
from sparsekit.pruning.methods.admm import admm_prune
from sparsekit.pruning.methods.sparsegpt import sparsegpt_prune
from sparsekit.pruning.methods.wanda import wanda_scores
from sparsekit.pruning.patterns import Pattern, nm_mask
from sparsekit.pruning.stats import collect_stats

UNSTRUCTURED = Pattern("unstructured")


def _prune_one(w: torch.Tensor, method: Method, pattern, sparsity: float, stats, tiles, keep, blocksize: int,
               percdamp: float, warn: Callable[[str], object]) -> tuple[torch.Tensor, torch.Tensor]:
    """(new weight, keep-mask) of one [out, in] weight."""
    if keep is not None:
        keep = keep.to(w.device)
        if getattr(method, "update", None) == "admm":  # --update admm: ADMM on the fixed mask
            new_w, keep, _ = admm_prune(w, stats.hessian, 0.0, UNSTRUCTURED, keep=keep, iters=method.admm_iters)
            return new_w, keep
        if method.needs_hessian:
            new_w, keep, _ = sparsegpt_prune(w, stats.hessian, 0.0, UNSTRUCTURED, blocksize=blocksize,
                                             percdamp=percdamp, warn=warn, keep=keep)
            return new_w.masked_fill(~keep, 0), keep
        return w.masked_fill(~keep, 0), keep
    if tiles is None:
        res = prune_weight(w, method, sparsity, pattern, stats, blocksize=blocksize, percdamp=percdamp, warn=warn)
        return res.weight, res.mask
    if method.needs_hessian:
        new_w, keep, _ = sparsegpt_prune(w, stats.hessian, sparsity, pattern, blocksize=blocksize, percdamp=percdamp,
                                         warn=warn, sparse_tiles=tiles)
        return new_w.masked_fill(~keep, 0), keep
    scores = wanda_scores(w, stats.col_sq_sum) if method.needs_stats else w.detach().float().abs()
    keep = nm_mask(scores, 2, 4) | ~expand_tiles(tiles.to(w.device), pattern.tile).bool()
    return w.masked_fill(~keep, 0), keep


@torch.no_grad()
def prune_layerwise(model, calib: torch.Tensor | None, names: list[str], *, method: Method, pattern, sparsity: float,
                    device: torch.device, tiles: dict | None = None, keep: dict | None = None, blocksize: int = 128,
                    percdamp: float = 0.01, batch_size: int | None = None, progress: Progress | None = None,
                    stage: str = "layers", warn: Callable[[str], object] = print) -> dict:
    """Prune the linears ``names`` of ``model`` (on the CPU) in place; returns ``masks`` {name: bool
    keep-mask on the CPU}, ``layers`` (report entries), ``per_layer`` (the engine's per-layer entries),
    ``seconds`` and ``peak_mem_bytes``."""
    t0 = time.perf_counter()
    stack_name, layers = L.find_decoder_layers(model)
    wanted = set(names)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    acts = None
    if method.needs_stats:
        acts = capture_inputs(model, calib, device, batch_size or default_batch_size(calib.shape[1]))
    masks, entries, per_layer = {}, {}, []
    for idx, layer in enumerate(layers):
        t_layer = time.perf_counter()
        layer.to(device)
        linears = {n: m for n, m in L.find_linears(layer, prefix=f"{stack_name}.{idx}").items() if n in wanted}
        stats = collect_stats(layer, linears, acts, method.needs_hessian, device) if acts is not None and linears else {}
        for name, mod in linears.items():
            new_w, k = _prune_one(L.weight_out_in(mod), method, pattern, sparsity, stats.get(name),
                                  (tiles or {}).get(name), (keep or {}).get(name), blocksize, percdamp,
                                  lambda m, _n=name: warn(f"{_n}: {m}"))
            L.set_weight_out_in(mod, new_w)
            masks[name] = k.cpu()
            entries[name] = layer_entry(mod)
        del stats
        if acts is not None and idx + 1 < len(layers):
            acts.run(layer, write=True)
        layer.to("cpu")
        per_layer.append({"index": idx, "seconds": time.perf_counter() - t_layer, "phases": {},
                          "peak_mem_bytes": None, "linears": list(linears)})
        report(progress, stage, idx + 1, len(layers))
    del acts
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"masks": masks, "layers": entries, "per_layer": per_layer, "seconds": time.perf_counter() - t0,
            "peak_mem_bytes": peak}
