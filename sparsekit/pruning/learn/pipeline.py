"""``learn_prune``: one-shot scores -> initial mask (layer or global allocation) -> learned mask ->
optional SparseGPT update, on a whole model. What ``prune()`` runs for ``--learn-mask`` and for
``--allocation global``; it returns a report shaped like the engine's.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from sparsekit.errors import SparsekitError
from sparsekit.hf import modules as L
from sparsekit.progress import Progress
from sparsekit.pruning.learn import schedule as sch
from sparsekit.pruning.learn.allocation import select_tiles, tile_costs
from sparsekit.pruning.learn.choices import MaskLogits, choice_index
from sparsekit.pruning.learn.config import LearnConfig
from sparsekit.pruning.learn.loop import calibration_loss, summarize, train
from sparsekit.pruning.learn.masking import final_masks, masked
from sparsekit.pruning.learn.scores import model_scores
from sparsekit.pruning.linears import layer_entry
from sparsekit.pruning.methods import Method
from sparsekit.pruning.patterns import HYBRID_MAX_SPARSITY, nm_mask


def check_learnable(method: Method, pattern, sparsity: float, learning: bool, allocation: str) -> None:
    """Refuse what mask learning / global allocation does not cover (before any work)."""
    what = "--learn-mask" if learning else "--allocation global"
    if not method.changes_weights:
        raise SparsekitError(f"{what} needs a weight method for its initial scores (wanda, sparsegpt or magnitude), not {method.name}")
    if not (pattern.is_hybrid or (pattern.is_nm and (pattern.n, pattern.m) == (2, 4))):
        raise SparsekitError(f"{what} works with --pattern hybrid[:T]{' or 2:4' if learning else ''}, not {pattern}")
    if allocation == "global" and not pattern.is_hybrid:
        raise SparsekitError("--allocation global ranks hybrid tiles: use it with --pattern hybrid[:T]")
    if pattern.is_hybrid and not 0 < sparsity <= HYBRID_MAX_SPARSITY:
        raise SparsekitError(f"{what} with pattern {pattern} needs a sparsity in (0, 0.5], got {sparsity:g}")


def initial_logits(scores: dict[str, torch.Tensor], pattern, sparsity: float, allocation: str, cfg: LearnConfig
                   ) -> dict[str, MaskLogits]:
    """Logits that favour the one-shot mask: each group's top-2 scores, and the tiles of least cost.

    Tile logits are +/- ``cfg.tile_prior`` plus the tile's standardized one-shot preference clipped
    to [-1, 1], so the one-shot ranking survives among tiles on the same side."""
    tile = pattern.tile if pattern.is_hybrid else 0
    pref = {n: -tile_costs(s, tile, normalize=allocation == "global") for n, s in scores.items()} if tile else {}
    sparse, thresh = select_tiles(pref, sparsity, allocation) if tile else ({}, {})
    out = {}
    for name, s in scores.items():
        lg = MaskLogits(tuple(s.shape), tile, device=s.device)
        lg.init_from(choice_index(nm_mask(s, 2, 4)), sparse.get(name), cfg.prior, cfg.tile_prior)
        if tile:
            p = pref[name] - thresh[name]
            with torch.no_grad():
                lg.tiles.add_((p / p.std().clamp_min(1e-12) if p.numel() > 1 else p.sign()).clamp(-1, 1))
        out[name] = lg
    return out


def learn_prune(model, calib: torch.Tensor, *, method: Method, pattern, sparsity: float, skip, device: torch.device,
                cfg: LearnConfig, allocation: str = "layer", seed: int = 0, blocksize: int = 128, percdamp: float = 0.01,
                batch_size: int | None = None, checkpoint_dir: str | Path | None = None, fingerprint: dict | None = None,
                progress: Progress | None = None, warn: Callable[[str], object] = print) -> dict:
    """Mask ``model`` in place (it ends on the CPU); returns an engine-like report plus ``learning``."""
    t_start = time.perf_counter()
    sparsity = 0.5 if pattern.is_nm else float(sparsity)
    check_learnable(method, pattern, sparsity, cfg.steps > 0, allocation)
    stack_name, layers = L.find_decoder_layers(model)
    linears = L.find_linears(layers, prefix=stack_name, skip=skip)
    if not linears:
        raise SparsekitError(f"no linear layer to prune: the skip patterns {list(skip)} exclude them all")
    for name, mod in linears.items():
        pattern.check_shape(*L.weight_out_in(mod).shape)
    update = cfg.weight_update if cfg.weight_update is not None else method.needs_hessian
    model.requires_grad_(False)
    model.eval()
    model.to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    bs = batch_size or cfg.batch_size
    scores = model_scores(model, linears, calib, method, device, bs, percdamp, warn, progress)
    logits = initial_logits(scores, pattern, sparsity, allocation, cfg)
    del scores
    init_masks = final_masks(logits, sparsity, allocation)
    learning: dict = {"init": method.name, "allocation": allocation, "steps": cfg.steps, **cfg.as_dict()}
    with masked(linears) as holders:
        fmasks = {n: m.float() for n, m in init_masks.items()}
        loss_init = calibration_loss(model, holders, fmasks, calib, device, bs) if calib is not None else None
        del fmasks
        run = {"history": [], "seconds": 0.0, "start_step": 0, "resumed_from": None}
        if cfg.steps > 0:
            if calib is None:
                raise SparsekitError("--learn-mask needs calibration data")
            run = train(model, holders, logits, calib, sparsity=sparsity, allocation=allocation, cfg=cfg, seed=seed,
                        device=device, fingerprint=fingerprint or {}, checkpoint_dir=checkpoint_dir,
                        progress=progress, warn=warn)
        keep = final_masks(logits, sparsity, allocation)
        fmasks = {n: m.float() for n, m in keep.items()}
        loss_final = calibration_loss(model, holders, fmasks, calib, device, bs) if calib is not None else None
        del fmasks
    changed = sum(int((keep[n] != init_masks[n]).sum()) for n in keep)
    learn_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del logits, init_masks
    model.to("cpu")
    keep = {n: k.cpu() for n, k in keep.items()}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    upd = None
    if update:
        if calib is None:
            raise SparsekitError("the SparseGPT update needs calibration data")
        from sparsekit.pruning.learn.update import sparsegpt_update

        upd = sparsegpt_update(model, calib, keep, device=device, blocksize=blocksize, percdamp=percdamp,
                               batch_size=batch_size, progress=progress, warn=warn)
    else:
        with torch.no_grad():
            for name, mod in linears.items():
                w = L.weight_out_in(mod)
                L.set_weight_out_in(mod, w.masked_fill(~keep[name], 0))
    del keep
    layer_reports = upd["layers"] if upd else {n: layer_entry(m) for n, m in linears.items()}
    learning.update({
        "weight_update": bool(update), "temperature_schedule": sch.describe(cfg.steps, cfg.tau, cfg.noise),
        "loss": summarize(run["history"]), "calibration_loss": {"init": loss_init, "learned_mask": loss_final},
        "mask_changes_from_init": changed, "learn_seconds": run["seconds"], "update_seconds": upd["seconds"] if upd else 0.0,
        "resumed_from": run["resumed_from"], "peak_mem_bytes": learn_peak,
    })
    peaks = [p for p in (learn_peak, upd and upd.get("peak_mem_bytes")) if p]
    return {"layers": layer_reports, "per_layer": [], "capture_seconds": 0.0, "seconds": time.perf_counter() - t_start,
            "peak_mem_bytes": max(peaks) if peaks else None, "device": str(device), "decoder_stack": stack_name,
            "learning": learning}
