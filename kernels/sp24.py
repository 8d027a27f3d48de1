"""Host side of the 2:4 tile-mosaic kernel: ``sp24_matmul(x, layout)`` on torch's current stream
(CUDA-graph capturable after one eager call per token bucket), or through the simulator on CPU
tensors under ``NUMBA_ENABLE_CUDASIM=1``. The layout is ``sparsekit.packed.sp24.Sp24Layout``."""
from __future__ import annotations

import torch

from . import sp24_plan
from .io import output_for, padded


def sp24_matmul(x: torch.Tensor, layout, out: torch.Tensor | None = None, *, warps: int | None = None,
                strips: int | None = None) -> torch.Tensor:
    """``y[N, M] = x[N, K] @ W^T`` (fp16 in and out, fp32 accumulate) for W in the 2:4 mosaic layout."""
    from . import launch
    from .common import SIM

    if x.dim() != 2 or x.dtype != torch.float16:
        raise ValueError(f"sp24_matmul expects fp16 x of shape [N, K], got {x.dtype} {tuple(x.shape)}")
    m, k = layout.shape
    n = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but the weight expects {k}")
    if not SIM and (not x.is_cuda or x.device != layout.device):
        raise ValueError(f"x ({x.device}) and the layout ({layout.device}) must share one CUDA device")
    out = output_for(x, m, out)
    if n == 0 or m == 0:
        return out
    gm, gk = layout.grid
    kp = gk * 64
    x = padded(x, kp)
    from .sp24_kernel import get_kernel

    nt, r, nw, rb, chunks, dyn = sp24_plan.plan(m, gk, n, launch.sm_count(x.device), warps, strips)
    kern = get_kernel(nt, r)
    tensors = (_nonempty(layout.dense), _nonempty(layout.sp), layout.tiles, x.reshape(-1).view(torch.int32),
               out.reshape(-1).view(torch.int16))
    launch.launch_tensors(kern, rb * chunks, 32 * nw, tensors, (m, n, gk, kp // 2, chunks), dyn=dyn)
    return out


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    """A kind's buffer, or one 16-byte word of zeros when the weight has no tile of that kind."""
    return t if t.numel() else torch.zeros(4, dtype=t.dtype, device=t.device)
