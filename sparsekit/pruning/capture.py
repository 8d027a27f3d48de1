"""Layer-0 capture: the calibration windows run up to the first decoder layer, once.

A forward pre-hook on ``layers[0]`` records the hidden states and the layer's other arguments
(attention mask, position ids, rotary embeddings, ...) and aborts the forward. Only the parameters
outside the decoder stack sit on the device meanwhile (embeddings, rotary tables, ...; not
``lm_head``). The result, :class:`Activations`, is one [n, seq, hidden] buffer that each layer's
outputs then overwrite in place.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.hf import modules as L
from sparsekit.progress import Progress, report
from sparsekit.torch_compat import own_tensors, set_module_tensor


def default_batch_size(seqlen: int, tokens: int = 16384) -> int:
    """Calibration windows per forward: about ``tokens`` tokens."""
    return max(1, tokens // max(1, seqlen))


class _StopForward(Exception):
    """Raised by the capture hook to abort the model forward at layer 0."""


def _first_output(out):
    """Decoder layers return a tensor (transformers 5) or a tuple whose first item is the tensor."""
    return out[0] if isinstance(out, (tuple, list)) else out


@contextlib.contextmanager
def outside_stack_on(model: nn.Module, stack_name: str, device: torch.device):
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
            for _, kind, key, t in own_tensors(mod):
                if id(t) in seen or (kind == "p" and id(t) in head_params and id(t) not in emb_params):
                    continue
                seen.add(id(t))
                moved.append((mod, kind, key, t.device))
                if kind == "p":
                    t.data = t.data.to(device, non_blocking=True)
                else:
                    set_module_tensor(mod, "b", key, t.to(device, non_blocking=True))
        yield
    finally:
        for mod, kind, key, old in moved:
            t = getattr(mod, key)
            if kind == "p":
                t.data = t.data.to(old)
            else:
                set_module_tensor(mod, "b", key, t.to(old))


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
        with outside_stack_on(model, stack_name, device):
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
                report(progress, "calibration", done + 1, len(spans))
    finally:
        handle.remove()
    return Activations(hidden, spans, args_list, kwargs_list)
