"""OWL's plumbing for the engine (``prune_model(..., owl=)``): the read-only first pass over the dense
model that measures each decoder layer's outlier ratio (:func:`owl_scan`), the per-layer targets it
gives (:func:`owl_allotment`, the math in ``sparsekit.pruning.owl``), and the pruning of a layer's
linears at those targets with each linear's rounding carried into the next (:func:`prune_allotted`).

The scan reads its windows from the engine's own capture of layer 0's inputs where it can
(:func:`scan_activations`): a second capture would cost OWL a fixed ~0.2 s on an H100 whatever the
window count (the embeddings copied to the device and back, the model's forward up to layer 0).
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.hf import modules as L
from sparsekit.progress import Progress, report
from sparsekit.pruning.capture import Activations, capture_inputs, default_batch_size
from sparsekit.pruning.linears import prune_linears
from sparsekit.pruning.methods.wanda import wanda_scores
from sparsekit.pruning.offload import LayerMover, ResidentLayers, tensor_bytes
from sparsekit.pruning.owl import Allotment, outlier_ratio, owl_sparsities
from sparsekit.pruning.patterns import HYBRID_MAX_SPARSITY, Pattern
from sparsekit.pruning.stats import collect_stats

OWL_MAX_SPARSITY = 0.99  # no layer is pruned further under OWL (unstructured)


def check_owl(meth, pattern, calib) -> Pattern:
    """Raise unless OWL can run with this method, pattern and calibration; the parsed pattern."""
    pattern = Pattern.parse(pattern)
    if not meth.changes_weights or pattern.is_nm:
        raise SparsekitError(f"OWL varies the sparsity per layer: it needs a weight method and an unstructured or "
                             f"hybrid pattern, not {meth.name} {pattern}")
    if calib is None:
        raise SparsekitError("OWL measures outliers on calibration data: pass calibration windows")
    return pattern


def owl_allotment(model: nn.Module, calib, meth, sparsity: float, pattern, owl, skip: list[str], device: torch.device,
                  batch_size: int | None, layer_mover: Callable | None, overlap: bool,
                  progress: Progress | None, resident: ResidentLayers | None = None,
                  acts: Activations | None = None) -> tuple[Allotment, dict]:
    """The scan, then ``(Allotment, allocation report)``: ratios, per-layer targets, OWL's settings.
    ``resident``: where the scan leaves its device copies of the layers for the pruning pass; ``acts``:
    the pruning pass's capture of ``calib`` (see :func:`owl_scan`)."""
    pattern = check_owl(meth, pattern, calib)
    t0 = time.perf_counter()
    ratios, params = owl_scan(model, calib, device, owl, skip, batch_size, layer_mover, overlap, progress, resident,
                              acts)
    hi = HYBRID_MAX_SPARSITY if pattern.is_hybrid else OWL_MAX_SPARSITY
    targets = owl_sparsities(ratios, sparsity, owl.lam, params, hi=hi)
    rep = {"kind": "owl", **owl.as_dict(), "outlier_ratio": ratios, "target": targets,
           "scan_seconds": time.perf_counter() - t0}
    if resident is not None:
        rep["resident"] = resident.report(len(ratios))
    return Allotment(targets, hi), rep


def resident_for(model: nn.Module, calib: torch.Tensor, device: torch.device, overlap: bool,
                 layer_mover: Callable | None, meth=None) -> ResidentLayers | None:
    """Where OWL's scan may leave its device copies of the layers for the pruning pass (so the pass does
    not copy the same weights in a second time): 70% of the device memory free now, less what the
    pruning pass needs beside them (its activations in and out, three layers in flight, a method's
    Hessian of the widest input twice over, 2 GiB). None off CUDA, with another layer mover (streamed
    from disk), or without the overlapped mover."""
    if device.type != "cuda" or layer_mover is not None or not overlap:
        return None
    _, layers = L.find_decoder_layers(model)
    layer_bytes = max((tensor_bytes(lay.parameters()) for lay in layers), default=0)
    widest = max((p.shape[-1] for lay in layers for p in lay.parameters() if p.dim() == 2), default=0)
    hidden = getattr(getattr(model, "config", None), "hidden_size", 0) or 0
    act_bytes = 2 * calib.numel() * hidden * 4
    hessian = 2 * widest * widest * 4 if getattr(meth, "needs_hessian", True) else 0
    free, _ = torch.cuda.mem_get_info(device)
    return ResidentLayers(int(0.7 * free) - act_bytes - 3 * layer_bytes - hessian - (2 << 30))


def prune_allotted(linears: dict, stats: dict, meth, allot: Allotment, idx: int, pattern, warn, blocksize: int,
                   percdamp: float) -> dict[str, dict]:
    """``prune_linears`` with each linear at what ``allot`` gives it for layer ``idx``."""
    rep: dict[str, dict] = {}
    for name, mod in linears.items():
        numel = L.weight_out_in(mod).numel()
        rep.update(prune_linears({name: mod}, stats, meth, allot.take(idx, numel), pattern, warn, blocksize, percdamp))
        allot.record(rep[name]["sparsity"] * numel)
    return rep


def weighted_sparsity(entries) -> float:
    entries = list(entries)
    total = sum(r["shape"][0] * r["shape"][1] for r in entries)
    return sum(r["sparsity"] * r["shape"][0] * r["shape"][1] for r in entries) / total if total else 0.0


def scan_activations(acts: Activations, windows: int) -> Activations | None:
    """A device copy of the first ``windows`` windows of ``acts`` (a capture of all the calibration
    windows) with their mini-batches and layer arguments: the very inputs, batches included, that a
    capture of those windows alone would give. None where the copy would not save a capture at
    that price: the scan reads every window (a copy would double the activations), or a mini-batch
    of ``acts`` straddles window ``windows`` (its batches would differ)."""
    k = sum(1 for _, b in acts.spans if b <= windows)
    if k == 0 or acts.spans[k - 1][1] != windows or windows >= acts.hidden.shape[0]:
        return None
    return Activations(acts.hidden[:windows].clone(), acts.spans[:k], acts.args[:k], acts.kwargs[:k])


@torch.no_grad()
def owl_scan(model: nn.Module, calib: torch.Tensor, device: torch.device, owl, skip: list[str],
             batch_size: int | None = None, layer_mover: Callable | None = None, overlap: bool = True,
             progress: Progress | None = None, resident: ResidentLayers | None = None,
             acts: Activations | None = None) -> tuple[list[float], list[int]]:
    """OWL's first pass: each decoder layer's outlier ratio (percent, ``owl.m``) and its number of
    prunable weights, on the dense model, one layer at a time on the device and nothing written
    (the layer mover runs with ``write=False``; with ``resident`` it leaves the layers' device copies
    there for the pruning pass). Reads the first ``owl.windows`` calibration windows: from ``acts``
    (the pruning pass's capture of ``calib``, ``batch_size`` windows a batch, left as it is) where
    :func:`scan_activations` allows, else from a capture of its own."""
    stack_name, layers = L.find_decoder_layers(model)
    ids = calib if owl.windows is None else calib[: owl.windows]
    n, bs = ids.shape[0], batch_size or default_batch_size(ids.shape[1])
    acts = scan_activations(acts, n) if acts is not None else None
    if acts is None or acts.spans != [(a, min(a + bs, n)) for a in range(0, n, bs)]:  # the batches of its own capture
        acts = capture_inputs(model, ids, device, bs)
    ratios, params = [], []
    mover = (layer_mover(layers, device, overlap, write=False) if layer_mover is not None
             else LayerMover(layers, device, overlap, write=False, resident=resident))
    with mover:
        for idx, layer in enumerate(layers):
            mover.load(idx)
            mover.prefetch(idx + 1)
            linears = L.find_linears(layer, prefix=f"{stack_name}.{idx}", skip=skip)
            last = idx + 1 == len(layers)
            stats = collect_stats(layer, linears, acts, False, device, write=not last) if linears else {}
            scores = []
            for name, mod in linears.items():
                if name not in stats:
                    raise SparsekitError(f"{name} received no calibration input: add it to --skip")
                scores.append(wanda_scores(L.weight_out_in(mod), stats[name].col_sq_sum))
            if not linears and not last:
                acts.run(layer, write=True)
            ratios.append(outlier_ratio(scores, owl.m))
            params.append(sum(s.numel() for s in scores))
            del stats, scores
            mover.offload(idx)
            report(progress, "outliers", idx + 1, len(layers))
    del acts
    return ratios, params
