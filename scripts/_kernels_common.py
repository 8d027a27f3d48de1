"""What the kernel scripts share (bench_kernels, tune_kernels, probe_kernels, gpu_check_kernels):
random pruned weights, rotated weight copies, graph-replay timing, and the list arguments."""
from __future__ import annotations

import math

import torch

from sparsekit.runtime.timing import time_ms

L2_ROTATE_BYTES = 200 * 2**20


def random_pruned(m: int, k: int, sparsity: float, gen: torch.Generator, device="cuda") -> torch.Tensor:
    """An fp16 [m, k] normal weight with about ``sparsity`` of its entries zeroed."""
    w = torch.randn(m, k, device=device, generator=gen).half()
    w[torch.rand(m, k, device=device, generator=gen) < sparsity] = 0
    return w


def copies_for(nbytes: int) -> int:
    """Copies of an ``nbytes`` operand that together exceed L2_ROTATE_BYTES (at least 4)."""
    return max(4, math.ceil(L2_ROTATE_BYTES / max(nbytes, 1)))


def weight_copies(p) -> list:
    """``copies_for`` independent copies of the packed weight ``p`` (rotated so L2 cannot hold them)."""
    return [type(p)(bitmaps=p.bitmaps.clone(), values=p.values.clone(), gtile_offsets=p.gtile_offsets.clone(),
                    strip_offsets=p.strip_offsets.clone(), shape=p.shape) for _ in range(copies_for(p.nbytes))]


def time_calls(calls, reps: int = 15, graph: bool = True) -> tuple[float, str]:
    """Median microseconds per call over ``reps`` replays of all ``calls`` (graph, else eager)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    mode = "graph"
    run = None
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for c in calls:
                    c()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for c in calls:
                    c()
            run = g.replay
        except Exception:  # noqa: BLE001 - not capturable: time eagerly
            torch.cuda.synchronize()
            run = None
    if run is None:
        mode = "eager"

        def run():
            for c in calls:
                c()
    return time_ms(run, repeats=reps, warmup=1) * 1e3 / len(calls), mode


def shapes_arg(text: str | None) -> list | None:
    """``"4096x4096,576x576"`` -> [(4096, 4096), (576, 576)] (None stays None)."""
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")] if text else None


def ints_arg(text: str | None) -> list | None:
    """``"1,16"`` -> [1, 16] (None stays None)."""
    return [int(v) for v in text.split(",")] if text else None


def floats_arg(text: str | None) -> list | None:
    """``"0.5,0.7"`` -> [0.5, 0.7] (None stays None)."""
    return [float(v) for v in text.split(",")] if text else None


def masked_weight(m: int, k: int, kind, gen: torch.Generator, device="cuda") -> torch.Tensor:
    """An fp16 [m, k] normal weight pruned by ``kind``: a sparsity (float, random positions),
    ``"2:4"`` (two random survivors in every 4 along K; K padded up to a multiple of 4 is cut back),
    or ``"hybrid"`` (64x64 tiles alternately dense and 2:4). Pruned entries are +0.0 (torch.where)."""
    w = torch.randn(m, k, device=device, generator=gen)
    if not isinstance(kind, str):
        return torch.where(torch.rand(m, k, device=device, generator=gen) >= kind, w, 0.0).half()
    k4 = -(-k // 4) * 4
    order = torch.rand(m, k4 // 4, 4, device=device, generator=gen).argsort(-1)
    keep = (order < 2).reshape(m, k4)[:, :k]
    if kind == "hybrid":
        tiles = (torch.arange(m, device=device).view(-1, 1) // 64 + torch.arange(k, device=device) // 64) % 2 == 0
        keep = keep | tiles
    elif kind != "2:4":
        raise ValueError(f"unknown mask kind {kind!r}")
    return torch.where(keep, w, 0.0).half()


def kind_arg(text: str | None) -> list | None:
    """``"0.5,0.7,2:4,hybrid"`` -> [0.5, 0.7, "2:4", "hybrid"] (None stays None)."""
    if not text:
        return None
    return [v if v in ("2:4", "hybrid") else float(v) for v in text.split(",")]


def save_results(out_dir: str, name: str, rows: list, **meta) -> dict:
    """Write ``{"meta": ..., "rows": rows}`` to ``out_dir/name`` (meta: GPU, date, torch, command,
    and ``meta``'s extra keys) and return the meta."""
    import datetime
    import json
    import os
    import sys

    meta = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                torch=torch.__version__, command=" ".join(sys.argv), **meta)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return meta
