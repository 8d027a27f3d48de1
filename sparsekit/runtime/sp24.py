"""The 2:4 tile-mosaic path of ``SparseLinear`` (issue 22), off unless a caller turns it on.

:func:`enable_sp24` transcodes the TCA-BME weight of every ``SparseLinear`` of a model whose tiles are
all 2:4 or dense (``sparsekit.packed.sp24``) and keeps the layout beside it (non-persistent buffers:
nothing changes on disk). Those layers then run ``sparsekit.kernels.sp24.sp24_matmul`` (``mma.sp`` on
2:4 tiles, ``mma.sync`` on dense ones) on a GPU wherever they would run the TCA-BME kernel (fp16, at
most ``dense_above`` tokens) up to ``SparseLinear.sp24_max_n`` tokens; prefill and the CPU keep their paths. Not on by default: it has not been
measured on a GPU yet (docs/kernels-notes.md "v13-sp" holds the prediction, scripts/gpu_check_sp24.py
the check).
"""
from __future__ import annotations

import torch
from torch import nn

from sparsekit.errors import SparsekitError, strict_mode
from sparsekit.packed.sp24 import Sp24Layout, transcode


@torch.library.custom_op("sparsekit::sp24_mm", mutates_args=())
def sp24_mm(x: torch.Tensor, dense: torch.Tensor, sp: torch.Tensor, tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x[N, K] @ W^T`` through the 2:4 mosaic kernel, as one torch op (kept whole by ``torch.compile``)."""
    from sparsekit.kernels.sp24 import sp24_matmul

    return sp24_matmul(x, Sp24Layout(dense=dense, sp=sp, tiles=tiles, shape=(out_features, x.shape[1])))


@sp24_mm.register_fake
def _sp24_mm_fake(x, dense, sp, tiles, out_features):
    return x.new_empty((x.shape[0], out_features))


def enable_sp24(model: nn.Module) -> dict[str, str]:
    """Give every eligible ``SparseLinear`` of ``model`` its 2:4 layout; returns ``{layer: "sp24"}`` or
    ``{layer: why not}``. A layer with an unstructured tile is not eligible (it keeps TCA-BME), except
    under ``SPARSEKIT_STRICT=1``, where that is an error."""
    from sparsekit.runtime.sparse_linear import SparseLinear

    out: dict[str, str] = {}
    for name, m in model.named_modules():
        if not isinstance(m, SparseLinear):
            continue
        if m.values.dtype != torch.float16:
            out[name] = f"values are {m.values.dtype}: the 2:4 kernel takes fp16"
            continue
        try:
            m.use_sp24(transcode(m.packed))
            out[name] = "sp24"
        except SparsekitError as e:
            if strict_mode():
                raise SparsekitError(f"{name}: {e} (SPARSEKIT_STRICT is set)") from None
            out[name] = str(e)
    return out
