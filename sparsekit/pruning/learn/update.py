"""The SparseGPT weight update on masks that are already chosen (learned, or globally allocated).

Layer by layer like the one-shot engine: capture the inputs of decoder layer 0, then for each layer
gather its linears' input Hessians (on the outputs of the already-updated layers before it), run
SparseGPT's OBS sweep with the mask fixed (``sparsegpt_prune(..., keep=mask)``: the masked weights
become zero, the others absorb the error) and recompute the layer's outputs for the next one.
The model stays on the CPU; one layer at a time visits the device.
"""
from __future__ import annotations

import time

import torch

from sparsekit.hf import modules as L
from sparsekit.progress import Progress, report
from sparsekit.pruning.capture import capture_inputs, default_batch_size
from sparsekit.pruning.linears import layer_entry
from sparsekit.pruning.methods.sparsegpt import sparsegpt_prune
from sparsekit.pruning.patterns import Pattern
from sparsekit.pruning.stats import collect_stats

UNSTRUCTURED = Pattern("unstructured")


@torch.no_grad()
def sparsegpt_update(model, calib: torch.Tensor, masks: dict[str, torch.Tensor], *, device: torch.device,
                     blocksize: int = 128, percdamp: float = 0.01, batch_size: int | None = None,
                     progress: Progress | None = None, warn=print) -> dict:
    """Update ``model``'s weights (dense, on the CPU) for the keep-masks ``masks`` {linear name: bool
    [out, in]}, zeroing the rest; returns the layers' report entries, seconds and peak device memory."""
    t0 = time.perf_counter()
    stack_name, layers = L.find_decoder_layers(model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    acts = capture_inputs(model, calib, device, batch_size or default_batch_size(calib.shape[1]), progress)
    entries = {}
    for idx, layer in enumerate(layers):
        layer.to(device)
        prefix = f"{stack_name}.{idx}"
        linears = {n: m for n, m in L.find_linears(layer, prefix=prefix).items() if n in masks}
        stats = collect_stats(layer, linears, acts, True, device) if linears else {}
        for name, mod in linears.items():
            w = L.weight_out_in(mod)
            new_w, keep, _ = sparsegpt_prune(w, stats[name].hessian, 0.0, UNSTRUCTURED, blocksize=blocksize,
                                             percdamp=percdamp, warn=lambda m, _n=name: warn(f"{_n}: {m}"),
                                             keep=masks[name].to(w.device))
            L.set_weight_out_in(mod, new_w.masked_fill(~keep, 0))
            entries[name] = layer_entry(mod)
        del stats
        if idx + 1 < len(layers):
            acts.run(layer, write=True)
        layer.to("cpu")
        report(progress, "update", idx + 1, len(layers))
    del acts
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"layers": entries, "seconds": time.perf_counter() - t0, "peak_mem_bytes": peak}
