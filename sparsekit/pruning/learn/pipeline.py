"""``learn_prune``: dense-model scores -> one-shot mask (layer or global allocation) -> learned mask ->
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
from sparsekit.pruning.learn.choices import MaskBank, choice_index
from sparsekit.pruning.learn.config import LearnConfig
from sparsekit.pruning.learn.layerwise import prune_layerwise
from sparsekit.pruning.learn.loop import calibration_loss, summarize, train
from sparsekit.pruning.learn.masking import final_masks, masked
from sparsekit.pruning.learn.scores import model_scores
from sparsekit.pruning.methods import METHODS, Method
from sparsekit.pruning.methods.steps import with_steps
from sparsekit.pruning.patterns import HYBRID_MAX_SPARSITY, nm_mask

_NO_UPDATE = METHODS["magnitude"]  # layerwise with a fixed mask and a method without Hessian: zero the rest


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


def initial_logits(scores: dict[str, torch.Tensor], oneshot: dict[str, torch.Tensor], pattern, cfg: LearnConfig,
                   normalize: bool) -> MaskBank:
    """Logits that favour the one-shot mask ``oneshot`` {name: bool keep-mask}.

    Groups: ``cfg.prior`` on the one-shot 2:4 choice (in dense tiles, the top-2 ``scores`` of the
    group). Tiles: +/- ``cfg.tile_prior`` for one-shot 2:4 / dense, plus the tile's standardized
    one-shot preference (minus its cost) clipped to [-1, 1], so that the ranking survives among
    tiles on the same side."""
    tile = pattern.tile if pattern.is_hybrid else 0
    dev = next(iter(scores.values())).device
    bank = MaskBank({n: tuple(s.shape) for n, s in scores.items()}, tile, device=dev)
    for name, s in scores.items():
        keep = oneshot[name].to(s.device)
        r, c = keep.shape
        pruned = (~keep).reshape(r, c // 4, 4).sum(-1)  # per group; dead inputs (SparseGPT) add zeros
        # groups the one-shot left exactly 2:4 keep its choice; the others (dense tiles, dead inputs)
        # start from the scores' top 2
        keep = torch.where((pruned == 2).repeat_interleave(4, dim=1), keep, nm_mask(s, 2, 4))
        sparse = bias = None
        if tile:  # a 2:4 tile prunes at least 2 of every group of 4
            sparse = pruned.reshape(r // tile, tile, c // tile, tile // 4).amin(dim=(1, 3)) >= 2
            p = -tile_costs(s, tile, normalize)
            p = p - p.mean()
            bias = (p / p.std().clamp_min(1e-12) if p.numel() > 1 else p.sign()).clamp(-1, 1)
        bank.init_from(name, choice_index(keep), sparse, cfg.prior, cfg.tile_prior, bias)
    return bank


def learn_prune(model, calib: torch.Tensor, *, method: Method, pattern, sparsity: float, skip, device: torch.device,
                cfg: LearnConfig, allocation: str = "layer", seed: int = 0, blocksize: int = 128, percdamp: float = 0.01,
                batch_size: int | None = None, checkpoint_dir: str | Path | None = None, fingerprint: dict | None = None,
                progress: Progress | None = None, warn: Callable[[str], object] = print, admm_iters: int | None = None) -> dict:
    """Mask ``model`` in place (on the CPU); returns an engine-like report plus ``learning``.

    1. Scores of the dense model (one pass), and for ``global`` the tiles ranked over the model.
    2. The one-shot prune, layer by layer (``layerwise``; with ``cfg.steps == 0`` that is the result).
    3. Learning, starting exactly at the one-shot result: the frozen weights are the one-shot
       weights where it kept them (SparseGPT's updated ones) and the dense weights where it pruned
       them; the result is those weights under the learned mask. With ``cfg.weight_update``, SparseGPT's
       sweep recomputes the kept weights from the dense ones for the final mask instead; with
       ``admm_iters`` (``--update admm``) ADMM does (``sparsekit.pruning.methods.admm``), that many iterations.
    """
    t_start = time.perf_counter()
    cfg = cfg.for_pattern(pattern)
    sparsity = 0.5 if pattern.is_nm else float(sparsity)
    check_learnable(method, pattern, sparsity, cfg.steps > 0, allocation)
    stack_name, layers = L.find_decoder_layers(model)
    linears = L.find_linears(layers, prefix=stack_name, skip=skip)
    if not linears:
        raise SparsekitError(f"no linear layer to prune: the skip patterns {list(skip)} exclude them all")
    for name, mod in linears.items():
        pattern.check_shape(*L.weight_out_in(mod).shape)
    admm = admm_iters is not None
    update = bool(cfg.weight_update) or admm
    learning_steps = cfg.steps > 0
    model.requires_grad_(False)
    model.eval()
    bs = batch_size or cfg.batch_size
    kw = dict(method=method, pattern=pattern, sparsity=sparsity, device=device, blocksize=blocksize,
              percdamp=percdamp, batch_size=batch_size, progress=progress, warn=warn)

    scores, tiles = None, None
    if learning_steps or allocation == "global":
        model.to(device)
        scores = model_scores(model, linears, calib, method, device, bs, percdamp, warn, progress)
        model.to("cpu")
        if allocation == "global":
            pref = {n: -tile_costs(s, pattern.tile, normalize=True) for n, s in scores.items()}
            tiles = {n: t.cpu() for n, t in select_tiles(pref, sparsity, "global")[0].items()}
    need_dense = learning_steps or (update and (not method.needs_hessian or admm))
    dense = {n: L.weight_out_in(m).detach().clone() for n, m in linears.items()} if need_dense else None
    first = prune_layerwise(model, calib, list(linears), tiles=tiles, **kw)  # the one-shot mask
    learning: dict = {"init": method.name, "allocation": allocation, **cfg.as_dict()}
    run = {"history": [], "seconds": 0.0, "start_step": 0, "resumed_from": None, "selection": None}
    loss_init = loss_final = None
    final, keep, changed, learn_peak = first, first["masks"], 0, first["peak_mem_bytes"]
    if learning_steps:
        if calib is None:
            raise SparsekitError("--learn-mask needs calibration data")
        with torch.no_grad():  # the frozen weights: the one-shot weights where it kept, the dense ones elsewhere
            for n, m in linears.items():
                L.set_weight_out_in(m, torch.where(first["masks"][n], L.weight_out_in(m), dense[n]))
        model.to(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        bank = initial_logits(scores, first["masks"], pattern, cfg, allocation == "global")
        del scores
        with masked(linears) as holders:
            loss_init = calibration_loss(model, holders, _as_float(first["masks"], device), calib, device, bs)
            n_hold = cfg.heldout_windows(calib.shape[0])
            run = train(model, holders, bank, calib[:calib.shape[0] - n_hold], sparsity=sparsity, allocation=allocation,
                        cfg=cfg, seed=seed, heldout=calib[calib.shape[0] - n_hold:] if n_hold else None,
                        device=device, fingerprint=fingerprint or {}, checkpoint_dir=checkpoint_dir,
                        progress=progress, warn=warn)
            keep = {n: k.cpu() for n, k in final_masks(bank, sparsity, allocation).items()}
            loss_final = calibration_loss(model, holders, _as_float(keep, device), calib, device, bs)
        learn_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        changed = sum(int((keep[n] != first["masks"][n]).sum()) for n in keep)
        del bank
        model.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if update and learning_steps:
        warn("a weight update after --learn-mask aims each layer at the dense layer's outputs, which can undo what "
             "the mask learned through the frozen weights (demo, hybrid 35%: 32.7 frozen, 227-299 updated; "
             "docs/results.md): compare with the frozen weights (the default)")
    if update and (learning_steps or not method.needs_hessian or admm):  # SparseGPT's sweep or ADMM, from the dense weights
        with torch.no_grad():
            for n, m in linears.items():
                L.set_weight_out_in(m, dense[n])
        del dense
        updater = with_steps(METHODS["sparsegpt"], update="admm", admm_iters=admm_iters) if admm else METHODS["sparsegpt"]
        final = prune_layerwise(model, calib, list(linears), keep=keep, stage="final", **{**kw, "method": updater})
    elif learning_steps:  # the frozen weights under the learned mask
        final = prune_layerwise(model, calib, list(linears), keep=keep, stage="final", **{**kw, "method": _NO_UPDATE})
    learning.update({
        "weight_update": bool(update), **({"update": "admm", "admm_iters": admm_iters} if admm else {}),
        "temperature_schedule": sch.describe(cfg.steps, cfg.tau, cfg.noise),
        "loss": summarize(run["history"]), "calibration_loss": {"init": loss_init, "learned_mask": loss_final},
        "mask_changes_from_init": changed, "oneshot_seconds": first["seconds"], "learn_seconds": run["seconds"],
        "update_seconds": final["seconds"] if final is not first else 0.0,
        "resumed_from": run["resumed_from"], "peak_mem_bytes": learn_peak, "selection": run["selection"],
    })
    peaks = [p for p in (learn_peak, first["peak_mem_bytes"], final["peak_mem_bytes"]) if p]
    return {"layers": final["layers"], "per_layer": final["per_layer"], "capture_seconds": 0.0, "seconds": time.perf_counter() - t_start,
            "peak_mem_bytes": max(peaks) if peaks else None, "device": str(device), "decoder_stack": stack_name,
            "learning": learning}


def _as_float(masks: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {n: m.to(device=device, dtype=torch.float32) for n, m in masks.items()}
