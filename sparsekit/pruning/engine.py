"""Layer-sequential pruning engine: one decoder layer on the device at a time.

1. Capture the inputs of decoder layer 0 once (the same mechanism for every method): a forward
   pre-hook on ``layers[0]`` records the hidden states and the layer's other arguments (attention
   mask, position ids, rotary embeddings, ...) and aborts the forward. Only the parameters outside
   the decoder stack sit on the device meanwhile (embeddings, rotary tables, ...; not ``lm_head``).
2. For each layer: move it alone to the device; forward hooks on its linears accumulate
   ``InputStats`` (one shared object for linears fed the same tensor, e.g. q/k/v); prune every
   linear; recompute the layer's outputs with the pruned weights, which become the next layer's
   inputs; move the layer back to the CPU.

Peak device memory is one layer plus the calibration activations (kept in a single buffer that
each layer's outputs overwrite in place). Magnitude pruning needs no calibration: no capture, no
forward pass at all.

CATS (``method="cats"``, math in ``sparsekit.pruning.methods.cats``) uses the same capture and layer loop, but step 2
becomes: forward hooks on the layer's gated-MLP ``act_fn`` sample ``|act(gate(x))|``; each MLP gets
its threshold (the target-sparsity quantile of the sample) as a ``CatsActivation``; a second pass
through the thresholded layer counts the activation sparsity reached and (but for the last layer)
writes the next layer's inputs. So, as the other methods see the pruned outputs of the layers before,
the thresholds of layer i are measured with layers < i already thresholded. No weight changes.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable

import torch
from torch import nn

from sparsekit.hf import modules as L
from sparsekit.errors import SparsekitError

Progress = Callable[[str, int, int], None]  # (stage, done, total); "calibration", "layers" or (CATS) "thresholds"


class _StopForward(Exception):
    """Raised by the capture hook to abort the model forward at layer 0."""


def _device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_output(out):
    """Decoder layers return a tensor (transformers 5) or a tuple whose first item is the tensor."""
    return out[0] if isinstance(out, (tuple, list)) else out


@contextlib.contextmanager
def _outside_stack_on(model: nn.Module, stack_name: str, device: torch.device):
    """Move every parameter and buffer outside the decoder stack to ``device`` (temporarily).

    The output head is left where it is unless it is tied to the input embeddings: the capture
    forward stops before it.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_params = {id(p) for p in head.parameters()} if head is not None else set()
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_params = {id(p) for p in emb.parameters()} if emb is not None else set()
    prefix = stack_name + "."
    moved: list[tuple[nn.Module, str, str, torch.device]] = []  # (module, kind, key, old device)
    seen: set[int] = set()
    try:
        for mname, mod in model.named_modules():
            if mname == stack_name or mname.startswith(prefix):
                continue
            for key, p in mod._parameters.items():
                if p is None or id(p) in seen or (id(p) in head_params and id(p) not in emb_params):
                    continue
                seen.add(id(p))
                moved.append((mod, "p", key, p.device))
                p.data = p.data.to(device, non_blocking=True)
            for key, b in mod._buffers.items():
                if b is None or id(b) in seen:
                    continue
                seen.add(id(b))
                moved.append((mod, "b", key, b.device))
                mod._buffers[key] = b.to(device, non_blocking=True)
        yield
    finally:
        for mod, kind, key, old in moved:
            if kind == "p":
                mod._parameters[key].data = mod._parameters[key].data.to(old)
            else:
                mod._buffers[key] = mod._buffers[key].to(old)


class Activations:
    """Calibration activations between layers: one [n, seq, hidden] buffer plus per-batch layer args.

    ``args[i]`` / ``kwargs[i]`` are what HF passed to the decoder layers for mini-batch ``i``
    (shared between mini-batches of equal size: they do not depend on the tokens).
    """

    def __init__(self, hidden: torch.Tensor, spans: list[tuple[int, int]], args: list, kwargs: list):
        self.hidden, self.spans, self.args, self.kwargs = hidden, spans, args, kwargs

    def run(self, layer: nn.Module, write: bool) -> None:
        """Run every mini-batch through ``layer``; with ``write`` the outputs replace the inputs."""
        for (a, b), args, kwargs in zip(self.spans, self.args, self.kwargs):
            out = _first_output(layer(self.hidden[a:b], *args, **kwargs))
            if write:
                self.hidden[a:b].copy_(out)
            del out


@torch.no_grad()
def capture_inputs(model: nn.Module, calib: torch.Tensor, device: torch.device, batch_size: int,
                   progress: Progress | None = None) -> Activations:
    """Run the calibration windows up to decoder layer 0 and record its inputs (see module doc)."""
    stack_name, layers = L.find_decoder_layers(model)
    record: dict = {}

    def hook(module, args, kwargs):
        kwargs = dict(kwargs)
        if args:
            hidden, rest = args[0], tuple(args[1:])
        else:
            hidden, rest = kwargs.pop("hidden_states"), ()
        record.update(hidden=hidden, args=rest, kwargs=kwargs)
        raise _StopForward

    n, seqlen = calib.shape
    spans = [(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    if device.type == "cuda":
        calib = calib.pin_memory()
    hidden = None
    args_list, kwargs_list, by_size = [], [], {}
    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with _outside_stack_on(model, stack_name, device):
            for done, (a, b) in enumerate(spans):
                ids = calib[a:b].to(device, non_blocking=True)
                record.clear()
                try:
                    model(input_ids=ids, use_cache=False)
                except _StopForward:
                    pass
                if "hidden" not in record:
                    raise SparsekitError(
                        f"{type(model).__name__}'s forward never reached its first decoder layer: "
                        "this architecture is not supported by the layer-sequential engine"
                    )
                h = record["hidden"]
                if hidden is None:
                    hidden = torch.empty((n, *h.shape[1:]), dtype=h.dtype, device=device)
                hidden[a:b].copy_(h)
                if (b - a) not in by_size:
                    by_size[b - a] = (record["args"], record["kwargs"])
                args_list.append(by_size[b - a][0])
                kwargs_list.append(by_size[b - a][1])
                if progress:
                    progress("calibration", done + 1, len(spans))
    finally:
        handle.remove()
    return Activations(hidden, spans, args_list, kwargs_list)


class StatsCollector:
    """Forward hooks that feed each linear's input into an ``InputStats``.

    Linears that receive the very same input tensor (q/k/v, gate/up) share one stats object: the
    grouping is found on the first mini-batch, where the first linear to see a tensor owns it.
    """

    def __init__(self, linears: dict[str, nn.Module], hessian: bool, device: torch.device):
        from sparsekit.pruning.stats import InputStats

        self._make = lambda in_features: InputStats(in_features, hessian=hessian, device=device)
        self.linears = linears
        self.stats: dict[str, object] = {}
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
def _finishing(mover):
    try:
        yield mover
    finally:
        mover.finish()


@contextlib.contextmanager
def _tf32(enabled: bool):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


class _LayerMover:
    """Moves decoder layers to the device and back.

    On CUDA (``overlap``), a worker thread copies the next layer in on a side stream while the
    current one computes, and copies each pruned layer's tensors back into its original CPU
    tensors in the background; :meth:`finish` waits for those copies. Elsewhere it is a plain
    ``layer.to(device)`` / ``layer.to("cpu")``.
    """

    def __init__(self, layers: nn.ModuleList, device: torch.device, overlap: bool):
        self.layers, self.device = layers, device
        self.overlap = overlap and device.type == "cuda"
        self.pending: dict[int, object] = {}
        self.offloads: list = []
        self.cpu: dict[int, list] = {}
        if self.overlap:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparsekit-mover")
            self.stream = torch.cuda.Stream(device)

    @staticmethod
    def _slots(layer: nn.Module):
        for mod in layer.modules():
            for key, t in mod._parameters.items():
                if t is not None:
                    yield mod, "p", key, t
            for key, t in mod._buffers.items():
                if t is not None:
                    yield mod, "b", key, t

    def _copy_in(self, idx: int):
        slots = list(self._slots(self.layers[idx]))
        with torch.cuda.stream(self.stream):
            gpu = [(t.data if kind == "p" else t).to(self.device, non_blocking=True) for _, kind, _, t in slots]
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return slots, gpu, ev

    def prefetch(self, idx: int) -> None:
        if self.overlap and 0 <= idx < len(self.layers) and idx not in self.pending:
            self.pending[idx] = self.pool.submit(self._copy_in, idx)

    def load(self, idx: int) -> nn.Module:
        layer = self.layers[idx]
        if not self.overlap:
            return layer.to(self.device)
        self.prefetch(idx)
        slots, gpu, ev = self.pending.pop(idx).result()
        main = torch.cuda.current_stream(self.device)
        main.wait_event(ev)
        originals = []
        for (mod, kind, key, t), g in zip(slots, gpu):
            g.record_stream(main)  # allocated on the side stream, used and freed on the main one
            if kind == "p":
                originals.append(t.data)
                t.data = g
            else:
                originals.append(t)
                mod._buffers[key] = g
        self.cpu[idx] = (slots, originals)
        return layer

    def offload(self, idx: int) -> None:
        layer = self.layers[idx]
        if not self.overlap:
            layer.to("cpu")
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        gpu = []
        slots, originals = self.cpu.pop(idx)
        for (mod, kind, key, t), cpu in zip(slots, originals):  # the tensors that load() moved in
            gpu.append((t.data if kind == "p" else mod._buffers[key], cpu))
            if kind == "p":
                t.data = cpu  # the CPU tensor receives the device values below
            else:
                mod._buffers[key] = cpu
        for mod, kind, key, t in list(self._slots(layer)):  # made on the device (CATS thresholds)
            if t.device.type != "cpu":
                if kind == "p":
                    t.data = t.data.to("cpu")
                else:
                    mod._buffers[key] = t.to("cpu")

        def copy_out():
            self.stream.wait_event(done)
            with torch.cuda.stream(self.stream):
                for g, cpu in gpu:
                    cpu.copy_(g)  # pageable destination: returns once the copy is complete
            self.stream.synchronize()

        self.offloads.append(self.pool.submit(copy_out))

    def finish(self) -> None:
        if self.overlap:
            for f in self.offloads:
                f.result()
            self.offloads.clear()
            for f in self.pending.values():
                f.result()
            self.pending.clear()
            self.pool.shutdown()


class _Phases:
    """Seconds spent in each phase of a layer (synchronizing the device at each mark)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self._t = device, {}, time.perf_counter()

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":  # this stream only: background layer copies keep going
            torch.cuda.current_stream(self.device).synchronize()
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._t
        self._t = now


def _linear_kind(module: nn.Module) -> str:
    return "linear" if isinstance(module, nn.Linear) else "conv1d"


def _layer_entry(module: nn.Module) -> dict:
    """A linear's ``layers`` entry as stored: its fraction of zeros, [out, in] shape and kind."""
    w = L.weight_out_in(module)
    return {"sparsity": float((w == 0).sum().item() / w.numel()), "shape": [int(w.shape[0]), int(w.shape[1])],
            "kind": _linear_kind(module)}


def _prune_linears(linears: dict[str, nn.Module], stats: dict, method: str, sparsity: float, pattern,
                   blocksize: int, percdamp: float, warn) -> dict[str, dict]:
    from sparsekit.pruning.methods import prune_weight

    from sparsekit.pruning.methods import needs_stats

    report = {}
    for name, mod in linears.items():
        if needs_stats(method) and name not in stats:
            raise SparsekitError(f"{name} received no calibration input: add it to --skip or use --method magnitude")
        w = L.weight_out_in(mod)
        res = prune_weight(w, method, sparsity, pattern, stats.get(name), blocksize=blocksize,
                           percdamp=percdamp, warn=lambda msg, _n=name: warn(f"{_n}: {msg}"))
        L.set_weight_out_in(mod, res.weight)
        report[name] = _layer_entry(mod)
        if res.info:
            report[name]["info"] = {k: v for k, v in res.info.items() if isinstance(v, (int, float, str, bool))}
    return report


def _weight_report(linears: dict[str, nn.Module]) -> dict[str, dict]:
    """The ``layers`` entries of linears left as they are (CATS)."""
    return {name: _layer_entry(mod) for name, mod in linears.items()}


def _cats_layer(layer: nn.Module, prefix: str, acts: Activations, sparsity: float, skip: list[str],
                sample_size: int, seed: int, write: bool) -> dict[str, dict]:
    """Calibrate and install the CATS thresholds of one decoder layer's gated MLPs (see module doc)."""
    from sparsekit.pruning.methods import cats
    from sparsekit.runtime import cats as runtime_cats  # TODO(re-layout): pruning must not import the runtime

    mlps = cats.find_gated_mlps(layer, prefix=prefix, skip=skip)
    tokens = acts.hidden.shape[0] * acts.hidden.shape[1]
    samples = {}
    for name, mlp in mlps.items():
        width = L.weight_out_in(mlp.gate_proj).shape[0]
        samples[name] = cats.ActivationSample(tokens * width, sample_size, seed=seed * 1_000_003 + _name_seed(name))

    def sampler(name):
        return lambda module, inputs, output: samples[name].add(output.abs())

    handles = [mlp.act_fn.register_forward_hook(sampler(name)) for name, mlp in mlps.items()]
    try:
        acts.run(layer, write=False)  # no TF32 here: the thresholds must fit the model as it runs
    finally:
        for h in handles:
            h.remove()
    report = {}
    for name, mlp in mlps.items():
        t = samples[name].threshold(sparsity)
        runtime_cats.apply_threshold(mlp, t).to(acts.hidden.device)
        report[name] = {"threshold": t, "samples": len(samples[name].values()), "exact": samples[name].exact}
    del samples

    zeros = {name: [0, 0] for name in mlps}  # [zeros (a device tensor once counted), values]

    def counter(name):
        def hook(module, inputs, output):
            zeros[name][0] = zeros[name][0] + (output == 0).sum()
            zeros[name][1] += output.numel()
        return hook

    handles = [mlp.act_fn.register_forward_hook(counter(name)) for name, mlp in mlps.items()]
    try:
        acts.run(layer, write=write)  # with write: the thresholded layer's outputs, next layer's inputs
    finally:
        for h in handles:
            h.remove()
    for name, (z, n) in zeros.items():
        report[name]["activation_sparsity"] = int(z) / n if n else 0.0
    return report


def _name_seed(name: str) -> int:
    """A stable small integer for a module name (Python's hash() changes between runs)."""
    import zlib

    return zlib.crc32(name.encode())


def default_batch_size(seqlen: int, tokens: int = 16384) -> int:
    return max(1, tokens // max(1, seqlen))


def prune_model(
    model: nn.Module,
    calib: torch.Tensor | None,
    *,
    method: str,
    sparsity: float,
    pattern,
    skip: Iterable[str] = ("lm_head",),
    device: str | torch.device = "cpu",
    blocksize: int = 128,
    percdamp: float = 0.01,
    batch_size: int | None = None,
    overlap: bool = True,
    progress: Progress | None = None,
    warn: Callable[[str], None] = print,
    observer: Callable[[int, Activations], None] | None = None,
    cats_sample_size: int | None = None,
    seed: int = 0,
) -> dict:
    """Prune ``model`` in place (it stays on the CPU; one layer at a time visits ``device``).

    ``calib`` is a LongTensor [nsamples, seqlen] of token ids (ignored by magnitude).
    ``overlap`` (CUDA only) moves layers in and out in the background while others compute.
    ``observer(idx, acts)``, if given, sees each layer's captured inputs before its stats pass.
    Returns a report: per-linear sparsity/shape/kind, per-layer seconds and peak device memory,
    capture seconds, total seconds and the overall peak device memory.

    With ``method="cats"`` no weight changes (``sparsity`` is the target activation sparsity of
    each gated MLP; ``skip`` patterns also name MLPs to leave alone); the report's ``cats`` holds
    each MLP's ``threshold``, measured ``activation_sparsity`` and the sample it came from
    (``cats_sample_size`` values at most, default ``sparsekit.pruning.methods.cats.SAMPLE_SIZE``, drawn with
    ``seed``), and the model keeps the installed ``CatsActivation`` modules.
    """
    from sparsekit.pruning.methods import METHODS, needs_calibration, needs_hessian, needs_stats

    if method not in METHODS:
        raise SparsekitError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    device = torch.device(device)
    skip = list(skip)
    is_cats = method == "cats"
    use_stats = needs_stats(method)
    if needs_calibration(method) and calib is None:
        raise SparsekitError(f"{method} needs calibration data: pass calibration windows")
    model.eval()
    stack_name, layers = L.find_decoder_layers(model)
    t_start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    if is_cats:
        from sparsekit.pruning.methods.cats import SAMPLE_SIZE, require_gated_mlps

        require_gated_mlps(layers, skip=skip)
        cats_sample_size = cats_sample_size or SAMPLE_SIZE
    else:
        _check_outside_linears(model, stack_name, skip, method)

    acts = None
    t_capture = 0.0
    cats_reports: dict[str, dict] = {}
    if needs_calibration(method):
        t0 = time.perf_counter()
        bs = batch_size or default_batch_size(calib.shape[1])
        acts = capture_inputs(model, calib, device, bs, progress)
        _device_sync(device)
        t_capture = time.perf_counter() - t0
    capture_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0

    layer_reports = []
    linear_reports: dict[str, dict] = {}
    mover = _LayerMover(layers, device, overlap)
    with torch.no_grad(), _finishing(mover):
        for idx, layer in enumerate(layers):
            t0 = time.perf_counter()
            phases = _Phases(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            mover.load(idx)
            mover.prefetch(idx + 1)
            phases.mark("load")
            linears = L.find_linears(layer, prefix=f"{stack_name}.{idx}", skip=skip)
            stats: dict = {}
            if observer is not None and acts is not None:
                observer(idx, acts)
            if is_cats:
                rep = _weight_report(linears)
                linear_reports.update(rep)
                cats_reports.update(_cats_layer(layer, f"{stack_name}.{idx}", acts, sparsity, skip,
                                                cats_sample_size, seed, write=idx + 1 < len(layers)))
                phases.mark("cats")
            if use_stats and linears:
                collector = StatsCollector(linears, needs_hessian(method), device)
                try:
                    with _tf32(True):
                        for i, ((a, b), args, kwargs) in enumerate(zip(acts.spans, acts.args, acts.kwargs)):
                            layer(acts.hidden[a:b], *args, **kwargs)
                            if i == 0:
                                collector.end_batch()
                finally:
                    collector.remove()
                stats = collector.stats
                phases.mark("stats")
            if not is_cats:
                rep = _prune_linears(linears, stats, method, sparsity, pattern, blocksize, percdamp, warn)
                linear_reports.update(rep)
                phases.mark("prune")
            if use_stats and idx + 1 < len(layers):
                acts.run(layer, write=True)  # the pruned layer's outputs: next layer's inputs
                phases.mark("recompute")
            mover.offload(idx)
            phases.mark("offload")
            layer_reports.append({
                "index": idx,
                "seconds": time.perf_counter() - t0,
                "phases": phases.seconds,
                "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
                "linears": list(rep),
            })
            del stats
            if progress:
                progress("thresholds" if is_cats else "layers", idx + 1, len(layers))
    if not is_cats:
        _prune_outside_linears(model, stack_name, skip, method, sparsity, pattern, linear_reports, warn)
    del acts
    if device.type == "cuda":
        torch.cuda.empty_cache()
    peak = max([capture_peak] + [r["peak_mem_bytes"] or 0 for r in layer_reports])
    return {
        "layers": linear_reports,
        "per_layer": layer_reports,
        "capture_seconds": t_capture,
        "seconds": time.perf_counter() - t_start,
        "peak_mem_bytes": peak if device.type == "cuda" else None,
        "device": str(device),
        "decoder_stack": stack_name,
        **({"cats": cats_reports} if is_cats else {}),
    }


def _outside_linears(model: nn.Module, stack_name: str, skip: list[str]) -> dict[str, nn.Module]:
    found = L.find_linears(model, skip=skip)
    return {n: m for n, m in found.items() if not (n == stack_name or n.startswith(stack_name + "."))}


def _check_outside_linears(model, stack_name, skip, method) -> None:
    """Linears outside the decoder stack (lm_head, OPT's project_in/out) are pruned only by magnitude."""
    outside = _outside_linears(model, stack_name, skip)
    if not outside:
        return
    if method != "magnitude":
        raise SparsekitError(
            f"{', '.join(outside)} lie outside the decoder stack, where only magnitude pruning applies: "
            f"add them to --skip (e.g. --skip lm_head) or use --method magnitude"
        )
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for name, mod in outside.items():
        if emb is not None and mod.weight is getattr(emb, "weight", None):
            raise SparsekitError(f"{name} is tied to the input embeddings, pruning it would prune them too: add it to --skip")


def _prune_outside_linears(model, stack_name, skip, method, sparsity, pattern, reports, warn) -> None:
    outside = _outside_linears(model, stack_name, skip)
    if outside:
        reports.update(_prune_linears(outside, {}, method, sparsity, pattern, 128, 0.01, warn))
