"""What each part of sp24_ws's step costs: its kernels built with one part of every step left out (docs/kernels-
notes.md "v24"). A diagnostic, never on a product path: an ablated launch computes a wrong product (or none),
and only its time means anything.

======================  =====================================================================================
ablation                left out
======================  =====================================================================================
``no_products``         the products and A loads: consumers wait for each stage and release it at once
``no_copies``           the producer and every wait on it: the consumers load A and multiply stale shared memory
``no_x``                the X slab's copy (the weights' copies and every wait stay)
``no_weights``          the weight tiles' copies (X's copy and every wait stay)
``no_loop``             the step loop (set-up, the end of the tile, the launch, the host's ``x_slabs``)
======================  =====================================================================================

Usage (``scripts/bench/probe_sp24_ablate.py`` times each beside the whole kernel)::

    with ablated("no_products"):
        sp24_matmul(x, layout, kernel="ws")
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import sp24_ws

ABLATIONS = sp24_ws.ABLATIONS


@contextlib.contextmanager
def ablated(mode: str | None) -> Iterator[None]:
    """sp24_ws launches inside the block run kernels without ``mode``'s part (None: the whole kernel). Weights with
    dense tiles and thread-block clusters are refused there (``AssertionError`` at the build)."""
    if mode is not None and mode not in ABLATIONS:
        raise ValueError(f"unknown ablation {mode!r}: one of {', '.join(ABLATIONS)}")
    before = sp24_ws.ablation[0]
    sp24_ws.ablation[0] = mode
    try:
        yield
    finally:
        sp24_ws.ablation[0] = before
