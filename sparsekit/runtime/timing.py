"""Timing on the GPU (CUDA events around a call, replays of a CUDA graph) and the bytes a model holds.

In the runtime stage because the runtime measures at load time (``runtime.dispatch``); evaluation and
the scripts use it too.
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch
from torch import nn


def time_ms(fn: Callable[[], object], *, repeats: int = 1, warmup: int = 0) -> float:
    """Milliseconds of GPU time one call of ``fn`` takes, measured with CUDA events on the current
    stream: ``warmup`` untimed calls (then a synchronize), then the median of ``repeats`` timed ones."""
    for _ in range(warmup):
        fn()
    if warmup:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn: Callable[[], object], *, repeats: int = 20) -> float:
    """Median milliseconds of one replay of a CUDA graph of ``fn`` (captured after one eager call)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = time_ms(graph.replay, repeats=repeats, warmup=1)
    del graph
    return ms


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
