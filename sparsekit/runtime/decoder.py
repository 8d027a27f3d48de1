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
matmul stays one opaque op (``sparsekit::tcabme_mm``). If compiling fails the step runs uncompiled
and ``notes`` says why. ``fuse_rms_norms`` is a cheaper, compile-free partial fix.

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


class _LayerCache:
    """One layer of a StaticCache, presented to that decoder layer as if it were the whole cache.

    The layer then never indexes the cache by its ``layer_idx``, so one compiled decoder layer
    serves every layer of the stack (no recompilation per layer index)."""

    is_compileable = True

    def __init__(self, layer):
        self.layer = layer

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return self.layer.update(key_states, value_states, *args, **kwargs)


def _layer_call(layer, hidden_states, cache_layer, args, kwargs):
    return layer(hidden_states, *args, past_key_values=_LayerCache(cache_layer), **kwargs)


_compiled_layer_call = None
COMPILE_OPTIONS: dict = {"backend": "inductor", "fullgraph": False}  # tests use aot_eager + fullgraph


def _get_compiled_layer_call():
    global _compiled_layer_call
    if _compiled_layer_call is None:
        cfg = torch._dynamo.config
        # one entry per (model kind, batch specialisation); the default limit (8) is tight when
        # several models are measured in one process
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 64))
                break
        _compiled_layer_call = torch.compile(_layer_call, **COMPILE_OPTIONS)
    return _compiled_layer_call


class _CompiledLayer(nn.Module):
    """Stands in for decoder layer ``idx`` during a decode step: runs it through the compiled call."""

    def __init__(self, layer: nn.Module, idx: int):
        super().__init__()
        self._inner = (layer,)  # a tuple: not registered as a submodule
        self.idx = idx

    def forward(self, hidden_states, *args, past_key_values=None, **kwargs):
        return _get_compiled_layer_call()(self._inner[0], hidden_states, past_key_values.layers[self.idx],
                                          args, kwargs)


def equalize_packed_sizes(model: nn.Module) -> float:
    """Pad the ``values`` buffer of every SparseLinear to the longest one of its shape, in place.

    Layers of one shape then look alike to ``torch.compile`` (a tensor's size is part of what a
    compiled graph is specialised to), so the one compiled decoder layer serves the whole stack.
    The padding sits past ``gtile_offsets[-1]`` and is never read. Returns the added fraction of
    packed bytes (small: layers pruned to one sparsity differ by a fraction of a percent).
    """
    from sparsekit.runtime.sparse_linear import SparseLinear

    groups: dict = {}
    for mod in model.modules():
        if isinstance(mod, SparseLinear):
            groups.setdefault((mod.out_features, mod.in_features, mod.values.dtype), []).append(mod)
    added = total = 0
    for mods in groups.values():
        longest = max(m.values.numel() for m in mods)
        for m in mods:
            n = m.values.numel()
            total += n
            if n < longest:
                padded = m.values.new_zeros(longest)
                padded[:n] = m.values
                m.values = padded
                added += longest - n
    if added:
        from sparsekit.runtime.sparse_linear import release_kernel_caches

        release_kernel_caches()  # else the kernels' cached views keep the unpadded copies alive
    return added / max(1, total)


def decoder_stack(model: nn.Module) -> nn.ModuleList:
    """The decoder layers: the longest ModuleList of same-class blocks holding a linear layer
    (``nn.Linear``, ``Conv1D`` or ``SparseLinear``)."""
    from sparsekit.hf.modules import is_linear
    from sparsekit.runtime.sparse_linear import SparseLinear

    best = fallback = None
    for mod in model.modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0 or len({type(c) for c in mod}) != 1:
            continue
        if fallback is None or len(mod) > len(fallback):
            fallback = mod
        if not any(is_linear(m) or isinstance(m, SparseLinear) for m in mod[0].modules()):
            continue
        if best is None or len(mod) > len(best):
            best = mod
    best = best if best is not None else fallback
    if best is None:
        raise SparsekitError(f"no decoder layer stack found in {type(model).__name__}: pass compile=False")
    return best


class GreedyDecoder:
    """Static-cache greedy decoding for a batch of ``batch_size`` prompts of one length."""

    def __init__(self, model: nn.Module, batch_size: int, max_len: int, *, use_graph: bool | None = None,
                 compile: bool = False):
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
        self.compile = compile
        self._stack = None
        if compile:
            self._stack = decoder_stack(model)
            equalize_packed_sizes(model)
            self._wrapped = [_CompiledLayer(layer, i) for i, layer in enumerate(self._stack)]
        self.notes: list[str] = []
        self.length = 0  # tokens in the cache (host-side mirror of self.pos)

    # one decode step, written so that it can be captured --------------------------------------
    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        kw = dict(self._extra)
        if self._has_cache_position:
            kw["cache_position"] = pos[0]
        out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True, **kw)
        return out.logits[:, -1, :]

    def _step_body(self) -> None:
        if self.compile:
            originals = list(self._stack)
            try:
                for i, w in enumerate(self._wrapped):
                    self._stack[i] = w
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
        except Exception as e:
            self._restore(saved)
            self.compile = False
            self.notes.append(f"torch.compile of the decode step failed ({type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0][:200]}): decoding without it")
            self._step_body()

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


# fusing projections that read the same input ----------------------------------------------------
PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProjection(nn.Module):
    """One linear (dense or SparseLinear) computing several projections of the same input at
    once; ``ProjectionPart`` modules stand in for the original projections and hand out slices."""

    def __init__(self, fused: nn.Module, sizes: list[int]):
        super().__init__()
        self.fused = fused
        self.sizes = list(sizes)
        self._last: tuple | None = None  # (input, outputs) of the latest call

    def part_output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        last = self._last
        if index == 0 or last is None or last[0] is not x:
            outs = self.fused(x).split(self.sizes, dim=-1)
            self._last = last = (x, outs)
        if index == len(self.sizes) - 1:
            self._last = None  # the last part has been handed out: keep no activations alive
        return last[1][index]


class ProjectionPart(nn.Module):
    def __init__(self, owner: FusedProjection, index: int, in_features: int, out_features: int):
        super().__init__()
        self._owner = (owner,)  # not a submodule: the owner is registered on the parent
        self.index = index
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._owner[0].part_output(x, self.index)


def _concat_linears(mods: list[nn.Module]) -> nn.Module:
    """One linear whose outputs are those of ``mods`` stacked (same input features)."""
    from sparsekit.runtime.sparse_linear import SparseLinear, decode_dense
    from sparsekit.packed.tcabme import encode

    bias = None
    if any(m.bias is not None for m in mods):
        ref = next(m.bias for m in mods if m.bias is not None)
        bias = torch.cat([m.bias if m.bias is not None else ref.new_zeros(m.out_features) for m in mods])
    if all(isinstance(m, SparseLinear) for m in mods):
        weight = torch.cat([decode_dense(m.packed) for m in mods])
        return SparseLinear(encode(weight.contiguous()), bias)
    lin = nn.Linear(mods[0].in_features, sum(m.out_features for m in mods), bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(torch.cat([m.weight.detach() for m in mods]), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return lin


def fuse_projections(model: nn.Module) -> int:
    """Merge, in place, q/k/v and gate/up projections of each decoder layer into one linear
    (one SparseLinear when all were packed, re-encoded exactly; one nn.Linear when all were
    dense). Fewer, larger matmuls per step: fixed per-call costs are paid 4 times per layer
    instead of 7. Returns how many groups were merged; mixed or odd groups are left alone."""
    from sparsekit.runtime.sparse_linear import SparseLinear, release_kernel_caches

    merged = 0
    for parent in list(model.modules()):
        for names in PROJECTION_GROUPS:
            mods = [getattr(parent, n, None) for n in names]
            if any(m is None for m in mods):
                continue
            kinds = {type(m) for m in mods}
            if kinds != {SparseLinear} and kinds != {nn.Linear}:
                continue
            if len({m.in_features for m in mods}) != 1:
                continue
            owner = FusedProjection(_concat_linears(mods), [m.out_features for m in mods])
            setattr(parent, "fused_" + "_".join(n.split("_")[0] for n in names), owner)
            for i, (n, m) in enumerate(zip(names, mods)):
                setattr(parent, n, ProjectionPart(owner, i, m.in_features, m.out_features))
            merged += 1
    if merged:
        release_kernel_caches()
    return merged
