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

``use_graph=False`` (or no GPU) runs the very same step eagerly: the fallback, and the reference
the graph is checked against (scripts/gpu_check_runtime.py). Prompts in a batch share one length
(no padding); decoding is greedy and ignores EOS, which is what speed measurement needs.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from sparsekit.errors import SparsekitError


def _make_static_cache(model: nn.Module, max_len: int):
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # older 4.x signature
        p = next(model.parameters())
        return StaticCache(config=model.config, max_batch_size=1, max_cache_len=max_len,
                           device=p.device, dtype=p.dtype)


class GreedyDecoder:
    """Static-cache greedy decoding for a batch of ``batch_size`` prompts of one length."""

    def __init__(self, model: nn.Module, batch_size: int, max_len: int, *, use_graph: bool | None = None):
        self.model = model
        self.device = next(model.parameters()).device if any(True for _ in model.parameters()) else torch.device("cpu")
        if use_graph is None:
            use_graph = self.device.type == "cuda"
        if use_graph and self.device.type != "cuda":
            raise SparsekitError("CUDA-graph decoding needs the model on a CUDA GPU: pass use_graph=False")
        self.use_graph = use_graph
        self.batch_size, self.max_len = batch_size, max_len
        self.cache = _make_static_cache(model, max_len)
        self.ids = torch.zeros((batch_size, 1), dtype=torch.long, device=self.device)
        self.pos = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._extra = {}
        params = inspect.signature(model.forward).parameters
        if "logits_to_keep" in params:
            self._extra["logits_to_keep"] = 1
        self._has_cache_position = "cache_position" in params
        self.length = 0  # tokens in the cache (host-side mirror of self.pos)

    # one decode step, written so that it can be captured --------------------------------------
    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        kw = dict(self._extra)
        if self._has_cache_position:
            kw["cache_position"] = pos[0]
        out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True, **kw)
        return out.logits[:, -1, :]

    def _step_body(self) -> None:
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
            self._step_body()
        self.length += 1
        return self.ids

    def _snapshot(self) -> list:
        """Copies of the small mutable state a step touches (token, position, cache counters)."""
        saved = [(self.ids, self.ids.clone()), (self.pos, self.pos.clone())]
        for layer in getattr(self.cache, "layers", []):
            for key, val in vars(layer).items():
                if key in ("keys", "values"):
                    continue
                if isinstance(val, torch.Tensor):
                    saved.append((val, val.clone()))
                elif isinstance(val, int) and not isinstance(val, bool):
                    saved.append(((layer, key), val))
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
                self._step_body()
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
                "use the eager fallback (use_graph=False / --no-cuda-graphs)"
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


def greedy_generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *,
                    use_graph: bool | None = None) -> torch.Tensor:
    """One-shot helper: ``GreedyDecoder(...).generate(...)`` with a cache just large enough."""
    b, n = input_ids.shape
    dec = GreedyDecoder(model, b, n + max_new_tokens, use_graph=use_graph)
    return dec.generate(input_ids, max_new_tokens)


class FusedRMSNorm(nn.Module):
    """RMSNorm as ``weight * rms_norm(x)``: one fused kernel (``F.rms_norm``, fp32 inside) and one
    multiply, instead of the eight elementwise launches of the HF modules. Same rounding points
    as the HF Llama/Mistral/Qwen2 norm (normalise in fp32, round to the input dtype, scale)."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.rms_norm(x, (x.shape[-1],), None, self.eps)
        return self.weight * y


def fuse_rms_norms(model: nn.Module) -> int:
    """Swap, in place, the HF ``*RMSNorm`` modules of the Llama form (``weight * norm(x)``, eps in
    ``variance_epsilon``) for ``FusedRMSNorm``; returns how many. Decode steps are launch-bound
    outside the matmuls, so this shortens every step, dense and sparse alike. Gemma-style norms
    (``1 + weight``) are left alone."""
    import inspect as _inspect

    swapped = 0
    for name, mod in list(model.named_modules()):
        if not type(mod).__name__.endswith("RMSNorm") or not hasattr(mod, "variance_epsilon"):
            continue
        try:
            src = _inspect.getsource(type(mod).forward)
        except (OSError, TypeError):
            continue
        if "self.weight * hidden_states.to(input_dtype)" not in src:
            continue  # another formula: keep the original
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FusedRMSNorm(mod.weight, mod.variance_epsilon))
        swapped += 1
    return swapped
