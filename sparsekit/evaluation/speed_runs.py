"""One batch size of ``sparsekit eval --speed``: one model alone (:func:`measure_model`, the sequential
measurement and the scripts') or a packed model and its dense twin interleaved (:func:`measure_pair`).

See ``sparsekit.evaluation.speed`` for what is timed and why, and what each phase costs.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Any, Sequence

import torch
from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.runtime.decoder import GreedyDecoder
from sparsekit.runtime.timing import model_bytes, time_ms

PREFILL_REPEATS = 15  # one model alone (measure_model): runs per round of _prefill_ms
PREFILL_ROUNDS = 7  # paired (measure_pair): dense/packed prefill rounds per batch size
PREFILL_RUNS = 3  # paired: runs per prefill round, each paired with the other model's run beside it (ABBA)
PREFILL_MAX_ROUNDS = 10  # paired, measure_speed: more rounds, up to this many, while the median is unsure:
PREFILL_SPREAD = 0.03  # its ~95% interval wider than +-3% of it. Short, host-bound prefills scatter most (the
# demo, ~20-30 ms of launches at every batch size: one H100 row of 20 at 0.949 in session 23 with 21 pairs, where
# both models run the same matmuls); steady ones stop at the minimum. At +-2% and up to 14 rounds (session 25, an
# H100 whose host was slower) every demo row took all 14: the prefill phase 10-12 s instead of ~5, the cold
# command 34-36 s.
# Why pairs of runs, not of rounds' fastest runs: on the demo the dispatch plan runs every layer dense, so the two
# models are module for module the same (H200, 2026-11-27: 30 ABBA pairs gave medians 0.993-1.011), yet eval
# --speed's round-fastest pairs put one row at 0.947 of 8. A host that swings 21 -> 41 ms within a batch size
# moves a round's fastest runs apart in time; adjacent runs share the host's state.
# paired: timed decode loops per model and batch size. Graph replays barely scatter: in 7 runs of the demo
# on H100s (2026-11-25/26, 28 paired rows) a row's three loop ratios were never more than 0.9% apart and the
# median of the first two moved a row's ratio by at most 0.43% (sd of the rows' ratios 0.0048 with three,
# 0.0044 with two), so a third loop (~0.22 s per batch size) bought nothing. Prefill is another matter: the
# median of the first 5 of 7 rounds put 5 rows under 0.95x instead of 3 (sd 0.050 against 0.035): 7 stay.
DECODE_ROUNDS = 2
DECODE_WARMUP_STEPS = 8  # paired: untimed decode steps (graph replays) after the capture
ORDER = ("dense", "packed")  # the order inside each paired round
GIB = 2**30


def _prompt(model: nn.Module, batch_size: int, prompt_len: int, seed: int, device) -> torch.Tensor:
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 1000))
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch_size, prompt_len), generator=gen).to(device)


def measure_model(model: nn.Module, batch_size: int, *, prompt_len: int = 128, new_tokens: int = 64,
                  repeats: int = 3, cuda_graphs: bool = True, compile: bool = True,
                  seed: int = 0, exclude_bytes: int = 0) -> dict[str, Any]:
    """Prefill/decode speed and peak memory of one model at one batch size (on its CUDA device), alone:
    the sequential measurement (see the module docstring) and the scripts' (``scripts/bench/e2e.py``).

    With ``compile`` the model's packed sizes should be equalized first (``fusion.prepare_for_decode``).
    ``exclude_bytes`` (another model's tensors on the same GPU) is taken out of the peak memory."""
    device = next(model.parameters()).device
    ids = _prompt(model, batch_size, prompt_len, seed, device)
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
        peak = torch.cuda.max_memory_allocated(device) - exclude_bytes
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


def paired_ratios(dense_ms: Sequence[float], packed_ms: Sequence[float]) -> list[float]:
    """Pair by pair, the packed model's speed over the dense one's: dense time / packed time
    (``> 1``: packed is faster). The report's ratio is their median."""
    if len(dense_ms) != len(packed_ms) or not dense_ms:
        raise ValueError(f"pairs need as many dense as packed figures, got {len(dense_ms)} and {len(packed_ms)}")
    return [d / p for d, p in zip(dense_ms, packed_ms)]


def median_interval(xs: Sequence[float]) -> tuple[float, float]:
    """A distribution-free ~95% interval of the median of ``xs``: the order statistics of ranks
    ``n/2 - 0.98 sqrt(n)`` and ``n/2 + 1 + 0.98 sqrt(n)`` (1-based; 21 values: the 6th and 16th), clipped to the
    sample (fewer than 6 values: their whole range)."""
    if not xs:
        raise ValueError("an interval needs at least one value")
    s = sorted(xs)
    n = len(s)
    half = 0.98 * math.sqrt(n)
    lo = max(1, math.floor(n / 2 - half))
    hi = min(n, math.ceil(n / 2 + 1 + half))
    return s[lo - 1], s[hi - 1]


def median_is_sure(xs: Sequence[float], spread: float = PREFILL_SPREAD) -> bool:
    """Whether :func:`median_interval` of ``xs`` lies within ``+-spread`` of their median."""
    lo, hi = median_interval(xs)
    m = statistics.median(xs)
    return hi - lo <= 2 * spread * abs(m)


def measure_pair(packed: nn.Module, dense: nn.Module, batch_size: int, *, prompt_len: int = 128,
                 new_tokens: int = 64, repeats: int = DECODE_ROUNDS, prefill_rounds: int = PREFILL_ROUNDS,
                 prefill_runs: int = PREFILL_RUNS, max_prefill_rounds: int | None = None,
                 prefill_spread: float = PREFILL_SPREAD, cuda_graphs: bool = True, compile: bool = True,
                 seed: int = 0, resident: dict[str, int] | None = None) -> dict[str, Any]:
    """Both models at one batch size, interleaved (both on one CUDA device; see the module docstring).

    Returns ``{"packed": {...}, "dense": {...}, "ratio": {...}, "paired": {...}, "seconds": {...}}``:
    per model what :func:`measure_model` reports (``prefill_ms`` the fastest run of all rounds,
    ``prefill_ms_median`` the median of all runs, ``ms_per_token`` the median of the decode loops);
    ``ratio`` the medians of the paired ratios (packed tokens/s over dense): prefill runs paired with the
    other model's run beside them, decode loops round by round; ``ratio_interval`` the prefill median's ~95%
    interval (:func:`median_interval`); ``paired`` those ratios and the figures in ms (``prefill_run_ms``: per
    model, per round, its runs); ``seconds`` the wall time of capture, decode and prefill. After
    ``prefill_rounds`` rounds, more follow, up to ``max_prefill_rounds`` (default: none), while that interval is
    wider than ``+-prefill_spread`` of the median (:func:`median_is_sure`). ``resident`` (``{"packed": bytes,
    "dense": bytes}``, default ``model_bytes`` of each) is what each model itself holds: the rest of what is
    allocated is the other's, out of its peak.
    A ``torch.cuda.OutOfMemoryError`` propagates (the caller measures that batch size one model at a time)."""
    if repeats < 1 or prefill_rounds < 1 or prefill_runs < 1 or new_tokens < 1:
        raise SparsekitError("repeats, prefill_rounds, prefill_runs and new_tokens must be >= 1")
    max_prefill_rounds = max(prefill_rounds, max_prefill_rounds or prefill_rounds)
    models = {"packed": packed, "dense": dense}
    device = next(packed.parameters()).device
    ids = _prompt(packed, batch_size, prompt_len, seed, device)
    if resident is None:
        resident = {k: model_bytes(m) for k, m in models.items()}
    decs: dict[str, GreedyDecoder] = {}
    dec = None
    out: dict[str, dict] = {k: {} for k in models}
    seconds = {}
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    try:
        t = time.perf_counter()
        for which in ("packed", "dense"):  # built, prefilled, captured, warmed: one model at a time
            others = torch.cuda.memory_allocated(device) - resident[which]
            torch.cuda.reset_peak_memory_stats(device)
            dec = decs[which] = GreedyDecoder(models[which], batch_size, prompt_len + new_tokens + 1,
                                              use_graph=cuda_graphs, compile=compile)
            dec.prefill(ids)
            if cuda_graphs:
                dec.capture()
            for _ in range(DECODE_WARMUP_STEPS):
                dec.step()
            torch.cuda.synchronize(device)
            out[which]["peak_mem_gib"] = (torch.cuda.max_memory_allocated(device) - others) / GIB
        seconds["capture"] = time.perf_counter() - t

        gc.disable()
        try:
            t = time.perf_counter()
            step_ms: dict[str, list[float]] = {k: [] for k in models}
            for _ in range(repeats):
                for which in ORDER:
                    dec = decs[which]
                    dec.prefill(ids)
                    step_ms[which].append(time_ms(lambda: [dec.step() for _ in range(new_tokens)]) / new_tokens)
            seconds["decode"] = time.perf_counter() - t
            t = time.perf_counter()
            runs: dict[str, list[list[float]]] = {k: [] for k in models}
            prefill_x: list[float] = []
            while len(runs["dense"]) < max_prefill_rounds:
                if len(runs["dense"]) >= prefill_rounds and median_is_sure(prefill_x, prefill_spread):
                    break
                for which in ORDER:   # a round's runs alternate ABBA: dense, packed, packed, dense, ...
                    runs[which].append([])   # (a host that drifts slower within a round slows both sides alike)
                for j in range(prefill_runs):
                    for which in (ORDER if j % 2 == 0 else ORDER[::-1]):
                        dec = decs[which]
                        runs[which][-1].append(time_ms(lambda: dec.prefill(ids)))
                prefill_x += paired_ratios(runs["dense"][-1], runs["packed"][-1])
            seconds["prefill"] = time.perf_counter() - t
        finally:
            gc.enable()
        notes = [n for dec in decs.values() for n in dec.notes]
        for which, dec in decs.items():
            out[which]["compiled"] = dec.compile
    finally:
        decs.clear()
        dec = None  # noqa: F841 - the last decoder's cache and graph go back before empty_cache
        torch.cuda.empty_cache()

    tokens = batch_size * prompt_len
    for which in models:
        all_runs = [ms for rnd in runs[which] for ms in rnd]
        fastest, step = min(all_runs), statistics.median(step_ms[which])
        out[which].update({"prefill_ms": fastest,
                           "prefill_ms_median": statistics.median(all_runs),
                           "prefill_tok_s": tokens / (fastest / 1e3),
                           "ms_per_token": step,
                           "decode_tok_s": batch_size / (step / 1e3)})
    decode_x = paired_ratios(step_ms["dense"], step_ms["packed"])
    return {"packed": out["packed"], "dense": out["dense"],
            "ratio": {"prefill_tok_s": statistics.median(prefill_x), "decode_tok_s": statistics.median(decode_x)},
            "ratio_interval": {"prefill_tok_s": list(median_interval(prefill_x))},
            "paired": {"prefill_x": prefill_x, "decode_x": decode_x,
                       "prefill_run_ms": runs, "decode_round_ms": step_ms},
            "seconds": seconds, "notes": notes}


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
