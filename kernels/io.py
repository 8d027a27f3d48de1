"""What the matmul entry points share: the output tensor they write and x padded to whole tiles."""
from __future__ import annotations

import torch


def output_for(x: torch.Tensor, m: int, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked (contiguous fp16 ``[N, m]``), or a new one."""
    n = x.shape[0]
    if out is None:
        return torch.empty((n, m), dtype=torch.float16, device=x.device)
    if out.shape != (n, m) or out.dtype != torch.float16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp16 tensor of shape {(n, m)}")
    return out


def padded(x: torch.Tensor, kp: int) -> torch.Tensor:
    """``x`` with zero columns up to ``kp``, contiguous and 16-byte aligned (a copy only when needed)."""
    n, k = x.shape
    if kp != k or not x.is_contiguous() or x.data_ptr() % 16:
        xp = torch.zeros((n, kp), dtype=x.dtype, device=x.device)
        xp[:, :k] = x
        return xp
    return x
