"""The disk-backed mode of ``scripts.bench.prune`` (``--disk``): streamed pruning against in-memory.

For each ``SHAPE:N`` a random-weight fp16 Llama checkpoint of the shape's first N decoder layers is
written to ``--workdir`` (5 GB shards, tensor by tensor: the host never holds more than one tensor),
fsynced and, unless ``--warm-cache``, dropped from the page cache (``posix_fadvise(DONTNEED)``) so
that the streamed run really reads the disk. Then it is pruned with 128 x 2048 random token ids:

- ``memory``: ``from_pretrained`` (whole model in host memory), the engine, ``save_pruned``: what
  ``sparsekit prune --offload memory`` does;
- ``disk``: a ``StreamedModel`` (meta skeleton, layers read from the memory-mapped shards and each
  pruned layer written at once into the output shards): what ``--offload disk`` does.

Both go through the atomic output directory. Each run reports its layer-loop time, end-to-end time
(load + prune + save), peak GPU memory and peak host RSS (``sparsekit.host.memory.HostPeak``: the
kernel's high-water mark, reset before the run). Times of the N layers are extrapolated to the
shape's full depth: end-to-end minus the N layers' time plus the mean layer time (the first layer,
which waits for its read, left out of the mean) times the full depth. The host-memory target is
3 decoder layers + the embeddings + 2 GiB.
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch


def _config(shape: str, layers: int):
    from transformers import LlamaConfig

    from scripts.common import SHAPES

    cfg = dict(SHAPES[shape], num_hidden_layers=layers)
    config = LlamaConfig(**cfg)
    config.dtype = torch.float16
    return config, SHAPES[shape]["num_hidden_layers"]


def write_checkpoint(shape: str, layers: int, out: Path, device: str, cold: bool, seed: int = 0) -> dict:
    """A random-weight fp16 checkpoint of ``layers`` layers of ``shape`` in ``out`` (module doc)."""
    from sparsekit.hf.compat import meta_skeleton
    from sparsekit.hf.streaming import ParamSlots, ShardedWriter

    config, _ = _config(shape, layers)
    model = meta_skeleton(config, torch.float16)
    slots = ParamSlots(model)
    names = [n for n in slots.names() if slots.original[n].device.type == "meta"]
    plan = [(n, torch.float16, list(slots.original[n].shape)) for n in names]
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    writer = ShardedWriter(out, plan, 5 * 10**9)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, _, shape_ in plan:
        if len(shape_) == 1:
            t = torch.ones(shape_, dtype=torch.float16)
        else:
            std = 1.0 if "embed" in name else 0.02
            t = torch.randn(shape_, generator=g, device=device, dtype=torch.float16).mul_(std).cpu()
        writer.write(name, t)
        del t
    writer.close()
    config.save_pretrained(out)
    files = sorted(out.glob("*.safetensors"))
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        if cold:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    layer = model.model.layers[0]
    return {"seconds": round(time.perf_counter() - t0, 1), "bytes": sum(f.stat().st_size for f in files),
            "layer_bytes": sum(p.numel() * 2 for p in layer.parameters()),
            "embed_bytes": model.model.embed_tokens.weight.numel() * 2, "shards": len(files)}


def prune_once(src: Path, out: Path, mode: str, method: str, calib, device: str) -> dict:
    """One prune of ``src`` into ``out``, ``mode`` memory or disk (module doc); its measurements."""
    from transformers import AutoModelForCausalLM

    from sparsekit.host.atomic import claim_output
    from sparsekit.hf.checkpoint import save_pruned
    from sparsekit.hf.metadata import PruneMetadata
    from sparsekit.host.memory import HostPeak
    from sparsekit.pruning.engine import prune_model
    from sparsekit.pruning.streamed import StreamedModel

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    dtype = torch.float16 if device == "cuda" else torch.float32
    warnings: list[str] = []
    host = HostPeak()
    t0 = time.perf_counter()
    kw = dict(method=method, sparsity=0.5, pattern=_unstructured(), skip=["lm_head"], device=device,
              warn=warnings.append)
    with claim_output(out, overwrite=True) as claim:
        if mode == "memory":
            model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).eval()
            t_load = time.perf_counter() - t0
            rep = prune_model(model, calib, **kw)
            t1 = time.perf_counter()
            if dtype != torch.float16:
                model.to(torch.float16)
            save_pruned(model, None, out, PruneMetadata(), overwrite=True)
            t_save = time.perf_counter() - t1
            del model
        else:
            stream = StreamedModel(str(src), dtype, torch.float16)
            with stream.writing(claim) as tmp:
                stream.load_outside(["lm_head"])
                t_load = time.perf_counter() - t0
                rep = prune_model(stream.model, calib, layer_mover=stream.mover, **kw)
                t1 = time.perf_counter()
                stream.write_outside()
                stream.finish(tmp, None, {})
                t_save = time.perf_counter() - t1
            del stream
    total = time.perf_counter() - t0
    per = [r["seconds"] for r in rep["per_layer"]]
    waits = [r["phases"].get("load", 0.0) for r in rep["per_layer"]]
    sp = [v["sparsity"] for v in rep["layers"].values()]
    return {"mode": mode, "method": method, "seconds": round(total, 2), "load_s": round(t_load, 2),
            "capture_s": round(rep["capture_seconds"], 2), "loop_s": round(sum(per), 2),
            "save_s": round(t_save, 2), "per_layer_s": [round(x, 3) for x in per],
            "layer_wait_s": round(sum(waits), 2),
            "peak_gpu_bytes": rep["peak_mem_bytes"], "peak_host_bytes": host.peak(),
            "host_peak_exact": host.exact, "host_start_bytes": host.start,
            "sparsity": [round(min(sp), 4), round(max(sp), 4)], "warnings": len(warnings)}


def _unstructured():
    from sparsekit.pruning.patterns import Pattern

    return Pattern.parse("unstructured")


def _spec(text: str) -> tuple[str, int]:
    shape, _, n = text.partition(":")
    return shape, int(n or 4)


def _extrapolate(r: dict, full: int) -> float:
    per = r["per_layer_s"]
    steady = per[1:] or per
    return r["seconds"] - sum(per) + full * sum(steady) / len(steady)


def disk_bench(args) -> int:
    device = "cpu" if args.smoke else args.device
    nsamples, seqlen = (4, 64) if args.smoke else (args.nsamples, args.seqlen)
    jobs = [(s, "compare") for s in args.compare] + [(s, "stream") for s in args.stream]
    if args.smoke:
        jobs = [("toy:3", "compare"), ("toy:2", "stream")]
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and device == "cuda" else None,
            "torch": torch.__version__, "python": platform.python_version(),
            "command": "python " + " ".join(sys.argv), "calibration": f"{nsamples} x {seqlen} random token ids",
            "page_cache": "warm" if args.warm_cache else "dropped after writing (reads hit the disk)"}
    print(json.dumps(info), flush=True)
    work = Path(args.workdir)
    rows = []
    t_start = time.perf_counter()
    try:
        for spec, kind in jobs:
            shape, n = _spec(spec)
            if shape not in ("llama2-7b", "llama2-70b", "toy"):
                raise SystemExit(f"--disk shapes: llama2-7b, llama2-70b (got {shape})")
            src = work / f"{shape}-{n}"
            if args.budget_s and time.perf_counter() - t_start > args.budget_s:
                print(json.dumps({"skipped": [shape, n], "why": "--budget-s"}), flush=True)
                continue
            ck = write_checkpoint(shape, n, src, "cuda" if device == "cuda" else "cpu", cold=not args.warm_cache)
            full = _config(shape, n)[1]
            print(json.dumps({"checkpoint": str(src), **ck}), flush=True)
            vocab = _config(shape, n)[0].vocab_size
            calib = torch.randint(0, vocab, (nsamples, seqlen), generator=torch.Generator().manual_seed(0))
            if (args.warmup or args.smoke) and spec == jobs[0][0]:  # CUDA / kernel warm-up, once
                prune_once(src, work / "warmup", "disk", "wanda", calib[: min(8, nsamples), : min(512, seqlen)], device)
                shutil.rmtree(work / "warmup", ignore_errors=True)
            for method in args.methods:
                for mode in (("memory", "disk") if kind == "compare" else ("disk",)):
                    same = [x["seconds"] for x in rows if x["shape"] == shape and x["method"] == method]
                    other = [x["seconds"] for x in rows if x["shape"] == shape]
                    guess = max(same) if same else 3 * max(other, default=0)  # SparseGPT takes ~3x Wanda
                    if args.budget_s and time.perf_counter() - t_start + guess > args.budget_s:
                        print(json.dumps({"skipped": [shape, n, method, mode], "why": "--budget-s"}), flush=True)
                        continue
                    if not args.warm_cache:  # every run starts from the disk, not from the previous run's cache
                        _drop_cache(src)
                    r = prune_once(src, work / "out", mode, method, calib, device)
                    shutil.rmtree(work / "out", ignore_errors=True)
                    r.update(shape=shape, layers=n, full_layers=full, extrapolated_s=round(_extrapolate(r, full), 1),
                             host_bound_bytes=3 * ck["layer_bytes"] + ck["embed_bytes"] + 2 * 2**30)
                    print(json.dumps(r), flush=True)
                    rows.append(r)
            shutil.rmtree(src, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "results": rows}, indent=2))
    print(markdown(rows, info))
    return 0


def _drop_cache(src: Path) -> None:
    for f in src.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def markdown(rows: list[dict], info: dict) -> str:
    gib = lambda b: "-" if b is None else f"{b / 2**30:.1f}"  # noqa: E731
    lines = [f"\n{info.get('gpu') or 'CPU'}, {info['date']}, {info['calibration']}, page cache {info['page_cache']}",
             "", "| shape | layers | method | weights | s/layer | loop s | end-to-end s | extrapolated s (full depth) "
             "| peak GPU GiB | peak host GiB | host target GiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per = r["per_layer_s"][1:] or r["per_layer_s"]
        lines.append(f"| {r['shape']} | {r['layers']} of {r['full_layers']} | {r['method']} | "
                     f"{'streamed' if r['mode'] == 'disk' else 'in memory'} | {sum(per) / len(per):.2f} | {r['loop_s']:.1f} | "
                     f"{r['seconds']:.1f} | {r['extrapolated_s']:.0f} ({r['extrapolated_s'] / 60:.1f} min) | "
                     f"{gib(r['peak_gpu_bytes'])} | {gib(r['peak_host_bytes'])} | "
                     f"{gib(r['host_bound_bytes']) if r['mode'] == 'disk' else '-'} |")
    by = {(r["shape"], r["layers"], r["method"], r["mode"]): r for r in rows}
    for (shape, n, method, mode), r in by.items():
        if mode == "disk" and (shape, n, method, "memory") in by:
            m = by[(shape, n, method, "memory")]
            lines.append(f"\n{shape} ({n} layers) {method}: streamed / in memory = {r['seconds'] / m['seconds']:.3f} end to end, "
                         f"{r['loop_s'] / m['loop_s']:.3f} layer loop")
    if any(not r["host_peak_exact"] for r in rows):
        lines.append("\npeak host: /proc/self/clear_refs was not writable, so each figure is the process peak so far")
    lines.append("\ns/layer: mean over the measured layers but the first; extrapolated: end-to-end time with the "
                 "measured layers replaced by s/layer x the full depth (an estimate, not a measurement)")
    return "\n".join(lines)
