"""The reference product: decode the packed weight to dense, then one matmul (any device)."""
from __future__ import annotations

import torch


def reference_matmul(x: torch.Tensor, w) -> torch.Tensor:
    """``x @ W^T`` with W = decode(w); computed in fp32 on CPU (fp16 matmul is slow/unsupported
    there), in x's dtype with fp32 accumulation on CUDA; returns x's dtype."""
    from sparsekit.packed.tcabme import decode

    dense = decode(w).to(x.device)
    if x.device.type == "cpu":
        return (x.float() @ dense.float().t()).to(x.dtype)
    return x @ dense.to(x.dtype).t()
