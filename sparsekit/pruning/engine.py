"""Layer-sequential pruning engine: one decoder layer on the device at a time (OWL adds a read-only
first pass, ``owl_pass``).

1. Capture the inputs of decoder layer 0 once, for every method that needs calibration data
   (``capture.py``).
2. For each layer: move it alone to the device (``offload.LayerMover``); then, for a method that
   changes weights, forward hooks on its linears accumulate ``InputStats`` (``stats.py``; one shared
   object for linears fed the same tensor, e.g. q/k/v) if the method needs them, every linear is
   pruned (``linears.py``), and the layer's outputs are recomputed with the pruned weights: the next
   layer's inputs. A method that changes no weight (CATS) calibrates the layer instead
   (``Method.calibrate_layer``), writing the next layer's inputs itself. Stacked CATS (``cats=``, a
   weight method) does both: the layer's linears are pruned, then CATS calibrates the pruned layer and
   writes the next layer's inputs, thresholds applied (no recompute pass). The layer goes back to the CPU.
3. Linears outside the decoder stack follow ``outside.py``.

Peak device memory is one layer plus the calibration activations (kept in a single buffer that
each layer's outputs overwrite in place). A method that observes nothing (magnitude) needs no
calibration: no capture, no forward pass at all. The loop asks the method object what to do; it
never tests a method's name.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

import torch
from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.hf import modules as L
from sparsekit.progress import Progress, report
from sparsekit.pruning.capture import Activations, capture_inputs, default_batch_size
from sparsekit.pruning.linears import prune_linears, weight_report
from sparsekit.pruning.methods import METHODS, get_method
from sparsekit.pruning.methods.cats import require_gated_mlps
from sparsekit.pruning.offload import LayerMover
from sparsekit.pruning.outside import check_outside_linears, prune_outside_linears
from sparsekit.pruning.owl_pass import check_owl, owl_allotment, prune_allotted, resident_for, weighted_sparsity
from sparsekit.pruning.stats import collect_stats


def _device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_mem(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


class _Phases:
    """Seconds spent in each phase of a layer (synchronizing the device at each mark)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self._t = device, {}, time.perf_counter()

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":  # this stream only: background layer copies keep going
            torch.cuda.current_stream(self.device).synchronize()
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._t
        self._t = now


def prune_model(
    model: nn.Module,
    calib: torch.Tensor | None,
    *,
    method: str,
    sparsity: float,
    pattern,
    skip: Iterable[str] = ("lm_head",),
    device: str | torch.device = "cpu",
    blocksize: int = 128,
    percdamp: float = 0.01,
    batch_size: int | None = None,
    overlap: bool = True,
    progress: Progress | None = None,
    warn: Callable[[str], None] = print,
    observer: Callable[[int, Activations], None] | None = None,
    cats_sample_size: int | None = None,
    seed: int = 0,
    cats: float | None = None,
    layer_mover: Callable | None = None,
    owl=None,
) -> dict:
    """Prune ``model`` in place (it stays on the CPU; one layer at a time visits ``device``).

    ``method`` is a name of ``METHODS`` (or a ``Method``). ``calib`` is a LongTensor
    [nsamples, seqlen] of token ids (ignored by magnitude).
    ``overlap`` (CUDA only) moves layers in and out in the background while others compute.
    ``layer_mover(layers, device, overlap)``, if given, replaces ``offload.LayerMover`` (streamed
    pruning passes ``sparsekit.pruning.streamed.StreamedModel.mover``).
    ``observer(idx, acts)``, if given, sees each layer's captured inputs before its stats pass.
    ``progress`` gets ("calibration", ...) for the capture, then the method's ``progress_stage``
    ("layers"; CATS: "thresholds") per layer.
    Returns a report: per-linear sparsity/shape/kind, per-layer seconds and peak device memory,
    capture seconds, total seconds and the overall peak device memory.

    With ``method="cats"`` no weight changes (``sparsity`` is the target activation sparsity of
    each gated MLP; ``skip`` patterns also name MLPs to leave alone); the report's ``cats`` holds
    each MLP's ``threshold``, measured ``activation_sparsity`` and the sample it came from
    (``cats_sample_size`` values at most, default ``sparsekit.pruning.methods.cats.SAMPLE_SIZE``, drawn with
    ``seed``). The model is left as it was: ``sparsekit.runtime.cats.install_thresholds`` installs
    the thresholds.

    ``cats`` (with a weight method) stacks CATS on the pruning: once a layer's linears are pruned, its
    gated MLPs get thresholds for this activation sparsity, calibrated on the pruned layer (so layer i's
    thresholds see layers < i pruned and thresholded); the report's ``cats`` holds them as above.

    ``owl`` (a ``sparsekit.pruning.owl.OwlSettings``; unstructured or hybrid patterns) gives each
    decoder layer its own sparsity (OWL, ``sparsekit.pruning.owl``), ``sparsity`` being the global
    target: a first, read-only pass over the layers (``owl_pass.owl_scan``, the same one layer at a time,
    on a copy of the first ``owl.windows`` captured windows) measures each layer's outlier ratio on the dense model,
    then the layers are pruned as usual, each at its own sparsity. The report's ``allocation`` holds
    the ratios and targets, and each ``per_layer`` entry its ``target`` and ``sparsity``.
    """
    if isinstance(method, str) and method not in METHODS:
        raise SparsekitError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    meth = get_method(method)
    stacked = None if cats is None else stacked_cats(meth)
    device = torch.device(device)
    skip = list(skip)
    needs_calibration = meth.needs_calibration or stacked is not None
    if needs_calibration and calib is None:
        raise SparsekitError(f"{meth.name} needs calibration data: pass calibration windows")
    model.eval()
    stack_name, layers = L.find_decoder_layers(model)
    t_start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    meth.check_model(layers, skip)
    if stacked is not None:
        require_gated_mlps(layers, skip=skip, fix="drop --cats")
    check_outside_linears(model, stack_name, skip, meth)
    allot, allocation, resident = None, None, None
    if owl is not None:  # checked, and its device budget taken, before the capture (which that budget counts)
        check_owl(meth, pattern, calib)
        resident = resident_for(model, calib, device, overlap, layer_mover, meth)

    acts = None
    t_capture = 0.0
    if needs_calibration:
        t0 = time.perf_counter()
        bs = batch_size or default_batch_size(calib.shape[1])
        acts = capture_inputs(model, calib, device, bs, progress)
        _device_sync(device)
        t_capture = time.perf_counter() - t0
    if owl is not None:  # the read-only first pass over the dense model, on a copy of the first captured windows
        allot, allocation = owl_allotment(model, calib, meth, sparsity, pattern, owl, skip, device, batch_size,
                                          layer_mover, overlap, progress, resident, acts)  # device copies kept
    capture_peak = _peak_mem(device) or 0

    layer_reports = []
    linear_reports: dict[str, dict] = {}
    method_reports: dict[str, dict] = {}
    mover = (layer_mover(layers, device, overlap) if layer_mover is not None
             else LayerMover(layers, device, overlap, resident=resident))
    with torch.no_grad(), mover:
        for idx, layer in enumerate(layers):
            t0 = time.perf_counter()
            phases = _Phases(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            mover.load(idx)
            mover.prefetch(idx + 1)
            phases.mark("load")
            prefix = f"{stack_name}.{idx}"
            linears = L.find_linears(layer, prefix=prefix, skip=skip)
            last = idx + 1 == len(layers)
            if observer is not None and acts is not None:
                observer(idx, acts)
            stats: dict = {}
            if meth.changes_weights:
                if meth.needs_stats and linears:
                    stats = collect_stats(layer, linears, acts, meth.needs_hessian, device)
                    phases.mark("stats")
                if allot is None:
                    rep = prune_linears(linears, stats, meth, sparsity, pattern, warn, blocksize, percdamp)
                else:  # OWL: this layer's target, each linear's rounding carried into the next
                    rep = prune_allotted(linears, stats, meth, allot, idx, pattern, warn, blocksize, percdamp)
                phases.mark("prune")
                if acts is not None and not last and stacked is None:
                    acts.run(layer, write=True)  # the pruned layer's outputs: next layer's inputs
                    phases.mark("recompute")
                if stacked is not None:  # CATS on the pruned layer; writes the next layer's inputs, thresholded
                    method_reports.update(stacked.calibrate_layer(layer, prefix, acts, sparsity=cats, skip=skip,
                                                                  seed=seed, sample_size=cats_sample_size,
                                                                  write=not last))
                    phases.mark(stacked.name)
            else:
                rep = weight_report(linears)
                method_reports.update(meth.calibrate_layer(layer, prefix, acts, sparsity=sparsity, skip=skip,
                                                           seed=seed, sample_size=cats_sample_size,
                                                           write=not last))
                phases.mark(meth.name)
            linear_reports.update(rep)
            mover.offload(idx)
            phases.mark("offload")
            layer_reports.append({
                "index": idx,
                "seconds": time.perf_counter() - t0,
                "phases": phases.seconds,
                "peak_mem_bytes": _peak_mem(device),
                "linears": list(rep),
                "sparsity": weighted_sparsity(rep.values()),
            })
            if allocation is not None:
                layer_reports[-1]["target"] = allocation["target"][idx]
            del stats
            report(progress, meth.progress_stage, idx + 1, len(layers))
    linear_reports.update(prune_outside_linears(model, stack_name, skip, meth, sparsity, pattern, warn))
    del acts
    if device.type == "cuda":
        torch.cuda.empty_cache()
    peak = max([capture_peak] + [r["peak_mem_bytes"] or 0 for r in layer_reports])
    out = {
        "layers": linear_reports,
        "per_layer": layer_reports,
        "capture_seconds": t_capture,
        "seconds": time.perf_counter() - t_start,
        "peak_mem_bytes": peak if device.type == "cuda" else None,
        "device": str(device),
        "decoder_stack": stack_name,
    }
    key = stacked.report_key if stacked is not None else meth.report_key
    if key:
        out[key] = method_reports
    if allocation is not None:
        out["allocation"] = allocation
    return out


def stacked_cats(meth):
    """The CATS method that ``prune_model(..., cats=)`` stacks on ``meth`` (which must change weights)."""
    if not meth.changes_weights:
        raise SparsekitError(f"--cats stacks CATS thresholds on a weight method, and {meth.name} changes no weight: "
                             "drop --cats")
    return get_method("cats")
