"""What each part of sp24_ws's step costs, and candidate variants of it: its kernels built with one part of every
step left out, or built another way (docs/kernels-notes.md "v24"). A diagnostic, never on a product path.

An **ablation** computes a wrong product (or none), and only its time means anything:

======================  =====================================================================================
ablation                left out
======================  =====================================================================================
``no_products``         the products and A loads: consumers wait for each stage and release it at once
``no_copies``           the producer and every wait on it: the consumers load A and multiply stale shared memory
``no_x``                the X slab's copy (the weights' copies and every wait stay)
``no_weights``          the weight tiles' copies (X's copy and every wait stay)
``no_loop``             the step loop (set-up, the end of the tile, the launch, the host's ``x_slabs``)
======================  =====================================================================================

A **variant** is the whole kernel, correct, built another way: ``early_release`` and ``late_release`` (at every
tile width, each step retires the previous step's products and frees their stage before / after waiting for its
own copies; the default does the first from 64 tokens a tile, docs/kernels-notes.md "v25") and ``two_blocks``
(registers capped so that two blocks fit an SM: 112 for two warpgroups, where 128-token tiles otherwise take one
SM each; no faster, v25).

Usage (``scripts/bench/probe_sp24_ablate.py`` times each beside the default build)::

    with built_as("no_products"):
        sp24_matmul(x, layout, kernel="ws")
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import sp24_ws

ABLATIONS = sp24_ws.ABLATIONS
VARIANTS = sp24_ws.VARIANTS


@contextlib.contextmanager
def built_as(mode: str | None) -> Iterator[None]:
    """sp24_ws launches inside the block run kernels built as ``mode`` (one of ABLATIONS or VARIANTS; None: the
    default build). Weights with dense tiles and thread-block clusters are refused there (``AssertionError`` at
    the build)."""
    if mode is not None and mode not in ABLATIONS + VARIANTS:
        raise ValueError(f"unknown sp24_ws build {mode!r}: one of {', '.join(ABLATIONS + VARIANTS)}")
    before = sp24_ws.probe_build[0]
    sp24_ws.probe_build[0] = mode
    try:
        yield
    finally:
        sp24_ws.probe_build[0] = before
