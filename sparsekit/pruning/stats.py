"""Running statistics of a linear layer's inputs over the calibration tokens.

- ``col_sq_sum[j]`` = sum over all tokens of x_j^2 (Wanda's ||X_j||_2^2).
- ``hessian`` = 2/n * sum over all tokens of x x^T (SparseGPT's H), kept as a running average in
  fp32 so that no huge sum builds up; ``nsamples`` = n, the number of input vectors (tokens) seen.
"""
from __future__ import annotations

import torch


class InputStats:
    def __init__(self, in_features: int, hessian: bool = False, device: "str | torch.device" = "cpu"):
        self.in_features = int(in_features)
        self.device = torch.device(device)
        self.col_sq_sum = torch.zeros(self.in_features, dtype=torch.float32, device=self.device)
        self.hessian = (
            torch.zeros(self.in_features, self.in_features, dtype=torch.float32, device=self.device)
            if hessian
            else None
        )
        self.nsamples = 0

    def add(self, x: torch.Tensor) -> None:
        """Accumulate a batch of inputs ``x`` [..., in_features]."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"InputStats expects inputs [..., {self.in_features}], got {tuple(x.shape)}")
        x = x.detach().reshape(-1, self.in_features).to(device=self.device, dtype=torch.float32)
        m = x.shape[0]
        if m == 0:
            return
        self.col_sq_sum += torch.linalg.vector_norm(x, dim=0).square()
        n = self.nsamples + m
        if self.hessian is not None:
            self.hessian.mul_(self.nsamples / n)
            self.hessian.addmm_(x.t(), x, alpha=2.0 / n)
        self.nsamples = n

    def __repr__(self) -> str:
        return (
            f"InputStats(in_features={self.in_features}, hessian={self.hessian is not None}, "
            f"nsamples={self.nsamples}, device={self.device})"
        )
