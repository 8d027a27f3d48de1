"""Prefill on packed weights only, with each layer's decode hidden behind the previous layer's GEMM.

Above ``dense_above`` tokens a ``SparseLinear`` without a dense copy decodes its weight (one kernel,
``sparsekit.kernels.decode``) and runs cuBLAS. Done in turn, the decode adds its time to every GEMM
(0.11-0.19 ms per 7B weight, against 0.1-1 ms of GEMM at 512-4096 tokens). A :class:`PrefillPipeline`
(issue 21, item 2, the second option) overlaps them: two scratch buffers of the largest decoded weight,
and a side stream that decodes the next layer into one buffer while the current layer's GEMM reads the
other.

- The order of the layers is learnt from the first prefill: the pipeline records the ``SparseLinear``
  calls that reach it until the first one comes again; that pass decodes in turn, on the main stream.
- After that, when layer ``i`` asks for its weight, the decode of the layer after it in that order is
  put on the side stream into the other buffer, behind an event that marks the end of the GEMM that
  last read that buffer (recorded by :meth:`PrefillPipeline.done` after each GEMM). Layer ``i`` itself
  waits for the event of its own decode, issued one layer earlier.
- A layer that asks out of order (another model path, a different prompt length bucket, ...) decodes
  on the main stream like the first pass, and the chain restarts from it: slower, never wrong. The
  counters ``hits`` / ``misses`` say how often that happened.
- Memory: two buffers of the largest padded weight (7B shapes: 2 x 86 MB), allocated at the first use.

On the CPU (tests) the same bookkeeping runs with no stream: every decode is immediate.
Used in eager prefill only (never inside ``torch.compile`` or a CUDA-graph capture). The loader attaches
it with ``SPARSEKIT_PREFILL_AHEAD=1`` (opt-in until ``scripts/checks/gpu_prefill.py`` has checked it on a GPU).
"""
from __future__ import annotations

import torch
from torch import nn


class PrefillPipeline:
    """Double-buffered decode-ahead for the prefill of the ``SparseLinear`` layers of one model."""

    def __init__(self, layers: list, device: torch.device):
        self.layers = list(layers)
        self.device = torch.device(device)
        self.numel = max((_padded_numel(m) for m in self.layers), default=0)
        self.bufs: list[torch.Tensor] = []
        self.side = None
        self.order: list = []            # recorded call order (complete once ``known``)
        self.known = False
        self.index: dict[int, int] = {}  # id(layer) -> position in ``order``
        self.pending = None              # (layer, slot, event or None): the decode issued ahead
        self.used = [None, None]         # per buffer: event after the last GEMM that read it
        self.slot = 1                    # buffer of the last decode
        self.hits = 0
        self.misses = 0

    # ------------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs)

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "layers": len(self.order) if self.known else None,
                "buffer_bytes": self.nbytes()}

    def _buffers(self, dtype: torch.dtype) -> None:
        if not self.bufs or self.bufs[0].dtype != dtype:
            self.bufs = [torch.empty(self.numel, dtype=dtype, device=self.device) for _ in range(2)]
            self.used = [None, None]
            self.pending = None
            if self.device.type == "cuda":
                if self.side is None:
                    self.side = torch.cuda.Stream(self.device)
                for b in self.bufs:               # freed later, they wait for the side stream's work too
                    b.record_stream(self.side)

    def _decode(self, layer, slot: int) -> torch.Tensor:
        """Decode ``layer`` into buffer ``slot`` on the current stream; the ``[out, in]`` view."""
        return _decode_into(layer, self.bufs[slot])

    def _issue_ahead(self, layer, slot: int) -> None:
        """Decode ``layer`` into ``slot`` on the side stream, after the last GEMM that read ``slot``."""
        if self.side is None:                       # CPU: at once
            self.pending = (layer, slot, None, self._decode(layer, slot))
            return
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main) if self.used[slot] is None else self.side.wait_event(self.used[slot])
        with torch.cuda.stream(self.side):
            w = self._decode(layer, slot)
            ev = torch.cuda.Event()
            ev.record(self.side)
        self.pending = (layer, slot, ev, w)

    # ------------------------------------------------------------------------------------------------
    def weight(self, layer) -> tuple[torch.Tensor, int]:
        """(the decoded ``[out, in]`` weight of ``layer``, its buffer): ready on the current stream.
        Call :meth:`done` with the buffer once the GEMM that reads it is enqueued."""
        self._buffers(layer.values.dtype)
        was_known = self.known
        if not self.known:                          # first pass: learn the order
            if self.order and layer is self.order[0]:
                self.known = True
                self.index = {id(m): i for i, m in enumerate(self.order)}
            else:
                self.order.append(layer)
        pend = self.pending
        if pend is not None and pend[0] is layer:
            _, slot, ev, w = pend
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)
            self.pending = None
            self.hits += 1
        else:
            if was_known:
                self.misses += 1
            if pend is not None:                    # its buffer may still be written: take the other one
                if pend[2] is not None:
                    torch.cuda.current_stream(self.device).wait_event(pend[2])
                self.pending = None
                slot = 1 - pend[1]
            else:
                slot = 1 - self.slot
            w = self._decode(layer, slot)
        self.slot = slot
        if self.known and id(layer) in self.index:
            nxt = self.order[(self.index[id(layer)] + 1) % len(self.order)]
            self._issue_ahead(nxt, 1 - slot)
        return w, slot

    def done(self, slot: int) -> None:
        """The GEMM that reads buffer ``slot`` is enqueued on the current stream: a later decode into it
        waits for it."""
        if self.side is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.used[slot] = ev


def _padded_numel(layer) -> int:
    gm, gk = -(-layer.out_features // 64), -(-layer.in_features // 64)
    return gm * gk * 4096


def _decode_into(layer, buf: torch.Tensor) -> torch.Tensor:
    p = layer.packed
    if buf.is_cuda:
        from sparsekit.runtime.sparse_linear import kernels_ready

        if kernels_ready():
            from sparsekit.kernels.decode import tcabme_decode

            return tcabme_decode(p, out=buf)
    from sparsekit.packed.tcabme import decode

    m, k = layer.out_features, layer.in_features
    view = buf[: m * k].view(m, k)
    view.copy_(decode(p))
    return view


def prefill_ahead_wanted() -> bool:
    """``SPARSEKIT_PREFILL_AHEAD=1``: the loader attaches a pipeline (opt-in for now)."""
    from sparsekit.errors import env_switch

    return env_switch("SPARSEKIT_PREFILL_AHEAD", "decode one layer ahead")


def enable_prefill_pipeline(model: nn.Module) -> PrefillPipeline | None:
    """Attach one :class:`PrefillPipeline` to every ``SparseLinear`` of ``model`` (None when it has none).
    Layers with a dense copy, or at token counts that run a sparse kernel, never reach it."""
    from sparsekit.runtime.sparse_linear import SparseLinear

    layers = [m for m in model.modules() if isinstance(m, SparseLinear)]
    if not layers:
        return None
    pipe = PrefillPipeline(layers, layers[0].values.device)
    for m in layers:
        m.prefill_pipeline = pipe
    return pipe
