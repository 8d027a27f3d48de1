"""X rewritten for the warp-specialized kernels before their op, so that a compiled step fuses the rewrite
(issues 21, 22).

spmm_ws (TCA-BME) and sp24_ws (2:4) read X as slabs of 8x8 core matrices (``sparsekit.kernels.sp24_ws.x_slabs``).
Made inside their op, the rewrite is a launch of its own at every call: 2.6-2.8 us of a ~30 us call at 16
tokens on an H100 (docs/benchmarks.md "Session 21"). Made here, in the layer's own code, it is ordinary torch
code: in a ``torch.compile``-d decode step Inductor can write X in that layout from the kernel that computes X
(the norm, the gated activation), and the op gets the slabs. Eager calls make them with ``x_slabs`` as before.

``tcabme_slabs`` and ``sp24_slabs`` give a ``SparseLinear``'s kernel op the slabs where the kernel that will run
reads them, else None. Which kernel runs, at which tile width, the kernels' own functions decide
(``kernels.matmul.slab_tokens``, ``kernels.sp24.slab_tokens``), once per shape inside a compiled step. A step
compiled for a dynamic batch (torch's automatic dynamic shapes: from the second batch size of ``eval --speed``
or ``bench_e2e`` on) is specialised on its batch size here (``operator.index``, which Dynamo answers with a
number and a guard: one compile per batch size, as the kernels choose per token count anyway). A symbolic
size given to the constant-result call failed the compile (session 23: "SymNodeVariable() is not a
constant"); ``int()`` keeps it symbolic, and telling a symbolic size from a number is not possible through
public API there (``isinstance`` says int; ``statically_known_true`` knows the range the step's guards bound
it to).
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F


@torch.compiler.assume_constant_result
def _tcabme_tokens(index: int, m: int, k: int, n: int) -> int:
    from sparsekit.kernels.matmul import slab_tokens

    return slab_tokens(torch.device("cuda", index), m, k, n)


@torch.compiler.assume_constant_result
def _sp24_tokens(index: int, m: int, k: int, n: int, hybrid: bool) -> int:
    from sparsekit.kernels.sp24 import slab_tokens

    return slab_tokens(torch.device("cuda", index), m, k, n, hybrid)


def slabs(x: torch.Tensor, nt: int) -> torch.Tensor:
    """``x`` [N, K] (fp16) laid out as ``x_slabs`` lays it out for ``nt`` tokens a tile, K padded with zeros to
    a multiple of 64 and the tokens to one of ``nt``: in a compiled step as fp16 values (one padded, permuted
    copy, which Inductor may join to the kernel that wrote ``x``), else as ``x_slabs``'s int64 words (the
    faster copy of the same bytes when it runs alone)."""
    n, k = x.shape
    kp, chunks = -(-k // 64) * 64, -(-n // nt)
    if torch.compiler.is_compiling():
        v = F.pad(x, (0, kp - k, 0, chunks * nt - n)).reshape(chunks, nt // 8, 8, kp // 64, 8, 8)
        return v.permute(0, 3, 1, 4, 2, 5).contiguous().reshape(chunks * kp // 64, nt * 64)  # [c, gk, blk, part, r8, v]
    from sparsekit.kernels.io import padded
    from sparsekit.kernels.sp24_ws import x_slabs

    return x_slabs(padded(x, kp), nt)


def tcabme_slabs(layer, x: torch.Tensor) -> torch.Tensor | None:
    """The slabs ``layer``'s (a ``SparseLinear``) TCA-BME kernel will read for ``x`` [N, K] (fp16, contiguous,
    on its GPU), or None where that kernel reads X itself."""
    nt = _tcabme_tokens(x.device.index, layer.out_features, layer.in_features, operator.index(x.shape[0]))
    return slabs(x, nt) if nt else None


def sp24_slabs(layer, x: torch.Tensor) -> torch.Tensor | None:
    """The same for ``layer``'s 2:4 mosaic kernel."""
    nt = _sp24_tokens(x.device.index, layer.out_features, layer.in_features, operator.index(x.shape[0]),
                      layer.sp24_dense.numel() > 0)
    return slabs(x, nt) if nt else None
