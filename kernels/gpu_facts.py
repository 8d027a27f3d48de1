"""What the launch plans need to know of a GPU beyond its SM count: how fast its memory is.

A decode kernel is bound by its bytes; to hold its speed on a GPU with faster memory it must keep more bytes in
flight per SM (the bandwidth-delay product grows), so a plan tuned on one memory speed can lose on another. The
2:4 plans (``sp24_plan``) were tuned on an H100 (3.35 TB/s) and, where an H200 (4.8 TB/s) measured another plan
faster, take ``fast=True`` there: docs/kernels-notes.md "v41". ``SPARSEKIT_FAST_MEMORY`` (``1`` or ``0``) sets the
choice on any GPU, e.g. to time both plans on one.
"""
from __future__ import annotations

import os

import torch

from .common import SIM

FAST_MEM_GBPS = 4000        # ``fast_memory``: this much peak memory bandwidth or more (an H200: ~4800; H100 ~3350)
FAST_NAMES = ("H200",)      # where the driver reports no memory clock (CUDA 13 dropped it from the properties)

_gbps: dict = {}


def bandwidth_gbps(device: torch.device) -> float:
    """Peak memory bandwidth of ``device`` in GB/s from its memory clock and bus width (double data rate), or 0
    where torch does not report them (cached; 0 under the simulator)."""
    if SIM:
        return 0.0
    key = str(device)
    if key not in _gbps:
        props = torch.cuda.get_device_properties(device)
        khz, bits = getattr(props, "memory_clock_rate", 0) or 0, getattr(props, "memory_bus_width", 0) or 0
        _gbps[key] = 2 * khz * 1e3 * bits / 8 / 1e9
    return _gbps[key]


def fast_memory(device: torch.device) -> bool:
    """Whether ``device``'s memory is fast enough (FAST_MEM_GBPS or more; by its name where the bandwidth is not
    reported) for the plans measured on an H200; ``SPARSEKIT_FAST_MEMORY`` (``1``, ``0``) overrides it. False under the
    simulator unless overridden."""
    forced = os.environ.get("SPARSEKIT_FAST_MEMORY", "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"SPARSEKIT_FAST_MEMORY takes 1 (the fast-memory plans) or 0 (the others), got {forced!r}")
    if forced:
        return forced == "1"
    if SIM:
        return False
    gbps = bandwidth_gbps(device)
    if gbps > 0:
        return gbps >= FAST_MEM_GBPS
    name = torch.cuda.get_device_name(device)
    return any(n in name for n in FAST_NAMES)
