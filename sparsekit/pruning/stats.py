"""Running statistics of a linear layer's inputs over the calibration tokens, and the hooks that gather them.

- ``col_sq_sum[j]`` = sum over all tokens of x_j^2 (Wanda's ||X_j||_2^2).
- ``hessian`` = 2/n * sum over all tokens of x x^T (SparseGPT's H), kept as a running average in
  fp32 so that no huge sum builds up; ``nsamples`` = n, the number of input vectors (tokens) seen.

:class:`StatsCollector` feeds them from forward hooks on a decoder layer's linears;
:func:`collect_stats` runs one layer's calibration activations through it.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from sparsekit.hf import modules as L


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


class StatsCollector:
    """Forward hooks that feed each linear's input into an ``InputStats``.

    Linears that receive the very same input tensor (q/k/v, gate/up) share one stats object: the
    grouping is found on the first mini-batch, where the first linear to see a tensor owns it.
    """

    def __init__(self, linears: dict[str, nn.Module], hessian: bool, device: torch.device):
        self._make = lambda in_features: InputStats(in_features, hessian=hessian, device=device)
        self.linears = linears
        self.stats: dict[str, InputStats] = {}
        self.owner: dict[str, bool] = {}  # True: this linear adds to its (possibly shared) stats
        self._first: dict[int, tuple[torch.Tensor, object]] | None = {}  # id(x) -> (x, stats)
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in linears.items()]

    def _hook(self, name: str):
        def hook(module, inputs, output):
            x = inputs[0]
            if name not in self.stats:
                if self._first is not None:
                    seen = self._first.get(id(x))
                    if seen is not None and seen[0] is x:
                        self.stats[name], self.owner[name] = seen[1], False
                        return
                st = self._make(L.weight_out_in(module).shape[1])
                if self._first is not None:
                    self._first[id(x)] = (x, st)  # holding x keeps its id unique during the batch
                self.stats[name], self.owner[name] = st, True
            if self.owner[name]:
                self.stats[name].add(x.detach())

        return hook

    def end_batch(self) -> None:
        self._first = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._first = None

    def groups(self) -> list[list[str]]:
        out: dict[int, list[str]] = {}
        for name, st in self.stats.items():
            out.setdefault(id(st), []).append(name)
        return list(out.values())


@contextlib.contextmanager
def _tf32(enabled: bool):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def collect_stats(layer: nn.Module, linears: dict[str, nn.Module], acts, hessian: bool,
                  device: torch.device, write: bool = False) -> dict[str, InputStats]:
    """Run every mini-batch of ``acts`` (a ``capture.Activations``) through ``layer`` (TF32 matmuls
    allowed) and return each linear's ``InputStats`` (shared by linears fed the same tensor). With
    ``write`` the layer's outputs replace its inputs in ``acts`` (a pass that changes no weight)."""
    from sparsekit.pruning.capture import _first_output

    collector = StatsCollector(linears, hessian, device)
    try:
        with _tf32(True):
            for i, ((a, b), args, kwargs) in enumerate(zip(acts.spans, acts.args, acts.kwargs)):
                out = layer(acts.hidden[a:b], *args, **kwargs)
                if write:
                    acts.hidden[a:b].copy_(_first_output(out))
                del out
                if i == 0:
                    collector.end_batch()
    finally:
        collector.remove()
    return collector.stats
