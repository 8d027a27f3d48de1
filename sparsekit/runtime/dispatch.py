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
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.hf.modules import set_submodule
from sparsekit.progress import Progress, report
from sparsekit.runtime import dispatch_cache
from sparsekit.runtime.sparse_linear import SparseLinear, kernels_ready
from sparsekit.runtime.timing import graph_ms

TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64)
MARGIN = 0.02        # the kernel must be at least this much faster to be chosen (noise guard)
COPIES = 6           # layers of a group timed per graph (more than the L2 holds at 7B sizes)
PREFER = ("speed", "memory")


def check_prefer(prefer: str) -> str:
    if prefer not in PREFER:
        raise SparsekitError(f"prefer must be one of {', '.join(PREFER)}, got {prefer!r}")
    return prefer


def _group_key(m: SparseLinear) -> tuple:
    return (m.out_features, m.in_features, round(m.sparsity, 1), m.bias is not None)


def time_group(layers: list[SparseLinear], dense: list[torch.Tensor], n: int) -> tuple[float, float]:
    """(sparse ms, dense ms) of one pass over ``layers`` (and their decoded weights ``dense``) at ``n`` tokens."""
    x = torch.randn(n, layers[0].in_features, device=layers[0].values.device, dtype=torch.float16)
    sparse_ms = graph_ms(lambda: [m.kernel_forward(x) for m in layers])
    dense_ms = graph_ms(lambda: [F.linear(x, w) for w in dense])
    return sparse_ms, dense_ms


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


def plan_dispatch(model: nn.Module, *, prefer: str = "speed", token_counts=TOKEN_COUNTS,
                  progress: Progress | None = None, cache: bool = True) -> dict[str, Any]:
    """Measure and set, for every ``SparseLinear`` of ``model`` (on a CUDA GPU), the largest token count
    that runs the sparse kernel; apply ``prefer`` above it (see the module docstring). Returns a report:
    per group the timings (up to the first token count where dense wins) and the choice, the layers that run dense and why, and the bytes of the
    dense copies kept."""
    check_prefer(prefer)
    names = {name: m for name, m in model.named_modules() if isinstance(m, SparseLinear)}
    groups: dict[tuple, list[str]] = {}
    for name, m in names.items():
        groups.setdefault(_group_key(m), []).append(name)
    out: dict[str, Any] = {"prefer": prefer, "token_counts": list(token_counts), "groups": [],
                           "dense_layers": {}, "dense_copy_bytes": 0}
    if not names:
        return out
    if not kernels_usable(list(names.values())):
        out["skipped"] = "no usable GPU kernels: the sparse layers keep the reference path"
        return out
    counts = sorted(int(n) for n in token_counts)
    path = dispatch_cache.cache_file(next(iter(names.values())).values.device) if cache else None
    stored = dispatch_cache.read(path) if path is not None else {}
    hits = 0
    for gi, (key, members) in enumerate(groups.items()):
        mods = [names[n] for n in members]
        ckey = dispatch_cache.entry_key(key[:2], key[2], key[3], counts)
        rows = stored.get(ckey)
        if rows is None:
            rows = stored[ckey] = _measure_group(mods[:COPIES], counts)
        else:
            hits += 1
        max_n = crossover(rows)
        entry = {"shape": [key[0], key[1]], "sparsity": key[2], "layers": len(members), "sparse_max_n": max_n,
                 "timings": rows}
        if max_n == 0 and prefer == "speed":
            entry["form"] = "dense"
            why = f"the sparse kernel is slower at every token count ({rows[0]['speedup']:.2f}x cuBLAS at N={counts[0]})"
            for name in members:
                set_submodule(model, name, names[name].to_linear(torch.float16))
                out["dense_layers"][name] = why
        elif prefer == "speed":
            entry["form"] = f"sparse up to N={max_n}, dense copy above"
            for m in mods:
                m.dense_above = max_n
                m.keep_dense_copy()
                out["dense_copy_bytes"] += m.dense_copy_bytes()
        else:  # memory: packed only; above its default threshold a layer decodes, then runs cuBLAS
            entry["form"] = f"sparse (kernel up to N={mods[0].dense_above}, decode + cuBLAS above)"
        out["groups"].append(entry)
        report(progress, "dispatch", gi + 1, len(groups))
    if path is not None:
        out["cache"] = {"path": str(path), "groups_from_cache": hits}
        if hits < len(groups):
            error = dispatch_cache.write(path, stored)
            if error:
                out["cache"]["error"] = f"the timings could not be cached ({error}): the next load measures again"
    torch.cuda.empty_cache()
    return out


def _measure_group(timed: list[SparseLinear], counts: list[int]) -> list[dict]:
    """Timing rows of one group, up to the first token count where dense wins (each new count
    compiles a kernel variant)."""
    dense = [m.dense_weight(torch.float16) for m in timed]  # decoded once per group, for every count
    rows = []
    for n in counts:
        s_ms, d_ms = time_group(timed, dense, n)
        rows.append({"n": n, "sparse_ms": s_ms / len(timed), "dense_ms": d_ms / len(timed),
                     "speedup": d_ms / s_ms if s_ms > 0 else None})
        if crossover(rows) < n:
            break
    return rows
