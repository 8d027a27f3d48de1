"""``sparsekit eval --speed``: prefill and decode throughput, packed model vs its dense twin.

For each batch size the packed model and its dense twin (the very same weights decoded into
``nn.Linear``, so cuBLAS runs them) are timed in the same process on the same GPU:

* prefill: one eager forward over ``batch x prompt_len`` tokens into a static cache, timed with CUDA
  events -> prefill tokens/s (from the fastest run);
* decode: ``new_tokens`` greedy steps, each one replay of a CUDA graph of the decode step
  (``sparsekit.runtime.decoder``; eager with ``cuda_graphs=False``; each decoder layer compiled with
  ``torch.compile`` unless ``compile=False``), median over ``repeats`` loops -> ms per token (one
  step) and decode tokens/s (= batch / step time);
* peak GPU memory (``torch.cuda.max_memory_allocated``) of each model at that batch size, the other
  model's bytes taken out.

Paired, interleaved (the default; ``speed_runs.measure_pair``). Both models stay on the GPU at once: the dense
twin (``speed_twin.dense_twin``) shares every tensor of the packed model outside its ``SparseLinear`` layers,
and those become ``nn.Linear`` on their dispatch dense copy, or decoded where there is none. Per batch size:
each model's decoder is built, prefilled and its decode step captured (compiling at the first two batch
sizes), and a few untimed steps replayed; then ``repeats`` decode rounds and ``PREFILL_ROUNDS`` prefill rounds
(more, up to ``PREFILL_MAX_ROUNDS``, while the median's interval is wider than +-3%) alternate dense, packed,
dense, packed, ... A prefill round is ``PREFILL_RUNS`` runs of each model, taking
turns dense, packed, packed, dense, ... (the host's pace drifts: on an H100 the second side of 34 of 56 demo
rounds of identical matmuls came out slower), and each run is paired with the other model's run beside it. The
prefill ratio reported is the **median of those paired ratios** (packed tokens/s over dense, i.e. dense time
over packed time), so a slow phase of the host (for seconds after a ``torch.compile``; a prefill of the demo is
~20 ms of launching a few hundred kernels, bound by the host) hits both sides of a pair alike instead of one
model's whole phase. Decode is paired the same way because that costs nothing: the same timed loops as
before, only ordered alternately. Prefill is timed last in each batch size, furthest from its compile. The
rows keep each model's absolute figures (fastest prefill, median decode step) and, under ``paired``, every
pair's ratio and milliseconds.

Sequential (the fallback). Where the dense twin and both models' KV caches and activations would not
fit in the free GPU memory (``speed_twin.pairing_obstacle``: an estimate from the parameter bytes and
the config), or the twin cannot be made, the packed model is measured first at every batch size, then
densified in place and measured again (``speed_runs.measure_model``; its prefill in rounds of
``PREFILL_REPEATS`` runs until the fastest runs of two rounds agree), and one line in ``notes`` says so
and why. A batch size whose two decoders run out of memory together is measured one model after the
other, with a note too.

Time budget, from the last measurement of the demo (SmolLM2-135M; H200, 2026-11-26, before pairing:
31.8 s inside ``measure_speed`` = load 3.4, dispatch 0.3 (cached), packed 18.1, dense 10.0; the packed
phase pays the process's first ``torch.compile``; an H100 run two days earlier, with one round of 15
prefill runs instead of rounds until two agree, spent 10.0 + 5.7 s in those two phases):

* load and dispatch plan: 3.7 s, unchanged.
* dense twin: one ``copy.deepcopy`` that shares the tensors and decodes only the ``SparseLinear`` layers
  without a dense copy: a fraction of a second, like the in-place ``densify`` it replaces.
* compiles: two per model, as before: batch 1 (specialised) and then one graph with a dynamic batch
  dimension for every batch size from 2 up (torch's automatic dynamic shapes; a CPU test pins this), so
  nothing recompiles per batch size after the second. A CUDA-graph capture per batch size and model
  costs a few steps.
* decode: 3 timed loops of 64 steps and 8 untimed steps per model and batch size, ~0.35 s at 1.3-1.9 ms
  a step: ~3 s in all (before: a whole 64-step warm-up loop as well, ~3.6 s). Since issue 20: 2 loops.
* prefill: 7 rounds x 3 runs x 2 models = 42 runs per batch size (up to 60), ~0.7 s at 17 ms. Before:
  rounds of 15 runs until two agreed within 2%, at most 8, per model and batch size, 0.5-2 s each; the
  ~12 s that the rounds added say that most ran to 8, ~16 s in all.
* ``gc.collect()`` once before the batch sizes, not per model and batch size (0.1-0.2 s each). So ~18 s
  in ``measure_speed``, ~28 s wall for the demo's ``eval --speed``. ``phases_s``: load, dispatch, twin, capture
  (decoders, first prefill, compiles, graphs), decode, prefill; each row's ``seconds``: the same per batch size.

Cold caches (issue 20; H100, transformers 5.24, 2026-11-26): 43.7 s wall with the kernel cache warm,
53.3 s on a fresh H200, against 24.4 s warm. The cold time went to the dispatch plan (8.8-9.1 s: numba
compiling two spmm_warp variants, one token with two strips per step for 3072x576 and 8 tokens for
576x1536, and the decode kernel, then timing 5 (shape, tokens) pairs in 10 CUDA graphs, only to run every
shape dense but 576x1536 at one token), the kernels' self-test at load on a fresh machine (a numba compile
of the one-token variant, ~5 s) and Inductor (capture 17.0-20.4 s cold against 6.4 warm: four compiles,
the batch-1 and the dynamic-batch graph of each model). Now the plan runs weights under 2^21 elements
dense without timing them (all of the demo's; ``runtime.dispatch``, said in one note), the self-test
runs only where a sparse layer is left, and a packed model left with no sparse layer has the dense
twin's modules, so the twin replays the packed model's two compiled graphs instead of compiling two more
(Dynamo's guards pass: same classes, shared tensors; a CPU test pins this): no numba compile at all on
the demo, two Inductor compiles instead of four. Then Inductor's compile workers start before the model
loads (``torch_compat.start_compile_workers``; torch starts them at its first compile, which compiles its
Triton kernels one by one until they answer), and decode has 2 timed loops (``speed_runs.DECODE_ROUNDS``).

A model with CATS thresholds (``sparsekit prune --method cats``, or ``--cats`` stacked on a weight
method) counts as sparse even without a packed linear: its gated MLPs go onto the CATS kernels
(``sparsekit.runtime.cats_mlp.enable_cats_kernels``, where that module exists and can run: CUDA, fp16)
before the fusions, or run their thresholds as a masked activation otherwise. The dense twin has the
original MLPs back, without thresholds (``runtime.cats.remove_thresholds``).
"""
from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparsekit.errors import SparsekitError, strict_mode
from sparsekit.evaluation.speed_runs import (DECODE_ROUNDS, GIB, PREFILL_MAX_ROUNDS, PREFILL_ROUNDS, PREFILL_RUNS,
                                             measure_model, measure_pair)
from sparsekit.evaluation.speed_twin import dense_twin, pairing_obstacle
from sparsekit.hf.models import resolve_device
from sparsekit.hf.modules import set_submodule
from sparsekit.packed.shards import is_packed_dir
from sparsekit.progress import Progress, report
from sparsekit.runtime.cats import cats_activations, remove_thresholds
from sparsekit.runtime.dispatch import plan_dispatch, sp24_runs_note
from sparsekit.runtime.fusion import fuse_projections, prepare_for_decode
from sparsekit.runtime.loader import load_packed, open_model
from sparsekit.runtime.sparse_linear import SparseLinear, kernel
from sparsekit.runtime.swap import densify, sparsify
from sparsekit.runtime.timing import model_bytes
from sparsekit.torch_compat import start_compile_workers

BATCH_SIZES = (1, 8, 16, 32)


def dense_layers_note(dispatch: dict, n_sparse: int) -> str | None:
    """One line: how many sparse layers run dense because the plan timed them slower, and each such shape
    once, with its speed (None when none did). Those run dense untimed have their own line,
    ``dispatch["untimed"]["note"]``."""
    shapes = [f"{g['shape'][0]}x{g['shape'][1]} ({g['timings'][0]['speedup']:.2f}x at N={g['timings'][0]['n']})"
              for g in dispatch["groups"] if g.get("form") == "dense" and g.get("timings")]
    timed = len(dispatch["dense_layers"]) - (dispatch.get("untimed") or {}).get("layers", 0)
    if not shapes or timed <= 0:
        return None
    return (f"{timed} of {n_sparse} sparse layers run dense: the sparse kernel is slower "
            f"than cuBLAS at every token count for {', '.join(shapes)}")


def start_compile_workers_early(notes: list[str]) -> None:
    """Inductor's compile worker processes started now, before the model loads (``torch_compat``), so
    that they are up when the first compile reaches its Triton kernels instead of seconds later; when
    they cannot be started one line in ``notes`` says so (raised under ``SPARSEKIT_STRICT``)."""
    try:
        start_compile_workers()
    except Exception as e:  # noqa: BLE001 - said in notes (raised when strict)
        why = (f"Inductor's compile workers not started before the model load ({type(e).__name__}: "
               f"{(str(e).splitlines() or [''])[0][:200]}): the first compile starts them, and compiles its "
               "kernels one by one until they are up (a slower cold start)")
        if strict_mode():
            raise SparsekitError(f"{why} (SPARSEKIT_STRICT is set: no fallback)") from e
        notes.append(why)


def open_measured(model_dir, device, dtype, notes: list[str]) -> nn.Module:
    """The model of ``model_dir`` through the one loader; an unpacked one is encoded in memory."""
    path = Path(model_dir)
    if is_packed_dir(path):  # the kernels' check after the dispatch plan (measure_speed), which may need none
        return load_packed(path, device=device, dtype=dtype, check_kernels=False)
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
                  new_tokens: int = 64, repeats: int = DECODE_ROUNDS, cuda_graphs: bool = True,
                  dtype: torch.dtype = torch.float16, fuse_norms: bool = True, compile: bool = True,
                  fuse_proj: bool = True, prefer: str = "speed", prefill_rounds: int = PREFILL_ROUNDS,
                  prefill_runs: int = PREFILL_RUNS, max_prefill_rounds: int = PREFILL_MAX_ROUNDS,
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
    load and runs each in its faster form (the report's ``dispatch``). ``prefill_rounds``, ``prefill_runs`` and
    ``max_prefill_rounds`` shape the interleaved prefill timing (:func:`measure_pair`). The report's
    ``measurement`` is ``"interleaved"`` or ``"sequential"`` (with a line in ``notes`` saying why); each
    row has per model what :func:`measure_model` reports, ``ratio`` (packed over dense tokens/s: the
    median of the paired rounds' ratios when interleaved) and, when interleaved, ``paired`` (each
    round's ratio and figures). ``progress("measuring speed", 0, total)`` comes first, then one call
    per step done, named after it ("loaded", "packed and dense, batch 8"; sequential: "packed batch 8").
    """
    if not torch.cuda.is_available():
        raise SparsekitError("speed measurement needs a CUDA GPU and none is available: run `sparsekit eval --speed` on a GPU machine")
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise SparsekitError(f"speed measurement runs on a CUDA GPU, not {dev}: pass device='cuda'")
    batch_sizes = tuple(int(b) for b in batch_sizes)
    if not batch_sizes or min(batch_sizes) < 1:
        raise SparsekitError(f"batch sizes must be positive integers, got {batch_sizes}")
    if prompt_len < 1 or new_tokens < 2 or repeats < 1 or prefill_rounds < 1 or prefill_runs < 1:
        raise SparsekitError("prompt_len >= 1, new_tokens >= 2, repeats >= 1, prefill_rounds >= 1 and "
                             "prefill_runs >= 1 are needed")
    notes: list[str] = []
    done, total = 0, 2 * len(batch_sizes) + 1

    def tick(stage: str) -> None:
        nonlocal done
        done += 1
        report(progress, stage, done, total)

    report(progress, "measuring speed", 0, total)
    t0 = time.perf_counter()
    if compile:  # in the background while the model loads: up by the first compile's kernels (cold: seconds)
        start_compile_workers_early(notes)
    model = open_measured(model_dir, dev, dtype, notes)
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
    if any(isinstance(m, SparseLinear) and m.values.is_cuda for m in model.modules()):
        kernel()  # the load-time check, after the plan: on failure one notice now, the reference path later
    phases["dispatch_s"] = time.perf_counter() - t0 - phases["load_s"]
    if dispatch.get("untimed"):
        notes.append(dispatch["untimed"]["note"])
    timed_dense = dense_layers_note(dispatch, n_sparse)
    if timed_dense:
        notes.append(timed_dense)
    if "error" in dispatch.get("cache", {}):
        notes.append(dispatch["cache"]["error"])
    if dispatch["dense_copy_bytes"]:
        notes.append(f"dense copies kept for token counts above each layer's crossover: "
                     f"{dispatch['dense_copy_bytes'] / GIB:.3f} GiB (--prefer memory keeps none)")
    if dispatch.get("sp24_note"):
        notes.append(dispatch["sp24_note"])
    note24 = sp24_runs_note(dispatch, n_sparse)
    if note24:
        notes.append(note24)
    tick("loaded")
    kw = dict(prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats, compile=compile)

    def merge_notes(extra: list[str]) -> None:
        for note in extra:
            if note not in notes:
                notes.append(note)

    def run_all(label: str) -> dict[int, dict]:
        """One model at every batch size (the sequential measurement)."""
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
            merge_notes(out[b].pop("notes", []))
            tick(f"{label} batch {b}")
        return out

    def run_paired(twin: nn.Module) -> dict[int, dict]:
        """Both models at every batch size, interleaved (measure_pair)."""
        nonlocal cuda_graphs
        resident = {"packed": model_bytes(model), "dense": model_bytes(twin)}
        pkw = dict(kw, prefill_rounds=prefill_rounds, prefill_runs=prefill_runs,
                   max_prefill_rounds=max_prefill_rounds, resident=resident)
        out = {}
        for b in batch_sizes:
            try:
                try:
                    out[b] = measure_pair(model, twin, b, cuda_graphs=cuda_graphs, **pkw)
                except SparsekitError as e:
                    if not cuda_graphs or strict_mode():
                        raise
                    notes.append(f"CUDA graphs failed, measured eagerly instead (slower): {e}")
                    cuda_graphs = False
                    out[b] = measure_pair(model, twin, b, cuda_graphs=False, **pkw)
            except torch.cuda.OutOfMemoryError:
                notes.append(f"batch {b}: the two models' decoders did not fit on the GPU together, so packed and "
                             "dense were measured one after the other at this batch size")
                torch.cuda.empty_cache()
                out[b] = {}
                for which, m in (("packed", model), ("dense", twin)):
                    others = torch.cuda.memory_allocated(dev) - resident[which]
                    out[b][which] = measure_model(m, b, cuda_graphs=cuda_graphs, exclude_bytes=others, **kw)
                    merge_notes(out[b][which].pop("notes", []))
            seconds[b] = out[b].pop("seconds", {})
            for key, spent in seconds[b].items():
                phases[f"{key}_s"] = phases.get(f"{key}_s", 0.0) + spent
            merge_notes(out[b].pop("notes", []))
            tick(f"packed and dense, batch {b}")
        return out

    seconds: dict[int, dict[str, float]] = {}  # paired: per batch size, the wall time of capture, decode, prefill
    packed_bytes = model_bytes(model)
    t1 = time.perf_counter()
    why = pairing_obstacle(model, cats_mlps, batch_sizes=batch_sizes, prompt_len=prompt_len, new_tokens=new_tokens,
                           device=dev, cats_kernels=n_cats_kernels, fuse_proj=fuse_proj)
    twin = None
    if why is None:
        try:
            twin = dense_twin(model, cats_mlps, cats_kernels=n_cats_kernels, fuse_proj=fuse_proj)
        except torch.cuda.OutOfMemoryError:
            why = "the dense twin did not fit on the GPU beside the packed model"
        except Exception as e:  # noqa: BLE001 - said in notes (raised when strict)
            why = f"the dense twin could not be made beside the packed model ({type(e).__name__}: {str(e)[:200]})"
            if strict_mode():
                raise SparsekitError(f"{why} (SPARSEKIT_STRICT is set: no sequential fallback)") from e
        torch.cuda.empty_cache()
    phases["twin_s"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    if twin is not None:
        measurement = "interleaved"
        total = len(batch_sizes) + 1  # one step per batch size: both models
        gc.collect()  # once; during the timed rounds the collector is held off
        dense_bytes = model_bytes(twin)
        pairs = run_paired(twin)
        del twin
        phases["measure_s"] = time.perf_counter() - t1
        packed = {b: r["packed"] for b, r in pairs.items()}
        dense = {b: r["dense"] for b, r in pairs.items()}
    else:
        measurement = "sequential"
        notes.append(f"packed and dense measured one after the other, not interleaved: {why} "
                     "(the prefill ratios are noisier this way)")
        pairs = {}
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
    model = None  # noqa: F841 - the packed model goes back before empty_cache (the closures above are done)
    torch.cuda.empty_cache()

    rows = []
    for b in batch_sizes:
        p, d = packed[b], dense[b]
        pair = pairs.get(b, {})
        row = {"batch_size": b, "packed": p, "dense": d, "interleaved": "ratio" in pair}
        if "ratio" in pair:
            row.update(ratio=pair["ratio"], ratio_interval=pair["ratio_interval"], paired=pair["paired"])
        else:
            row["ratio"] = {key: p[key] / d[key] for key in ("prefill_tok_s", "decode_tok_s")
                            if key in p and key in d and d[key] > 0}
        if seconds.get(b):
            row["seconds"] = seconds[b]   # capture: decoders built, the step compiled where it must be, captured
        rows.append(row)
    import transformers

    return {
        "model": str(model_dir),
        "gpu": torch.cuda.get_device_name(dev),
        "dtype": str(dtype).replace("torch.", ""),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "measurement": measurement,  # "interleaved" (paired rounds) or "sequential" (notes say why)
        "prefill_rounds": prefill_rounds if measurement == "interleaved" else None,
        "prefill_runs": prefill_runs if measurement == "interleaved" else None,
        "prefill_max_rounds": max_prefill_rounds if measurement == "interleaved" else None,
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
