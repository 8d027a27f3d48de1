"""Run every linear in the form that is fastest for it, chosen from measurements at load time.

The sparse kernel beats cuBLAS on large weights at small token counts, and loses on small weights
(where a call is launch and latency bound for both) and at large token counts. So, per group of
layers with the same shape and about the same sparsity, :func:`plan_dispatch` times the sparse
kernel and cuBLAS on the decoded weights at each token count in ``token_counts``, replaying CUDA
graphs of the whole group (several weight copies, so the timings are not L2-hot), and keeps the
sparse kernel up to the largest token count where it wins at that count and every smaller one.

``prefer="speed"`` (the default): a group that never wins runs dense (its layers become plain
``nn.Linear``), and the others keep a dense copy of their weight for the token counts above their
crossover (prefill included), so no layer runs slower than dense; that costs memory, which the
report gives. ``prefer="memory"``: nothing changes (packed weights only; above ``dense_above`` tokens
a layer decodes its weight with one kernel and runs cuBLAS): the report still shows where dense would win.

**2:4 and hybrid layers** (issue 22; opt-in, ``SPARSEKIT_SP24=1`` or ``sp24=True``): with ``prefer="speed"``, a layer whose encode-time tile census
(``packed.sp24.tile_census``) says every 64x64 tile is 2:4 or dense also gets its 2:4 tile-mosaic layout
(``runtime.sp24``), and its group is timed on that kernel too. It runs the 2:4 kernel up to the largest
token count where that beats the TCA-BME kernel at that count and every smaller one, TCA-BME above it
while that wins, the 2:4 kernel again from the count on which it wins at every count up to the
crossover (Hopper's warpgroup kernel, from 32 tokens on tall weights), dense above. A group where the
2:4 kernel never wins gives its layouts back. The report says per group which kernel runs up to which
token count (``form``, ``sp24_max_n``, ``sp24_from_n``) and the bytes the layouts take. With ``prefer="memory"`` a
group keeps one form only: its 2:4 layout where that kernel took less time than TCA-BME over the token counts timed
(the TCA-BME buffers freed, ``runtime.sp24.keep_only_sp24``: its kernel then runs up to ``decode_above`` tokens and
above, prefill, cuSPARSELt on the layout rewritten for it where the layer is all-2:4, else the layout decoded for
cuBLAS; at about the same ~1.1 bytes a weight), else TCA-BME
(``tcabme_freed_bytes`` in the report counts what was freed).

**Small weights are not timed** (issue 20). With ``prefer="speed"``, a group whose weight has fewer than
``UNTIMED_BELOW`` (2^21) elements runs dense at once, without compiling or timing any kernel for it. At
these sizes a call is launch- and latency-bound (~4-5 us for both) and every such shape measured on an
H100 tied or lost (docs/benchmarks.md): at one token 576x576 0.87-0.99x cuBLAS, 192x576 0.87-0.89x,
960x576 0.88x, 1536x576 0.88-0.91x, 3072x576 0.74-0.77x, and 576x1536 1.00-1.05x (inside or just past
the 2% margin; with it on the kernel the demo's decode at batch 1 was 0.98-1.00x dense); from 8 tokens on
0.90x at best. The smallest weight measured to win is 4096x4096 (16.8M elements, 1.3x at one token). Timing
them cost the demo's ``eval --speed`` 8-9 s of kernel compiles and graph timings when not cached, to
choose dense in the end. The report says which groups were not timed and why (``untimed``, with a
one-line ``note``); ``time_small=True`` or ``SPARSEKIT_TIME_SMALL=1`` times them like the others.
These layers become dense through the kernel-free decode (``sparse_linear.decode_dense``), so a plan
that keeps no sparse layer compiles no kernel at all (not even the kernels' self-test, which runs
before the first group that is timed).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.errors import SparsekitError, env_switch, strict_mode
from sparsekit.packed.sp24 import census_fits
from sparsekit.hf.modules import set_submodule
from sparsekit.progress import Progress, report
from sparsekit.runtime import dispatch_cache
from sparsekit.runtime.fusion import equalize_sp24_layouts
from sparsekit.runtime.sparse_linear import SparseLinear, kernels_ready, notice_once, release_kernel_caches
from sparsekit.runtime.timing import graph_ms

TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64)
MARGIN = 0.02        # the kernel must be at least this much faster to be chosen (noise guard)
COPIES = 6           # layers of a group timed per graph (more than the L2 holds at 7B sizes)
PREFER = ("speed", "memory")
UNTIMED_BELOW = 1 << 21   # prefer="speed": weights of fewer elements run dense untimed (module docstring)


def check_prefer(prefer: str) -> str:
    if prefer not in PREFER:
        raise SparsekitError(f"prefer must be one of {', '.join(PREFER)}, got {prefer!r}")
    return prefer


def _group_key(m: SparseLinear) -> tuple:
    return (m.out_features, m.in_features, round(m.sparsity, 1), m.bias is not None, m.form == "sp24")


def time_group(layers: list[SparseLinear], dense: list[torch.Tensor], n: int) -> tuple[float, float]:
    """(sparse ms, dense ms) of one pass over ``layers`` (and their decoded weights ``dense``) at ``n`` tokens."""
    x = torch.randn(n, layers[0].in_features, device=layers[0].values.device, dtype=torch.float16)
    sparse_ms = graph_ms(lambda: [m.kernel_forward(x) for m in layers])
    dense_ms = graph_ms(lambda: [F.linear(x, w) for w in dense])
    return sparse_ms, dense_ms


def time_sp24(layers: list[SparseLinear], n: int) -> float:
    """ms of one pass over ``layers`` through their 2:4 tile-mosaic kernel at ``n`` tokens."""
    x = torch.randn(n, layers[0].in_features, device=layers[0].values.device, dtype=torch.float16)
    return graph_ms(lambda: [m.sp24_forward(x) for m in layers])


def sp24_prefix(rows: list[dict]) -> int:
    """The largest token count at which the 2:4 kernel beats the TCA-BME kernel there and at every smaller
    measured count (0: never, or not timed)."""
    best = 0
    for r in rows:
        if r.get("sp24_ms") is None or not r["sp24_ms"] < r["sparse_ms"]:
            break
        best = r["n"]
    return best


def sp24_suffix(rows: list[dict], prefix: int) -> int:
    """The smallest token count above ``prefix`` from which the 2:4 kernel beats the TCA-BME kernel at every
    measured count up to where the faster of the two stops beating dense (0: none). Hopper's warpgroup
    2:4 kernel (``kernels/sp24_wg.py``) loses to TCA-BME at some small counts and wins from 32 tokens on."""
    last = crossover(_best_rows(rows))
    start = 0
    for r in rows:
        if r["n"] <= prefix or r["n"] > last:
            continue
        if r.get("sp24_ms") is not None and r["sp24_ms"] < r["sparse_ms"]:
            start = start or r["n"]
        else:
            start = 0
    return start


def _best_rows(rows: list[dict]) -> list[dict]:
    """``rows`` with ``sparse_ms`` the faster of the two sparse kernels (when to stop timing: once dense
    beats both; what a layer then runs is ``_run_rows``)."""
    return [dict(r, sparse_ms=min(r["sparse_ms"], r["sp24_ms"])) if r.get("sp24_ms") is not None else r
            for r in rows]


def _run_rows(rows: list[dict], sp24_n: int, sp24_from: int = 0) -> list[dict]:
    """``rows`` with ``sparse_ms`` the time of the kernel a layer runs at each count: the 2:4 kernel up to
    ``sp24_n`` and from ``sp24_from`` (when nonzero) on, TCA-BME between."""
    return [dict(r, sparse_ms=r["sp24_ms"]) if r["n"] <= sp24_n or 0 < sp24_from <= r["n"] else r for r in rows]


def sp24_wanted() -> bool:
    """``SPARSEKIT_SP24=1``: the dispatch plan tries the 2:4 kernel on 2:4 and hybrid layers (opt-in for now)."""
    return env_switch("SPARSEKIT_SP24", "try the 2:4 kernel")


def make_sp24_layouts(model: nn.Module, names: dict[str, SparseLinear]) -> str | None:
    """Give the layers whose recorded tile census fits the 2:4 layout (``packed.sp24.census_fits``) their
    layout. Returns one note line, or None: the 2:4 kernel failed its self-test here (an error under
    ``SPARSEKIT_STRICT=1``), or layers of a 2:4 or hybrid pattern carry no census (an older encode)."""
    from sparsekit.runtime.sp24 import enable_sp24

    fits = {n: m for n, m in names.items() if census_fits(m.tile_census) and m.values.dtype == torch.float16}
    note = None
    unknown = [n for n, m in names.items() if m.tile_census is None and m.pattern in ("2:4", "hybrid")]
    if unknown:
        note = (f"{len(unknown)} {names[unknown[0]].pattern} layers carry no tile census (encoded by an older "
                "sparsekit): they stay on the TCA-BME kernel; re-encode to let the 2:4 kernel take them")
    if fits:
        try:
            enable_sp24(model, only=set(fits))
        except SparsekitError as e:        # the kernel's self-test failed here: said in one line
            if strict_mode():
                raise
            for m in fits.values():
                m.use_sp24(None)
            release_kernel_caches()   # launches kept for the layouts would keep them alive
            note = f"{e} (all {len(fits)} such layers)"
    return note


def crossover(rows: list[dict], margin: float = MARGIN) -> int:
    """The largest token count ``n`` such that the sparse kernel beats dense by ``margin`` at ``n`` and at
    every smaller measured count (0 when it loses at the smallest). ``rows``: ``{n, sparse_ms, dense_ms}``
    in increasing ``n``."""
    best = 0
    for r in rows:
        if not r["sparse_ms"] < r["dense_ms"] * (1 - margin):
            break
        best = r["n"]
    return best


def kernels_usable(mods: list[SparseLinear]) -> bool:
    """Whether the sparse kernels can run these layers here (on a CUDA GPU, after their self-test)."""
    return mods[0].values.is_cuda and kernels_ready()


def time_small_wanted() -> bool:
    """``SPARSEKIT_TIME_SMALL=1``: time the groups of small weights too (``UNTIMED_BELOW``)."""
    return env_switch("SPARSEKIT_TIME_SMALL", "time the sparse kernel on small weights too")


def sp24_runs_note(report: dict, n_sparse: int) -> str | None:
    """One line: how many of the ``n_sparse`` sparse layers run the 2:4 kernel and what their layouts cost, beside the
    packed weights (``prefer="speed"``) or as their only form (``prefer="memory"``); None where none does."""
    n24 = sum(g["layers"] for g in report["groups"]
              if g.get("sp24_max_n") or g.get("sp24_from_n") or g.get("sp24_only"))
    if not n24:
        return None
    where = "their only form: TCA-BME freed" if report.get("tcabme_freed_bytes") else "beside the packed weights"
    pad = report.get("sp24_padding", 0.0)
    padded = f", padded by {100 * pad:.2f}% to one size per shape" if pad else ""
    return (f"{n24} of {n_sparse} sparse layers run the 2:4 kernel (2:4 layouts: "
            f"{report['sp24_layout_bytes'] / 2**30:.3f} GiB, {where}{padded}; --json: per shape)")


def untimed_note(untimed: dict) -> str:
    """One line: how many sparse layers run dense untimed, their shapes, why, and how to time them."""
    shapes = ", ".join(f"{m}x{k}" for m, k in untimed["shapes"])
    return (f"{untimed['layers']} sparse layers run dense without timing the sparse kernel: their weights "
            f"({shapes}) have fewer than 2^{UNTIMED_BELOW.bit_length() - 1} elements, where it has never beaten "
            "cuBLAS by more than 5% (launch-bound; SPARSEKIT_TIME_SMALL=1 times them)")


def plan_dispatch(model: nn.Module, *, prefer: str = "speed", token_counts=TOKEN_COUNTS,
                  progress: Progress | None = None, cache: bool = True, sp24: bool | None = None,
                  time_small: bool | None = None) -> dict[str, Any]:
    """Measure and set, for every ``SparseLinear`` of ``model`` (on a CUDA GPU), the largest token count
    that runs the sparse kernel; apply ``prefer`` above it (see the module docstring). Returns a report:
    per group the timings (up to the first token count where dense wins) and the choice, the layers that run dense and why, and the bytes of the
    dense copies kept. ``sp24``: give 2:4 and hybrid layers the 2:4 kernel where it wins (None: as
    ``SPARSEKIT_SP24`` says, off unless ``1``, until a GPU session has run it in the decode step end to end).
    ``time_small``: time the groups of weights under ``UNTIMED_BELOW`` elements too (None: as
    ``SPARSEKIT_TIME_SMALL`` says, off unless ``1``); otherwise ``prefer="speed"`` runs them dense untimed
    and the report's ``untimed`` says so (its ``note`` in one line). The kernels' self-test runs only when a
    group is timed."""
    check_prefer(prefer)
    if sp24 is None:
        sp24 = sp24_wanted()
    if time_small is None:
        time_small = time_small_wanted()
    names = {name: m for name, m in model.named_modules() if isinstance(m, SparseLinear)}
    out: dict[str, Any] = {"prefer": prefer, "token_counts": list(token_counts), "groups": [],
                           "dense_layers": {}, "dense_copy_bytes": 0, "sp24_layout_bytes": 0}
    if not names:
        return out
    if prefer == "speed" and not time_small:
        small: dict[tuple, list[str]] = {}
        for name, m in names.items():
            if m.out_features * m.in_features < UNTIMED_BELOW:
                small.setdefault(_group_key(m), []).append(name)
        if small:
            out["untimed"] = _run_dense_untimed(model, names, small, out)
            if not names:   # nothing left to time: no kernel compiled, no self-test, no cache read
                return out
    if not kernels_usable(list(names.values())):
        others = " other" if out.get("untimed") else ""
        out["skipped"] = f"no usable GPU kernels: the{others} sparse layers keep the reference path"
        return out
    if sp24:
        note = make_sp24_layouts(model, names)
        if note:
            out["sp24_note"] = note
    elif prefer == "speed":
        n24 = sum(census_fits(m.tile_census) is True for m in names.values())
        if n24:
            out["sp24_note"] = (f"{n24} 2:4/hybrid layers stay on the TCA-BME kernel: the 2:4 kernel path is opt-in "
                                "(SPARSEKIT_SP24=1) until it has run end to end on a GPU")
    groups: dict[tuple, list[str]] = {}
    for name, m in names.items():
        groups.setdefault(_group_key(m), []).append(name)
    counts = sorted(int(n) for n in token_counts)
    path = dispatch_cache.cache_file(next(iter(names.values())).values.device) if cache else None
    stored = dispatch_cache.read(path) if path is not None else {}
    hits = 0
    for gi, (key, members) in enumerate(groups.items()):
        mods = [names[n] for n in members]
        ckey = dispatch_cache.entry_key(key[:2], key[2], key[3], counts) + ("|sp24" if key[4] else "")
        rows = stored.get(ckey)
        if rows is None:
            rows = stored[ckey] = _measure_group(mods[:COPIES], counts, key[4])
        else:
            hits += 1
        sp24_n = sp24_prefix(rows) if key[4] else 0
        sp24_from = sp24_suffix(rows, sp24_n) if key[4] else 0
        max_n = crossover(_run_rows(rows, sp24_n, sp24_from))     # against dense: the kernel each count really runs
        sp24_n = min(sp24_n, max_n)
        sp24_from = sp24_from if 0 < sp24_from <= max_n else 0
        entry = {"shape": [key[0], key[1]], "sparsity": key[2], "layers": len(members), "sparse_max_n": max_n,
                 "timings": rows}
        if key[4] and prefer == "memory":     # one form only: the 2:4 layout, or TCA-BME
            entry["form"] = _one_form(mods, rows, out)
            entry["sp24_only"] = mods[0].sp24_only
            out["groups"].append(entry)
            report(progress, "dispatch", gi + 1, len(groups))
            continue
        if key[4]:
            entry["sp24_max_n"] = sp24_n
            entry["sp24_from_n"] = sp24_from
            for m in mods:
                if sp24_n or sp24_from:
                    m.sp24_max_n = sp24_n
                    m.sp24_from_n = sp24_from
                    out["sp24_layout_bytes"] += m.sp24_bytes()
                else:
                    m.use_sp24(None)     # the TCA-BME kernel wins at every count: give the layout back
        if max_n == 0 and prefer == "speed":
            entry["form"] = "dense"
            first = _run_rows(rows, sp24_n)[0]
            why = (f"the sparse kernel is slower at every token count "
                   f"({first['dense_ms'] / first['sparse_ms']:.2f}x cuBLAS at N={counts[0]})")
            for name in members:
                set_submodule(model, name, names[name].to_linear(torch.float16))
                out["dense_layers"][name] = why
        elif prefer == "speed":
            if sp24_n or sp24_from:
                entry["form"] = _sp24_form(rows, sp24_n, sp24_from, max_n)
            else:
                entry["form"] = f"sparse up to N={max_n}, dense copy above"
            for m in mods:
                m.dense_above = max_n
                m.keep_dense_copy()
                out["dense_copy_bytes"] += m.dense_copy_bytes()
        else:  # memory: packed only; above its default threshold a layer decodes, then runs cuBLAS
            entry["form"] = f"sparse (kernel up to N={mods[0].dense_above}, decode + cuBLAS above)"
        out["groups"].append(entry)
        report(progress, "dispatch", gi + 1, len(groups))
    if any(m.sp24_tiles is not None for m in names.values()):
        out["sp24_padding"] = equalize_sp24_layouts(model)   # one compiled decoder layer for the whole stack
    if path is not None:
        out["cache"] = {"path": str(path), "groups_from_cache": hits}
        if hits < len(groups):
            error = dispatch_cache.write(path, stored)
            if error:
                out["cache"]["error"] = f"the timings could not be cached ({error}): the next load measures again"
    release_kernel_caches()   # views and launches kept for the timings would keep freed buffers alive
    torch.cuda.empty_cache()
    return out


def _run_dense_untimed(model: nn.Module, names: dict[str, SparseLinear], small: dict[tuple, list[str]],
                       out: dict[str, Any]) -> dict[str, Any]:
    """Make the layers of the ``small`` groups plain fp16 ``nn.Linear`` modules, decoded without the kernels
    (no compile, no self-test), taking them out of ``names``; their groups and layers go into ``out``.
    Returns the report's ``untimed`` entry."""
    why = (f"not timed: fewer than 2^{UNTIMED_BELOW.bit_length() - 1} weights, where the sparse kernel "
           "does not beat cuBLAS (launch-bound)")
    shapes: list[list[int]] = []
    layers = 0
    for key, members in small.items():
        for name in members:
            set_submodule(model, name, names.pop(name).to_linear(torch.float16, use_kernels=False))
            out["dense_layers"][name] = why
        out["groups"].append({"shape": [key[0], key[1]], "sparsity": key[2], "layers": len(members),
                              "sparse_max_n": 0, "timings": [], "form": "dense", "untimed": True})
        layers += len(members)
        if [key[0], key[1]] not in shapes:
            shapes.append([key[0], key[1]])
    untimed = {"below_elements": UNTIMED_BELOW, "layers": layers, "shapes": shapes}
    untimed["note"] = untimed_note(untimed)
    return untimed


def _one_form(mods: list[SparseLinear], rows: list[dict], out: dict[str, Any]) -> str:
    """``prefer="memory"`` for a group with 2:4 layouts: the layout becomes each layer's only form where its kernel took
    less time than TCA-BME over the counts timed (summed; up to ``CSLT_FORM_SLACK`` times it where cuSPARSELt would take
    the layers' prefill), else the layouts go back. Returns the group's ``form``."""
    from sparsekit.runtime.sp24 import (CSLT_FORM_SLACK, DECODE_ABOVE_24, above_path, cslt_check, cslt_off,
                                        keep_only_sp24)

    sp24_ms, tcabme_ms = sum(r["sp24_ms"] for r in rows), sum(r["sparse_ms"] for r in rows)
    counts = f"N={rows[0]['n']}-{rows[-1]['n']}"
    slack = CSLT_FORM_SLACK if all(m.sp24_tiles is not None and cslt_off(m) is None for m in mods) else 1.0
    if not sp24_ms < tcabme_ms * slack:
        for m in mods:
            m.use_sp24(None)
        return (f"sparse (TCA-BME, {tcabme_ms / sp24_ms:.2f}x the 2:4 kernel's time at {counts}; kernel up to "
                f"N={mods[0].dense_above}, decode + cuBLAS above)")
    out["tcabme_freed_bytes"] = out.get("tcabme_freed_bytes", 0) + sum(keep_only_sp24(m) for m in mods)
    why = next((cslt_check(m.sp24_sp.device) for m in mods if not m.sp24_dense.numel() and m.sp24_sp.is_cuda), None)
    if why:                          # the all-2:4 layers of a GPU where cuSPARSELt's path failed its check
        notice_once(f"cuSPARSELt prefill is off ({why}): all-2:4 layers decode their layout for cuBLAS above "
                    f"{DECODE_ABOVE_24} tokens")
    out["sp24_layout_bytes"] += sum(m.sp24_bytes() for m in mods)
    release_kernel_caches()   # the kernels' cached views would keep the freed buffers alive
    return (f"2:4 kernel up to N={mods[0].dense_above}, {above_path(mods[0])} above ({sp24_ms / tcabme_ms:.2f}x "
            f"TCA-BME's time at {counts}; its layout the only form, TCA-BME freed)")


def _sp24_form(rows: list[dict], sp24_n: int, sp24_from: int, max_n: int) -> str:
    """The report's ``form`` of a group that runs the 2:4 kernel at some counts."""
    tca_end = max((r["n"] for r in rows if r["n"] < sp24_from), default=0) if sp24_from else max_n
    parts = [f"2:4 kernel up to N={sp24_n}"] if sp24_n else []
    if tca_end > sp24_n:
        parts.append(f"TCA-BME up to N={tca_end}")
    if sp24_from:
        parts.append(f"2:4 kernel from N={sp24_from} up to N={max_n}")
    return ", ".join(parts + ["dense copy above"])


def _measure_group(timed: list[SparseLinear], counts: list[int], sp24: bool = False) -> list[dict]:
    """Timing rows of one group (``sp24``: its 2:4 kernel too), up to the first token count where dense
    beats the faster sparse kernel (each new count compiles a kernel variant)."""
    dense = [m.dense_weight(torch.float16) for m in timed]  # decoded once per group, for every count
    rows = []
    for n in counts:
        s_ms, d_ms = time_group(timed, dense, n)
        row = {"n": n, "sparse_ms": s_ms / len(timed), "dense_ms": d_ms / len(timed),
               "speedup": d_ms / s_ms if s_ms > 0 else None}
        if sp24:
            row["sp24_ms"] = time_sp24(timed, n) / len(timed)
            row["sp24_speedup"] = row["dense_ms"] / row["sp24_ms"] if row["sp24_ms"] > 0 else None
        rows.append(row)
        if crossover(_best_rows(rows)) < n:
            break
    return rows
