"""Greedy decoding with a static KV cache, one decode step captured in a CUDA graph.

Eager decoding launches a few hundred kernels per token; the bundled Numba kernels cost 35-100 us
each to launch from Python, which would dominate a decode step. So:

1. ``prefill(input_ids)`` runs the prompt eagerly into a ``transformers.StaticCache`` (fixed
   addresses, in-place updates) and picks the first new token (argmax).
2. The first ``step()`` warms the step up on a side stream (Numba compiles, cuBLAS workspaces),
   restores the state it touched, then captures ONE decode step in ``torch.cuda.graph``: forward
   on the static ``[B, 1]`` token buffer at the static position, argmax written back into the token
   buffer, position + 1. The sparse kernels launch on torch's current stream, so they are captured.
3. Every later ``step()`` is one ``graph.replay()`` (a few us per kernel).

Outside the matmuls a decode step is a long chain of tiny elementwise kernels (norms, rotary,
residuals, casts: ~2 ms per step on a 32-layer 7B model even inside a graph, measured on an H100).
``compile=True`` runs each decoder layer of the decode step through one ``torch.compile``-d call
(regional compilation: every layer sees only its own slice of the cache, so the one compiled
layer serves all of them and compiles in seconds); Inductor fuses that glue, while the sparse
matmul stays one opaque op (``sparsekit::tcabme_mm``). If compiling fails, or the compiled call would
need more variants than torch keeps (which torch itself would run uncompiled without a word), the step runs
uncompiled and ``notes`` says why (callers show each note as one line); with ``strict=True`` or
``SPARSEKIT_STRICT=1`` it raises instead. ``fusion.fuse_rms_norms`` is a cheaper, compile-free partial fix. The decoder
leaves the model it is given as it is: give ``compile=True`` a model whose packed sizes were
equalized (``fusion.equalize_packed_sizes`` / ``prepare_for_decode``), else every distinct size
compiles its own graph.

Attention runs on torch's flash, memory-efficient or math kernels, never cuDNN's (``ATTENTION_BACKENDS``): torch
2.11 picks cuDNN's for the masked fp16 calls of a static-cache decode, and its first call builds and compiles
kernels at run time, 1.0 s for the prefill and 0.7 s for the decode step on a fresh H100 and ~0.1 s each on a
warm one, while the prebuilt kernels answer their first call in 36 / 0.1 ms (issue 20, docs/benchmarks.md).

``use_graph=False`` (or no GPU) runs the very same step eagerly: the fallback, and the reference
the graph is checked against (scripts/checks/gpu_runtime.py). Prompts in a batch share one length
(no padding); decoding is greedy and ignores EOS, which is what speed measurement needs.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from sparsekit.errors import SparsekitError, strict_mode
from sparsekit.hf.compat import (LayerView, cache_kwarg, cache_layer, cache_layers, decode_forward_kwargs,
                                 layer_counters, make_static_cache)
from sparsekit.hf.modules import find_decoder_layers, is_linear
from sparsekit.runtime.sparse_linear import SparseLinear
from sparsekit.torch_compat import (is_recompile_limit_hit, raise_recompile_limit, recompile_limit,
                                    recompile_limit_raises)


def _layer_call(layer, hidden_states, layer_cache, cache_name, args, kwargs):
    return layer(hidden_states, *args, **{cache_name: LayerView(layer_cache)}, **kwargs)


_compiled_layer_call = None
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]   # (module doc)
COMPILE_OPTIONS: dict = {"backend": "inductor", "fullgraph": False}  # tests use aot_eager + fullgraph


def reset_compiled_layer() -> None:
    """Forget the compiled layer call: the next compiled decode step compiles afresh (after a
    change of ``COMPILE_OPTIONS`` or of global settings that tracing reads)."""
    global _compiled_layer_call
    _compiled_layer_call = None


def _get_compiled_layer_call():
    global _compiled_layer_call
    if _compiled_layer_call is None:
        raise_recompile_limit(64)  # one entry per (model kind, batch specialisation)
        _compiled_layer_call = torch.compile(_layer_call, **COMPILE_OPTIONS)
    return _compiled_layer_call


class _CompiledLayer(nn.Module):
    """Stands in for decoder layer ``idx`` during a decode step: runs it through the compiled call."""

    def __init__(self, layer: nn.Module, idx: int):
        super().__init__()
        self._inner = (layer,)  # a tuple: not registered as a submodule
        self.idx = idx
        self.cache_name = cache_kwarg(layer.forward)

    def forward(self, hidden_states, *args, **kwargs):
        cache = kwargs.pop(self.cache_name, None)
        if cache is None:
            raise SparsekitError(f"the model called decoder layer {self.idx} without its KV cache "
                                 f"(no {self.cache_name}=): transformers changed how layers take the cache")
        return _get_compiled_layer_call()(self._inner[0], hidden_states, cache_layer(cache, self.idx),
                                          self.cache_name, args, kwargs)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder stack (``hf.modules.find_decoder_layers``), its linears packed or not."""
    try:
        return find_decoder_layers(model, is_layer=lambda m: is_linear(m) or isinstance(m, SparseLinear))[1]
    except SparsekitError:
        raise SparsekitError(f"no decoder layer stack found in {type(model).__name__}: pass compile=False") from None


class GreedyDecoder:
    """Static-cache greedy decoding for a batch of ``batch_size`` prompts of one length."""

    def __init__(self, model: nn.Module, batch_size: int, max_len: int, *, use_graph: bool | None = None,
                 compile: bool = False, strict: bool | None = None):
        self.model = model
        self.device = next(model.parameters()).device if any(True for _ in model.parameters()) else torch.device("cpu")
        if use_graph is None:
            use_graph = self.device.type == "cuda"
        if use_graph and self.device.type != "cuda":
            raise SparsekitError("CUDA-graph decoding needs the model on a CUDA GPU: pass use_graph=False")
        self.use_graph = use_graph
        self.batch_size, self.max_len = batch_size, max_len
        self.cache = make_static_cache(model, max_len)
        self.ids = torch.zeros((batch_size, 1), dtype=torch.long, device=self.device)
        self.pos = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._extra, self._has_cache_position = decode_forward_kwargs(model)
        self._cache_name = cache_kwarg(model.forward)
        self.compile = compile
        self.strict = strict_mode() if strict is None else strict
        self._stack = None
        if compile:
            self._stack = decoder_layers(model)
            self._wrapped = [_CompiledLayer(layer, i) for i, layer in enumerate(self._stack)]
        self.notes: list[str] = []
        self.length = 0  # tokens in the cache (host-side mirror of self.pos)

    # one decode step, written so that it can be captured --------------------------------------
    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        kw = dict(self._extra)
        if self._has_cache_position:
            kw["cache_position"] = pos[0]
        kw[self._cache_name] = self.cache
        with sdpa_kernel(ATTENTION_BACKENDS):
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True, **kw)
        return out.logits[:, -1, :]

    def _step_body(self) -> None:
        if self.compile:
            originals = list(self._stack)
            try:
                for i, w in enumerate(self._wrapped):
                    self._stack[i] = w
                with recompile_limit_raises():   # never torch's silent uncompiled run past its limit
                    logits = self._forward(self.ids, self.pos)
            finally:
                for i, layer in enumerate(originals):
                    self._stack[i] = layer
        else:
            logits = self._forward(self.ids, self.pos)
        self.ids.copy_(logits.argmax(dim=-1, keepdim=True))
        self.pos.add_(1)

    # public API -------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompts ``[B, L]`` into a fresh cache; returns the first new tokens ``[B, 1]``."""
        b, n = input_ids.shape
        if b != self.batch_size:
            raise SparsekitError(f"this decoder was built for batch {self.batch_size}, got {b} prompts")
        if n >= self.max_len:
            raise SparsekitError(f"prompt of {n} tokens leaves no room in a cache of {self.max_len}")
        self.cache.reset()  # in place: the captured graph keeps pointing at the same tensors
        input_ids = input_ids.to(self.device)
        pos = torch.arange(n, device=self.device).unsqueeze(0)
        logits = self._forward(input_ids, pos)
        self.ids.copy_(logits.argmax(dim=-1, keepdim=True))
        self.pos.fill_(n)
        self.length = n
        return self.ids.clone()

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """Feed the last tokens, return the next ones ``[B, 1]`` (a view of a static buffer)."""
        if self.length == 0:
            raise SparsekitError("call prefill(input_ids) before step()")
        if self.length >= self.max_len:
            raise SparsekitError(f"the static cache is full ({self.max_len} tokens): build the decoder with a larger max_len")
        if self.use_graph:
            if self.graph is None:
                self.capture()
            self.graph.replay()
        else:
            self._step_with_fallback()
        self.length += 1
        return self.ids

    def _step_with_fallback(self) -> None:
        """One eager step; if compiling it fails, note why and redo the step without compiling."""
        if not self.compile:
            self._step_body()
            return
        saved = self._snapshot()
        try:
            self._step_body()
        except Exception as e:  # noqa: BLE001 - said in self.notes (or raised when strict)
            self._restore(saved)
            why = (f"torch.compile of the decode step failed ({type(e).__name__}: "
                   f"{(str(e).splitlines() or [''])[0][:200]})")
            if is_recompile_limit_hit(e):
                why = (f"the compiled decoder layer needed more than torch's {recompile_limit()} variants: layers of "
                       "one shape differ in tensor sizes (equalize them: runtime.fusion.equalize_packed_sizes)")
            if self.strict:
                raise SparsekitError(f"{why} (SPARSEKIT_STRICT is set: no fallback)") from e
            self.compile = False
            self.notes.append(f"{why}: decoding without it, slower")
            self._step_body()

    def _snapshot(self) -> list:
        """Copies of the small mutable state a step touches (token, position, cache counters)."""
        saved = [(self.ids, self.ids.clone()), (self.pos, self.pos.clone())]
        for layer in cache_layers(self.cache):
            saved += [(t, t.clone()) if v is None else (t, v) for t, v in layer_counters(layer)]
        return saved

    @staticmethod
    def _restore(saved: list) -> None:
        for target, val in saved:
            if isinstance(target, torch.Tensor):
                target.copy_(val)
            else:
                setattr(target[0], target[1], val)

    @torch.no_grad()
    def capture(self, warmup: int = 2) -> None:
        """Warm up on a side stream (state restored afterwards), then capture one decode step.

        The warm-up writes the key/value of the current position, which the first real step
        overwrites with the same numbers, so it leaves no trace.
        """
        if self.length == 0:
            raise SparsekitError("call prefill(input_ids) before capturing the decode step")
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                saved = self._snapshot()
                try:
                    self._step_with_fallback()
                finally:
                    self._restore(saved)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        saved = self._snapshot()  # capturing records work but must leave Python-side state alone
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._step_body()
        except Exception as e:
            raise SparsekitError(
                f"could not capture the decode step in a CUDA graph ({type(e).__name__}: {e}): "
                "use the eager fallback (use_graph=False)"
            ) from e
        self._restore(saved)
        self.graph = graph

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation: ``[B, L]`` -> ``[B, L + max_new_tokens]`` (EOS is not special)."""
        if max_new_tokens < 1:
            return input_ids
        toks = [self.prefill(input_ids)]
        for _ in range(max_new_tokens - 1):
            toks.append(self.step().clone())
        return torch.cat([input_ids.to(self.device), *toks], dim=1)
