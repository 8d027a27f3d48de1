"""``sparsekit eval --speed``: prefill and decode throughput, packed model vs its dense twin.

For each batch size the packed model and its dense counterpart (the very same weights decoded
into ``nn.Linear``, so cuBLAS runs them) are timed in the same process on the same GPU:

* prefill: one forward over ``batch x prompt_len`` tokens into a static cache, the fastest of
  rounds of at least 15 runs that agree (see ``_prefill_ms``), timed with CUDA events -> prefill tokens/s;
* decode: ``new_tokens`` greedy steps, each one replay of a CUDA graph of the decode step
  (``sparsekit.runtime.decoder``; eager with ``cuda_graphs=False``; each decoder layer compiled with
  ``torch.compile`` unless ``compile=False``), median over ``repeats`` ->
  ms per token (one step) and decode tokens/s (= batch / step time);
* peak GPU memory (``torch.cuda.max_memory_allocated``) over that batch size's run.

The packed model is measured first; then it is densified in place and measured again, so the two
never sit on the GPU together. Random prompt tokens (fixed seed); EOS is ignored.

A model with CATS thresholds (``sparsekit prune --method cats``, or ``--cats`` stacked on a weight
method) counts as sparse even without a packed linear: its gated MLPs go onto the CATS kernels
(``sparsekit.runtime.cats_mlp.enable_cats_kernels``, where that module exists and can run: CUDA, fp16)
before the fusions, or run their thresholds as a masked activation otherwise. The dense twin has the
original MLPs back, without thresholds (``runtime.cats.remove_thresholds``).
"""
from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparsekit.errors import SparsekitError, strict_mode
from sparsekit.runtime.timing import model_bytes, time_ms
from sparsekit.hf.models import resolve_device
from sparsekit.packed.shards import is_packed_dir
from sparsekit.progress import Progress, report
from sparsekit.runtime.decoder import GreedyDecoder
from sparsekit.hf.modules import set_submodule
from sparsekit.runtime.cats import cats_activations, remove_thresholds
from sparsekit.runtime.fusion import fuse_projections, prepare_for_decode
from sparsekit.runtime.loader import load_packed, open_model
from sparsekit.runtime.dispatch import plan_dispatch
from sparsekit.runtime.sparse_linear import SparseLinear
from sparsekit.runtime.swap import densify, sparsify

BATCH_SIZES = (1, 8, 16, 32)
PREFILL_REPEATS = 15
GIB = 2**30


def measure_model(model: nn.Module, batch_size: int, *, prompt_len: int = 128, new_tokens: int = 64,
                  repeats: int = 3, cuda_graphs: bool = True, compile: bool = True,
                  seed: int = 0) -> dict[str, Any]:
    """Prefill/decode speed and peak memory of one model at one batch size (on its CUDA device).

    With ``compile`` the model's packed sizes should be equalized first (``fusion.prepare_for_decode``)."""
    device = next(model.parameters()).device
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 1000))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, prompt_len), generator=gen).to(device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    dec = None
    try:
        dec = GreedyDecoder(model, batch_size, prompt_len + new_tokens + 1, use_graph=cuda_graphs,
                            compile=compile)
        prefill_ms, prefill_median = _prefill_ms(dec, ids, max(repeats, PREFILL_REPEATS))

        def decode_loop():
            for _ in range(new_tokens):
                dec.step()

        step_ms = []
        for r in range(repeats + 1):
            dec.prefill(ids)
            if cuda_graphs and dec.graph is None:
                dec.capture()
            ms = time_ms(decode_loop)
            if r > 0:  # the first loop is a warm-up
                step_ms.append(ms / new_tokens)
        step_ms = statistics.median(step_ms)
        peak = torch.cuda.max_memory_allocated(device)
        extra = {"notes": dec.notes} if dec.notes else {}
        return {**extra,
                "compiled": dec.compile,
            "prefill_ms": prefill_ms,
            "prefill_ms_median": prefill_median,
            "prefill_tok_s": batch_size * prompt_len / (prefill_ms / 1e3),
            "ms_per_token": step_ms,
            "decode_tok_s": batch_size / (step_ms / 1e3),
            "peak_mem_gib": peak / GIB,
        }
    except torch.cuda.OutOfMemoryError:
        return {"error": "out of GPU memory"}
    finally:
        del dec
        torch.cuda.empty_cache()


def _prefill_ms(dec: GreedyDecoder, ids: torch.Tensor, repeats: int, *, agree: float = 0.02,
                max_rounds: int = 8) -> tuple[float, float]:
    """``(fastest, median)`` milliseconds of one eager prefill, after two warm-ups (kernels compile, the
    cache and the allocator's blocks are made), with Python's garbage collector held off.

    A small model's prefill is bound by the host launching a few hundred kernels (~17 ms for the demo
    at any batch on an H100), and for seconds after a ``torch.compile`` the host is slower still: on
    2026-11-25 the median of 15 runs, and even their fastest, came out 20-80% high for whichever model
    was measured right after a compile. So runs come in rounds of ``repeats``, until the fastest runs
    of two consecutive rounds agree within ``agree`` (at most ``max_rounds`` rounds); the report's
    ``prefill_ms`` is the fastest run, ``prefill_ms_median`` the last round's median."""
    dec.prefill(ids)
    dec.prefill(ids)
    best, last = float("inf"), None
    gc.collect()
    gc.disable()
    try:
        for _ in range(max_rounds):
            times = [time_ms(lambda: dec.prefill(ids)) for _ in range(repeats)]
            fastest = min(times)
            settled = last is not None and abs(fastest - last) <= agree * min(fastest, last)
            best, last = min(best, fastest), fastest
            if settled:
                break
    finally:
        gc.enable()
    return best, statistics.median(times)


def dense_layers_note(dispatch: dict, n_sparse: int) -> str:
    """One line: how many sparse layers run dense, and each shape that does so once, with its speed."""
    shapes = [f"{g['shape'][0]}x{g['shape'][1]} ({g['timings'][0]['speedup']:.2f}x at N={g['timings'][0]['n']})"
              for g in dispatch["groups"] if g.get("form") == "dense"]
    return (f"{len(dispatch['dense_layers'])} of {n_sparse} sparse layers run dense: the sparse kernel is slower "
            f"than cuBLAS at every token count for {', '.join(shapes)}")


def _open(model_dir, device, dtype, notes: list[str]) -> nn.Module:
    """The model of ``model_dir`` through the one loader; an unpacked one is encoded in memory."""
    path = Path(model_dir)
    if is_packed_dir(path):
        return load_packed(path, device=device, dtype=dtype)
    if not (path / "config.json").exists():
        raise SparsekitError(f"no model at {path}: pass a packed directory (from `sparsekit encode`) or a pruned HF directory")
    model = open_model(path, device, dtype)
    swapped = sparsify(model)
    notes.append(f"{path} is not packed: {len(swapped)} linears whose packed bytes gain were encoded in memory "
                 "(the rule of `sparsekit encode`)")
    return model


def enable_cats(model: nn.Module, notes: list[str]) -> int:
    """Put the gated MLPs that carry CATS thresholds onto the CATS kernels, where they can run;
    returns how many. 0 (the MLPs keep their masked activation) when ``sparsekit.runtime.cats_mlp`` is
    not there, or cannot run here (not CUDA fp16, kernels missing); ``notes`` hears why if not obvious."""
    from sparsekit.runtime.cats_mlp import enable_cats_kernels

    n = int(enable_cats_kernels(model))
    reasons = sorted({why for why in getattr(model, "cats_kernel_report", {}).values() if not why.startswith("kernels")})
    if reasons:
        notes.append("CATS MLPs kept on the masked activation: " + "; ".join(reasons))
    return n


def restore_dense_mlps(model: nn.Module, originals: dict[str, nn.Module]) -> int:
    """Undo :func:`enable_cats` and the thresholds: the ``originals`` (``{name: gated MLP}`` taken before)
    back in place, without their ``CatsActivation``. Returns how many thresholds were removed."""
    for name, mlp in originals.items():
        set_submodule(model, name, mlp)
    return remove_thresholds(model)


def measure_speed(model_dir, *, device="cuda", batch_sizes=BATCH_SIZES, prompt_len: int = 128,
                  new_tokens: int = 64, repeats: int = 3, cuda_graphs: bool = True,
                  dtype: torch.dtype = torch.float16, fuse_norms: bool = True, compile: bool = True,
                  fuse_proj: bool = True, prefer: str = "speed",
                  progress: Progress | None = None) -> dict[str, Any]:
    """Speed report of a packed model and its dense counterpart (see the module docstring).

    ``fuse_norms`` swaps the HF RMSNorm modules for ``fusion.FusedRMSNorm`` (same rounding,
    two launches instead of eight) in both models: decode steps are launch-bound outside the
    matmuls, so this is what lets the matmul speed-up show. ``compile`` goes further: each
    decoder layer of the decode step runs through ``torch.compile`` (see ``sparsekit.runtime.decoder``),
    again in both models; when compiling fails the step runs uncompiled and ``notes`` says so.
    ``fuse_proj`` merges q/k/v and gate/up into one matmul each (``fusion.fuse_projections``),
    in both models too. ``prefer`` (``"speed"`` or ``"memory"``) goes to
    ``runtime.dispatch.plan_dispatch``, which times each group of sparse layers against cuBLAS at
    load and runs each in its faster form (the report's ``dispatch``). ``progress("measuring speed", 0, total)`` comes first, then one call per
    step done, named after it ("loaded", "packed batch 8", ...).
    """
    if not torch.cuda.is_available():
        raise SparsekitError("speed measurement needs a CUDA GPU and none is available: run `sparsekit eval --speed` on a GPU machine")
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise SparsekitError(f"speed measurement runs on a CUDA GPU, not {dev}: pass device='cuda'")
    batch_sizes = tuple(int(b) for b in batch_sizes)
    if not batch_sizes or min(batch_sizes) < 1:
        raise SparsekitError(f"batch sizes must be positive integers, got {batch_sizes}")
    if prompt_len < 1 or new_tokens < 2 or repeats < 1:
        raise SparsekitError("prompt_len >= 1, new_tokens >= 2 and repeats >= 1 are needed")
    notes: list[str] = []
    done, total = 0, 2 * len(batch_sizes) + 1

    def tick(stage: str) -> None:
        nonlocal done
        done += 1
        report(progress, stage, done, total)

    report(progress, "measuring speed", 0, total)
    t0 = time.perf_counter()
    model = _open(model_dir, dev, dtype, notes)
    cats_mlps = {name: model.get_submodule(name) for name in cats_activations(model)}
    n_cats_kernels = enable_cats(model, notes) if cats_mlps else 0
    if cats_mlps and n_cats_kernels < len(cats_mlps):
        notes.append(f"{len(cats_mlps) - n_cats_kernels} of {len(cats_mlps)} CATS MLPs run their thresholds as a "
                     "masked activation: no faster than without CATS")
    # equalized now, before any kernel call: one compiled layer then serves the whole stack
    prepare_for_decode(model, fuse_norms=fuse_norms, fuse_proj=fuse_proj, equalize=compile)
    n_sparse = sum(isinstance(m, SparseLinear) for m in model.modules())
    if n_sparse == 0 and not cats_mlps:
        notes.append("no sparse layers: both columns measure the same dense model")
    phases = {"load_s": time.perf_counter() - t0}
    dispatch = plan_dispatch(model, prefer=prefer, token_counts=sorted(set(batch_sizes) | {1}))
    phases["dispatch_s"] = time.perf_counter() - t0 - phases["load_s"]
    if dispatch["dense_layers"]:
        notes.append(dense_layers_note(dispatch, n_sparse))
    if "error" in dispatch.get("cache", {}):
        notes.append(dispatch["cache"]["error"])
    if dispatch["dense_copy_bytes"]:
        notes.append(f"dense copies kept for token counts above each layer's crossover: "
                     f"{dispatch['dense_copy_bytes'] / GIB:.3f} GiB (--prefer memory keeps none)")
    tick("loaded")
    kw = dict(prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats, compile=compile)

    def run_all(label: str) -> dict[int, dict]:
        nonlocal cuda_graphs
        out = {}
        for b in batch_sizes:
            try:
                out[b] = measure_model(model, b, cuda_graphs=cuda_graphs, **kw)
            except SparsekitError as e:
                if not cuda_graphs or strict_mode():
                    raise
                notes.append(f"CUDA graphs failed, measured eagerly instead (slower): {e}")
                cuda_graphs = False
                out[b] = measure_model(model, b, cuda_graphs=False, **kw)
            for note in out[b].pop("notes", []):
                if note not in notes:
                    notes.append(note)
            tick(f"{label} batch {b}")
        return out

    packed_bytes = model_bytes(model)
    t1 = time.perf_counter()
    packed = run_all("packed")
    phases["packed_s"] = time.perf_counter() - t1
    if cats_mlps:  # the dense twin: the original MLPs, no thresholds
        restore_dense_mlps(model, cats_mlps)
    densify(model)
    if cats_mlps and n_cats_kernels and fuse_proj:
        fuse_projections(model)  # the restored MLPs' gate/up, as prepare_for_decode fused the others'
    torch.cuda.empty_cache()
    dense_bytes = model_bytes(model)
    t1 = time.perf_counter()
    dense = run_all("dense")
    phases["dense_s"] = time.perf_counter() - t1
    del model
    torch.cuda.empty_cache()

    rows = []
    for b in batch_sizes:
        p, d = packed[b], dense[b]
        ratio = {}
        for key in ("prefill_tok_s", "decode_tok_s"):
            if key in p and key in d and d[key] > 0:
                ratio[key] = p[key] / d[key]
        rows.append({"batch_size": b, "packed": p, "dense": d, "ratio": ratio})
    import transformers

    return {
        "model": str(model_dir),
        "gpu": torch.cuda.get_device_name(dev),
        "dtype": str(dtype).replace("torch.", ""),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "cuda_graphs": cuda_graphs,
        "fused_norms": fuse_norms,
        "fused_projections": fuse_proj,
        "compiled": all(r.get("compiled", False) for d in (packed, dense) for r in d.values()),
        "sparse_layers": n_sparse,
        "cats_mlps": len(cats_mlps),  # gated MLPs with CATS thresholds (sparse activations)
        "cats_kernel_mlps": n_cats_kernels,  # of which on the CATS kernels
        "dispatch": dispatch,
        "weights_gib": {"packed": packed_bytes / GIB, "dense": dense_bytes / GIB},
        "rows": rows,
        "notes": notes,
        "elapsed_s": time.perf_counter() - t0,
        "phases_s": phases,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
