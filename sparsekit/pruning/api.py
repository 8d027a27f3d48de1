"""``prune()``: the library API behind ``sparsekit prune``.

Resolve the settings (defaults < recipe < arguments, a ``PruneSettings``), check the output path,
load the model on the CPU, let the method check it, draw the calibration windows if the method
needs them, run the layer-sequential engine, save the checkpoint and return a report.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterable

from sparsekit.errors import SparsekitError
from sparsekit.progress import Progress


def default_output(model: str, method: str, pattern: str, sparsity: float, cats: float | None = None) -> Path:
    """``out/<model>-<method>-<tag>`` (``-cats<pct>`` added for stacked CATS): the output directory when none is given."""
    name = Path(str(model).rstrip("/")).name or "model"
    pct = f"{sparsity * 100:.4g}".replace(".", "p")  # 0.333 -> 33p3, not 33 (0.334 would collide)
    if pattern == "unstructured":
        tag = pct
    elif pattern.startswith("hybrid"):  # the hybrid ratio varies too
        tag = f"{pattern.replace(':', '')}-{pct}"
    else:
        tag = pattern.replace(":", "of")
    if cats is not None:
        tag += "-cats" + f"{cats * 100:.4g}".replace(".", "p")
    return Path("out") / f"{name}-{method}-{tag}"


def _checkpoint_dtype(location: str):
    """The dtype the source checkpoint stores (config.json's dtype / torch_dtype), if it says."""
    import json

    import torch

    try:
        cfg = json.loads((Path(location) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(str(name))


def prune(
    model: str = "smollm2-135m",
    *,
    method: str | None = None,
    sparsity: float | None = None,
    pattern: str | None = None,
    calib: str | None = None,
    nsamples: int | None = None,
    seqlen: int | None = None,
    seed: int | None = None,
    skip: Iterable[str] | None = None,
    prune_lm_head: bool | None = None,
    device: str | None = None,
    dtype: str | None = None,
    output: str | Path | None = None,
    overwrite: bool = False,
    blocksize: int | None = None,
    damp: float | None = None,
    recipe: str | Path | None = None,
    batch_size: int | None = None,
    offload: str | None = None,
    allocation: str | None = None,
    owl_lambda: float | None = None,
    owl_m: float | None = None,
    owl_windows: int | None = None,
    update: str | None = None,
    admm_iters: int | None = None,
    refine: str | None = None,
    dsnot_cycles: int | None = None,
    learn: Any = None,
    progress: Progress | None = None,
    warn: Callable[[str], None] = print,
    cats: float | None = None,
    delete_extra: bool = False,
) -> dict[str, Any]:
    """Prune ``model`` and write the result to ``output``; returns the report (``sparsekit.json``
    plus timings, peak device memory and per-module-type sparsity).

    ``dtype`` is the compute dtype (default fp16 on CUDA, fp32 on CPU); the checkpoint is saved in
    the source checkpoint's own dtype when that is fp16/bf16 (zeros stay zeros), else in ``dtype``.
    Arguments left as None take the recipe's value, else the default (wanda, 50% unstructured,
    128 wikitext2 windows of 2048 tokens capped to the model context, seed 0, skip lm_head).
    ``skip`` patterns add to the lm_head exclusion; ``prune_lm_head=True`` lifts it.

    ``offload``: ``memory`` loads the whole model into host memory; ``disk`` streams a local (or hub
    snapshot) safetensors checkpoint layer by layer and writes each pruned layer at once (see
    ``sparsekit.pruning.streamed``); ``auto`` (default) streams when the model would not fit comfortably
    in free host memory. Both write the same tensors. The report has ``offload`` and the peak host RSS
    (``peak_host_bytes``) beside the peak device memory.

    ``method="cats"`` changes no weight: it calibrates one activation threshold per gated MLP
    (``sparsity`` is the fraction of gate activations to zero; see ``sparsekit.pruning.methods.cats``), and
    ``sparsekit.json`` records them under ``cats`` (``load_model`` installs them); ``skip`` patterns
    also name MLPs to leave dense.

    ``cats`` (with a weight method: ``prune(m, method="wanda", sparsity=0.5, cats=0.5)``) stacks both:
    each decoder layer's weights are pruned, then CATS thresholds for this activation sparsity are
    calibrated on the pruned layer; ``sparsekit.json`` holds the weight method's fields and the
    ``cats`` entry, and ``encode`` and the loader keep both.
    ``learn`` (a ``sparsekit.pruning.learn.LearnConfig``, or a dict of its fields) learns the mask
    of a hybrid or 2:4 pattern instead (``sparsekit.pruning.learn``); ``allocation="global"`` ranks
    hybrid tiles over the whole model (one-shot, or as the start of learning). Both record how the
    mask was made under ``learning`` in ``sparsekit.json``.

    ``allocation="owl"`` (unstructured or hybrid, any weight method) gives each decoder layer its own
    sparsity from its share of outlier activations (OWL, ``sparsekit.pruning.owl``; ``owl_lambda``,
    ``owl_m``: the paper's lambda 0.08 and M 5; ``owl_windows``: windows of the dense-model scan), the
    global sparsity staying ``sparsity``; it streams like any one-shot run. The report's
    ``allocation`` and ``sparsekit.json``'s ``allocation`` hold the ratios and per-layer targets.
    ``refine="dsnot"`` refines the method's mask (``sparsekit.pruning.methods.dsnot``) and
    ``update="admm"`` recomputes the kept weights with ADMM (``admm_iters`` iterations,
    ``sparsekit.pruning.methods.admm``); both need the input Hessian, gathered for any method.
    """
    from sparsekit.hf.data import check_source
    from sparsekit.host.atomic import claim_output
    from sparsekit.pruning.methods import METHODS
    from sparsekit.pruning.recipes import resolve_settings

    t0 = time.perf_counter()
    s = resolve_settings(recipe, method=method, pattern=pattern, sparsity=sparsity, dataset=calib,
                         nsamples=nsamples, seqlen=seqlen, seed=seed, skip=skip, prune_lm_head=prune_lm_head,
                         blocksize=blocksize, damp=damp, cats=cats, allocation=allocation, owl_lambda=owl_lambda,
                         owl_m=owl_m, owl_windows=owl_windows, update=update, admm_iters=admm_iters, refine=refine,
                         dsnot_cycles=dsnot_cycles)
    if isinstance(learn, dict):
        from sparsekit.pruning.learn import LearnConfig

        learn = LearnConfig(**learn)
    if learn is not None and prune_lm_head:
        raise SparsekitError("--learn-mask learns the masks of the decoder linears: drop --prune-lm-head")
    if learn is not None and s.allocation == "owl":
        raise SparsekitError("--allocation owl is a one-shot allocation: drop --learn-mask, or use --allocation layer/global")
    if learn is not None and s.refine is not None:
        raise SparsekitError("--refine works on the one-shot mask: drop --learn-mask or --refine")
    if note := s.ignored_calibration(calib=calib, nsamples=nsamples, seqlen=seqlen):
        warn(note)
    if METHODS[s.method].needs_calibration or s.cats is not None or learn is not None:
        check_source(s.dataset)   # a missing --calib file before the model loads
    if batch_size is not None and (isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1):
        raise SparsekitError(f"batch size must be a positive number of windows, got {batch_size!r}: drop --batch-size for the default")
    out = Path(output) if output is not None else default_output(model, s.method, s.pattern, s.sparsity, s.cats)
    with claim_output(out, overwrite=overwrite, warn=warn, delete_extra=delete_extra) as claim:  # checked and locked before any work
        return _prune_into(claim, model, s, out, overwrite, device, dtype, batch_size, offload, progress, warn, t0, learn)


def _prune_into(claim, model, s, out, overwrite, device, dtype, batch_size, offload, progress, warn, t0,
                learn=None) -> dict[str, Any]:
    import contextlib

    from sparsekit.hf import checkpoint
    from sparsekit.host.memory import HostPeak
    from sparsekit.pruning.streamed import StreamedModel, choose_offload
    from sparsekit.pruning.methods.cats import cats_metadata, read_thresholds, require_gated_mlps, thresholds_in_force
    from sparsekit.hf.models import load_model, model_context, open_tokenizer, resolve_device, resolve_dtype, resolve_model
    from sparsekit.pruning import engine
    from sparsekit.pruning.methods import METHODS
    from sparsekit.pruning.methods.steps import with_steps
    from sparsekit.pruning.owl import OwlSettings
    from sparsekit.pruning.patterns import Pattern

    host = HostPeak()
    dev = resolve_device(device)
    learned = learn is not None or s.allocation == "global"
    if learned:
        from sparsekit.pruning.learn.pipeline import check_learnable

        check_learnable(METHODS[s.method], Pattern.parse(s.pattern), s.sparsity, learn is not None and learn.steps > 0,
                        s.allocation)
        if s.cats is not None:
            raise SparsekitError("--cats calibrates thresholds in the one-shot layer loop; a learned or globally "
                                 "allocated mask is made elsewhere: drop --cats, then prune the result with --method cats")
        if offload == "disk":
            raise SparsekitError("--learn-mask and --allocation global need the whole model in memory: use --offload memory")
        offload = "memory"
        if dtype in (None, "auto"):
            dtype = "float32"  # fp32 weights under bf16 autocast: the logits' gradients need the range
    torch_dtype = resolve_dtype(dtype, dev)
    steps = {} if learned else dict(update=s.update, refine=s.refine, dsnot_cycles=s.dsnot_cycles)  # learned: see _learn
    meth = with_steps(METHODS[s.method], admm_iters=s.admm_iters, **steps)

    location = resolve_model(model)
    claim.add_sources([location])
    claim.check_room(_weights_bytes(location))
    save_dtype = _checkpoint_dtype(location)
    if save_dtype not in _half_dtypes():
        save_dtype = torch_dtype
    mode, directory, why = choose_offload(offload, location, torch_dtype)
    stream = None
    if mode == "disk":
        stream = StreamedModel(directory, torch_dtype, save_dtype)
        net, tokenizer = stream.model, open_tokenizer(location)
    else:
        net, tokenizer = load_model(location, device="cpu", dtype=torch_dtype)
    meth.check_model(net, s.skip)  # before the calibration data is read
    if s.cats is not None:
        require_gated_mlps(net, skip=s.skip, fix="drop --cats")
    _warn_unmatched_skip(meth.skip_targets(net), s.skip, warn)
    calib_ids = None
    calibration: dict[str, Any]
    owl = OwlSettings(s.owl_lambda, s.owl_m, s.owl_windows) if s.allocation == "owl" else None
    if (meth.needs_calibration or s.cats is not None or owl is not None
            or (learn is not None and (learn.steps > 0 or learn.weight_update))):
        from sparsekit.hf.data import calibration_windows

        ctx = model_context(net)
        if ctx is not None and s.seqlen > ctx:
            warn(f"seqlen {s.seqlen} exceeds the model context {ctx}: using {ctx}")
            s.seqlen = ctx
        if learn is not None and learn.steps > 0:  # held-out windows from text the training ones never see
            from sparsekit.pruning.learn.data import learning_windows

            calib_ids = learning_windows(s.dataset, tokenizer, s.nsamples, s.seqlen, s.seed, learn.heldout_windows(s.nsamples))
        else:
            calib_ids = calibration_windows(s.dataset, tokenizer, nsamples=s.nsamples, seqlen=s.seqlen, seed=s.seed)
        calibration = {"dataset": s.dataset, "nsamples": int(calib_ids.shape[0]),
                       "seqlen": int(calib_ids.shape[1]), "seed": s.seed}
    else:
        calibration = {"dataset": None, "nsamples": 0, "seqlen": None, "seed": None}

    # a CATS checkpoint as the source: its thresholds stay in force while a weight method prunes it
    # (CATS itself, alone or stacked, calibrates afresh)
    source_thresholds = read_thresholds(location) if meth.changes_weights and s.cats is None else {}
    with stream.writing(claim) if stream else contextlib.nullcontext() as staged:
        if stream:
            stream.load_outside(s.skip)
        with thresholds_in_force(net, source_thresholds):
            if learned:
                report = _learn(net, calib_ids, s, meth, dev, learn, out, model, calibration, batch_size, progress, warn)
            else:
                report = engine.prune_model(
                    net, calib_ids, method=meth, sparsity=s.sparsity, pattern=Pattern.parse(s.pattern),
                    skip=s.skip, device=dev, blocksize=s.blocksize, percdamp=s.damp, batch_size=batch_size,
                    progress=progress, warn=warn, seed=s.seed, cats=s.cats,
                    layer_mover=stream.mover if stream else None, owl=owl,
                )
        if not report["layers"] and meth.changes_weights:
            raise SparsekitError(f"no linear layer was pruned: the skip patterns {s.skip} exclude them all")
        if stream:
            stream.write_outside()
        if save_dtype != torch_dtype:  # a value rounding to zero in the saved dtype counts as pruned
            if stream:
                stream.recount(report["layers"])
            else:
                _recount_sparsity(net.to(save_dtype), report["layers"])
        elapsed = time.perf_counter() - t0
        extra = meth.metadata(report, s.sparsity)
        if s.cats is not None:  # stacked: the same entry as --method cats writes
            extra["cats"] = cats_metadata(report["cats"], s.cats)
        meta = checkpoint.build_metadata(
            model=str(model), method=s.method, pattern=s.pattern, sparsity=s.sparsity,
            calibration=calibration, skip=s.skip, layers=report["layers"], elapsed_s=elapsed, **extra,
        )
        if "learning" in report:
            meta.learning = report["learning"]
        for key in ("update", "refine"):  # written as top-level keys of sparsekit.json
            if getattr(s, key) is not None:
                meta.extra[key] = {"update": {"kind": s.update, "iters": s.admm_iters},
                                   "refine": {"kind": s.refine, "cycles": s.dsnot_cycles}}[key]
        if "allocation" in report:
            meta.extra["allocation"] = {k: v for k, v in report["allocation"].items() if k != "scan_seconds"}
        if stream:
            stream.finish(staged, tokenizer, meta, Path(out))
        else:
            checkpoint.save_pruned(net, tokenizer, out, meta, overwrite=overwrite)
    return {
        **meta.to_dict(),
        "output": str(out),
        "device": str(dev),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "saved_dtype": str(save_dtype).removeprefix("torch."),
        "settings": s.as_dict(),
        "prune_seconds": report["seconds"],
        "capture_seconds": report["capture_seconds"],
        "peak_mem_bytes": report["peak_mem_bytes"],
        "peak_host_bytes": host.peak(),
        "offload": mode,
        "offload_reason": why,
        "per_layer": report["per_layer"],
        **({"allocation": report["allocation"]} if "allocation" in report else {}),
        "by_type": sparsity_by_type(report["layers"]),
        "overall_sparsity": overall_sparsity(report["layers"]),
        "elapsed_s": time.perf_counter() - t0,
    }


def _learn(net, calib_ids, s, meth, dev, learn, out, model, calibration, batch_size, progress, warn) -> dict:
    from sparsekit.pruning.learn import LearnConfig
    from sparsekit.pruning.learn.pipeline import learn_prune
    from sparsekit.pruning.patterns import Pattern

    pattern = Pattern.parse(s.pattern)
    cfg = (learn if learn is not None else LearnConfig(steps=0)).for_pattern(pattern)
    ckpt = cfg.checkpoint_dir or f"{Path(out)}-checkpoints"
    fingerprint = {"model": str(model), "method": s.method, "pattern": s.pattern, "sparsity": s.sparsity,
                   "allocation": s.allocation, "seed": s.seed, "calibration": calibration, "skip": list(s.skip),
                   **({"update": s.update, "admm_iters": s.admm_iters} if s.update else {}),
                   **cfg.fingerprint()}
    rep = learn_prune(net, calib_ids, method=meth, pattern=pattern, sparsity=s.sparsity, skip=s.skip,
                      device=dev, cfg=cfg, allocation=s.allocation, seed=s.seed, blocksize=s.blocksize,
                      percdamp=s.damp, batch_size=batch_size, checkpoint_dir=ckpt, fingerprint=fingerprint,
                      progress=progress, warn=warn, admm_iters=s.admm_iters if s.update == "admm" else None)
    if cfg.checkpoint_every:
        rep["learning"]["checkpoint_dir"] = ckpt
    return rep


def _weights_bytes(location: str) -> int:
    """The size of a local checkpoint's weight files: the estimate of the pruned checkpoint's size."""
    p = Path(location)
    if not p.is_dir():
        return 0
    return sum(f.stat().st_size for f in p.iterdir() if f.suffix in (".safetensors", ".bin") and f.is_file())


def _warn_unmatched_skip(names: list[str], skip: list[str], warn: Callable[[str], None]) -> None:
    """A --skip pattern that names none of ``names`` (the method's ``skip_targets``) is most likely a
    typo: say so before the work."""
    from sparsekit.hf.modules import matches_skip

    for pat in skip:
        if not any(matches_skip(n, [pat]) for n in names):
            warn(f"--skip pattern {pat!r} matches no linear layer of this model (e.g. {names[0] if names else '-'}): "
                 f"check the spelling")


def _recount_sparsity(model, layers: dict[str, dict]) -> None:
    from sparsekit.hf.modules import weight_out_in

    for name, r in layers.items():
        w = weight_out_in(model.get_submodule(name))
        r["sparsity"] = float((w == 0).sum().item() / w.numel())


def _half_dtypes():
    import torch

    return (torch.float16, torch.bfloat16)


def module_type(name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``self_attn.q_proj`` (the name below the layer index)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[i + 1:]) or name
    return name


def sparsity_by_type(layers: dict[str, dict]) -> dict[str, dict]:
    agg: dict[str, list[float]] = {}
    for name, r in layers.items():
        n = r["shape"][0] * r["shape"][1]
        z, t = agg.setdefault(module_type(name), [0.0, 0.0])
        agg[module_type(name)] = [z + r["sparsity"] * n, t + n]
    return {k: {"sparsity": z / t if t else 0.0, "params": int(t)} for k, (z, t) in agg.items()}


def overall_sparsity(layers: dict[str, dict]) -> float:
    z = sum(r["sparsity"] * r["shape"][0] * r["shape"][1] for r in layers.values())
    t = sum(r["shape"][0] * r["shape"][1] for r in layers.values())
    return z / t if t else 0.0
