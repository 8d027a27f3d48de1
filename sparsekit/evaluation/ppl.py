"""Perplexity with the WikiText-2 protocol of the Wanda / SparseGPT evaluation code.

The whole text is tokenized once and cut into non-overlapping windows of ``seqlen`` tokens; the
leftover tokens after the last full window are dropped. Each window is scored on its own (no
context carried over): its loss is the mean next-token NLL over its ``seqlen - 1`` predictions,
computed in float32 from the shifted logits. The perplexity is ``exp`` of the mean of the
per-window losses (the reference code multiplies each by ``seqlen`` and divides the sum by
``windows * seqlen``, which is the same number).

A baseline (``sparsekit eval --ppl --baseline``) is the dense model that a pruned or packed directory
came from, scored on the same windows: the text is tokenized by both tokenizers and refused unless
the ids agree, then the dense model runs on the windows of the pruned one.
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from sparsekit.errors import SparsekitError
from sparsekit.hf.metadata import METADATA_FILE, PruneMetadata
from sparsekit.hf.data import cap_seqlen, check_seqlen, eval_text, tokenize
from sparsekit.hf.models import open_tokenizer, resolve_device, resolve_dtype, resolve_model
from sparsekit.packed.shards import INDEX_NAME
from sparsekit.progress import Progress, report
from sparsekit.runtime.cats import counting_zeros
from sparsekit.runtime.loader import load

ROUGH_WINDOWS = 32  # fewer windows than this: the perplexity is a rough figure (the tables say so)


def window_ids(ids: torch.Tensor, seqlen: int, max_windows: int | None = None) -> torch.Tensor:
    """``[windows, seqlen]`` non-overlapping windows of a 1-D id tensor, leftover dropped."""
    if seqlen < 2:
        raise SparsekitError(f"seqlen must be >= 2 for perplexity, got {seqlen}")
    n = ids.numel() // seqlen
    if max_windows is not None:
        if max_windows < 1:
            raise SparsekitError(f"--max-windows must be >= 1, got {max_windows}")
        n = min(n, max_windows)
    if n == 0:
        raise SparsekitError(
            f"the evaluation text has only {ids.numel()} tokens, fewer than one window of seqlen={seqlen}: "
            "use a smaller --seqlen or a longer text"
        )
    return ids[: n * seqlen].view(n, seqlen)


def window_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-window mean NLL ``[B]`` from logits ``[B, T, V]`` and ids ``[B, T]`` (float32 loss)."""
    shift_logits = logits[:, :-1, :].float()
    shift_labels = ids[:, 1:].to(logits.device)
    nll = F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), reduction="none")
    return nll.view(ids.shape[0], -1).mean(dim=1)


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters
        return torch.device("cpu")


def default_batch_size(seqlen: int, vocab: int, device: torch.device) -> int:
    """Windows per forward pass: bounded by the logits of a batch (~2 GiB on CUDA, ~256 MiB on CPU, at 4
    bytes a value); an out-of-memory error on CUDA halves it and retries."""
    budget = (2 << 30) if device.type == "cuda" else (256 << 20)
    return max(1, min(32, budget // max(1, seqlen * vocab * 4)))


@torch.inference_mode()
def perplexity(
    model,
    tokenizer,
    text: str,
    seqlen: int = 2048,
    max_windows: int | None = None,
    device: str | torch.device | None = None,
    progress: Progress | None = None,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """Perplexity of ``model`` on ``text``: ``dict(ppl, nll, windows, tokens, seqlen, text_tokens)``.

    ``device`` defaults to the model's device (the model is not moved); inputs go there.
    ``progress("perplexity", windows done, windows)`` is called before the first batch and after each.
    """
    ids = tokenize(tokenizer, text)
    windows = window_ids(ids, seqlen, max_windows)
    return {**perplexity_of_windows(model, windows, device=device, progress=progress, batch_size=batch_size),
            "text_tokens": int(ids.numel())}


@torch.inference_mode()
def perplexity_of_windows(model, windows: torch.Tensor, device: str | torch.device | None = None,
                          progress: Progress | None = None, batch_size: int | None = None,
                          stage: str = "perplexity") -> dict[str, Any]:
    """Perplexity of ``model`` over ``[windows, seqlen]`` token ids (see ``window_ids``): what
    ``perplexity`` computes once the text is tokenized; a baseline reuses the same windows.

    A model with CATS thresholds installed also reports ``activation_sparsity``: the fraction of
    zeros each gated MLP's thresholded activation gave over these windows (``mlps``, by name) and
    their ``mean`` (counted on the device, read once at the end)."""
    dev = torch.device(device) if device is not None else _model_device(model)
    n, seqlen = windows.shape
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 50000
    bs = batch_size or default_batch_size(seqlen, vocab, dev)

    was_training = getattr(model, "training", False)
    model.eval()
    report(progress, stage, 0, n)
    nlls = []
    i = 0
    with contextlib.ExitStack() as stack:
        zeros = stack.enter_context(counting_zeros(model))
        if was_training:
            stack.callback(model.train)
        while i < n:
            batch = windows[i : i + bs].to(dev)
            zeros.mark()
            try:
                logits = model(input_ids=batch, use_cache=False).logits
                # one window at a time in float32: bounds the fp32 copy of the logits to one window
                part = [window_nll(logits[j : j + 1], batch[j : j + 1]).double().cpu() for j in range(batch.shape[0])]
                del logits
            except torch.cuda.OutOfMemoryError:
                if bs == 1:
                    raise SparsekitError(
                        f"out of GPU memory on one window of {seqlen} tokens: use a smaller --seqlen or --device cpu"
                    ) from None
                bs = max(1, bs // 2)  # retry the same windows in smaller batches
                zeros.rollback()
                torch.cuda.empty_cache()
                continue
            nlls.extend(part)
            i += batch.shape[0]
            report(progress, stage, i, n)
        fractions = zeros.fractions()
    per_window = torch.cat(nlls)
    # A non-finite window (fp16 overflow in a badly pruned model) makes the result inf, not an error,
    # so that comparisons still print; ``nonfinite_windows`` says how many.
    bad = int((~torch.isfinite(per_window)).sum())
    nll = float(per_window.mean()) if bad == 0 else math.inf
    out = {
        "ppl": math.exp(nll) if nll < 709 else math.inf,
        "nll": nll,
        "windows": int(n),
        "tokens": int(n * seqlen),
        "seqlen": int(seqlen),
        "nonfinite_windows": bad,
    }
    if fractions:
        out["activation_sparsity"] = {"mean": sum(fractions.values()) / len(fractions), "mlps": fractions}
    return out


def cats_target(location: str | Path) -> float | None:
    """The CATS activation-sparsity target recorded in ``location``'s ``sparsekit.json``, if any."""
    with contextlib.suppress(SparsekitError, AttributeError, TypeError, KeyError, ValueError):
        return float(PruneMetadata.read(location).cats["target"])
    return None


def baseline_source(location: str | Path, model_dir: str) -> str:
    """The dense model a pruned or packed directory came from: the ``model`` its ``sparsekit.json``
    records, else (a packed directory without one) the ``source_model`` of its index metadata."""
    path = Path(location)
    source = None
    if (path / METADATA_FILE).is_file():
        with contextlib.suppress(SparsekitError):
            source = PruneMetadata.read(path).model
    elif (path / INDEX_NAME).is_file():
        with contextlib.suppress(OSError, ValueError, AttributeError):
            info = json.loads((path / INDEX_NAME).read_text()).get("metadata") or {}
            if info.get("source_model") != info.get("source_dir"):  # else it names the pruned dir, not the dense one
                source = info.get("source_model")
    if not source:
        raise SparsekitError(f"{model_dir} does not record the dense model it came from (no \"model\" in a "
                             f"{METADATA_FILE}): pass it with --baseline-model DIR")
    return str(source)


def resolve_baseline(model_dir: str, location: str, baseline_model: str | None = None) -> tuple[str, str]:
    """``(name, loadable location)`` of the dense baseline: ``baseline_model`` when given, else the source
    recorded in ``model_dir``; one clear error when it cannot be found."""
    if baseline_model:
        return str(baseline_model), resolve_model(baseline_model)
    source = baseline_source(location, model_dir)
    try:
        return source, resolve_model(source)
    except SparsekitError as e:
        raise SparsekitError(f"the dense model {source!r} that {model_dir} was pruned from cannot be found ({e}): "
                             "pass it with --baseline-model DIR") from None


def _same_windows(name: str, base_name: str, ids: torch.Tensor, base_ids: torch.Tensor, used: int) -> None:
    """The baseline must see the very tokens the model saw: refuse when its tokenizer splits the text differently."""
    a, b = ids[:used], base_ids[:used]
    if a.numel() == b.numel() and torch.equal(a, b):
        return
    n = min(a.numel(), b.numel())
    diff = (a[:n] != b[:n]).nonzero()
    at = int(diff[0]) if diff.numel() else n
    raise SparsekitError(f"the tokenizer of the dense model {base_name} splits the text differently from that of "
                         f"{name} (first difference at token {at}): the two perplexities would not be over the same "
                         "windows; pass the matching dense model with --baseline-model DIR")


def _release_memory() -> None:
    """Free what the dropped model held (on CUDA, the cached blocks too) before the next one loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def perplexity_report(model_dir: str, *, dataset: str, seqlen: int, max_windows: Optional[int], device: str = "auto",
                      dtype: str = "auto", progress: Progress | None = None,
                      warn: Callable[[str], None] | None = None, baseline: bool = False,
                      baseline_model: str | None = None) -> dict:
    """Load ``model_dir`` (any model the loader opens) and measure its perplexity on ``dataset``:
    the report ``sparsekit eval --ppl`` prints. ``warn`` receives the notes (seqlen capped, overflow).

    ``baseline`` (implied by ``baseline_model``) also measures the dense model ``model_dir`` came from
    (recorded in its ``sparsekit.json``, or ``baseline_model``) on the very same token windows, one model
    in memory at a time: the report gains ``baseline`` (its ppl/nll) and ``ratio`` (ppl / dense ppl).
    """
    t0 = time.perf_counter()
    seqlen = check_seqlen(seqlen)  # the same minimum as prune's, before any loading
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(None if dtype == "auto" else dtype, dev)
    location = resolve_model(model_dir)  # a bad DIR fails first ...
    base = resolve_baseline(model_dir, location, baseline_model) if baseline or baseline_model else None
    text = eval_text(dataset)  # ... then a bad --dataset, both before the model is loaded
    model, tokenizer = load(location, device=dev, dtype=torch_dtype)
    capped = cap_seqlen(model, seqlen)
    if capped != seqlen and warn is not None:
        warn(f"--seqlen {seqlen} exceeds the model context: using {capped}")
    ids = tokenize(tokenizer, text)
    windows = window_ids(ids, capped, max_windows)
    if base is not None:  # before the long run: the dense tokenizer must give the same windows
        _same_windows(str(model_dir), base[0], ids, tokenize(open_tokenizer(base[1]), text), windows.numel())
    result = {**perplexity_of_windows(model, windows, device=dev, progress=progress), "text_tokens": int(ids.numel())}
    if result["nonfinite_windows"] and warn is not None:
        warn(f"{result['nonfinite_windows']} windows gave a non-finite loss (overflow?): try --dtype float32 or bfloat16")
    out = {
        "model": str(model_dir),
        "dataset": dataset,
        "device": str(dev),
        "dtype": str(torch_dtype).removeprefix("torch."),
        **result,
    }
    if "activation_sparsity" in out:  # the CATS target recorded at pruning, beside what this text gave
        out["activation_sparsity"]["target"] = cats_target(location)
    if base is not None:
        model = None
        _release_memory()
        base_model, _ = load(base[1], device=dev, dtype=torch_dtype)
        if cap_seqlen(base_model, capped) != capped:
            raise SparsekitError(f"the dense model {base[0]} has a shorter context than --seqlen {capped}: use a smaller --seqlen")
        b = perplexity_of_windows(base_model, windows, device=dev, progress=progress, stage="perplexity (dense)")
        base_model = None
        _release_memory()
        if b["nonfinite_windows"] and warn is not None:
            warn(f"{b['nonfinite_windows']} windows gave the dense model a non-finite loss: try --dtype float32 or bfloat16")
        out["baseline"] = {"model": base[0], "ppl": b["ppl"], "nll": b["nll"], "nonfinite_windows": b["nonfinite_windows"]}
        finite = math.isfinite(out["ppl"]) and math.isfinite(b["ppl"]) and b["ppl"] > 0
        out["ratio"] = out["ppl"] / b["ppl"] if finite else math.inf
    out["elapsed_s"] = time.perf_counter() - t0
    return out
