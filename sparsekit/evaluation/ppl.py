"""Perplexity with the WikiText-2 protocol of the Wanda / SparseGPT evaluation code.

The whole text is tokenized once and cut into non-overlapping windows of ``seqlen`` tokens; the
leftover tokens after the last full window are dropped. Each window is scored on its own (no
context carried over): its loss is the mean next-token NLL over its ``seqlen - 1`` predictions,
computed in float32 from the shifted logits. The perplexity is ``exp`` of the mean of the
per-window losses (the reference code multiplies each by ``seqlen`` and divides the sum by
``windows * seqlen``, which is the same number).
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from sparsekit.errors import SparsekitError
from sparsekit.hf.data import cap_seqlen, eval_text, tokenize
from sparsekit.hf.models import resolve_device, resolve_dtype, resolve_model
from sparsekit.progress import Progress, report
from sparsekit.runtime.loader import load


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
    dev = torch.device(device) if device is not None else _model_device(model)
    ids = tokenize(tokenizer, text)
    windows = window_ids(ids, seqlen, max_windows)
    n = windows.shape[0]
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 50000
    bs = batch_size or default_batch_size(seqlen, vocab, dev)

    was_training = getattr(model, "training", False)
    model.eval()
    report(progress, "perplexity", 0, n)
    nlls = []
    i = 0
    try:
        while i < n:
            batch = windows[i : i + bs].to(dev)
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
                torch.cuda.empty_cache()
                continue
            nlls.extend(part)
            i += batch.shape[0]
            report(progress, "perplexity", i, n)
    finally:
        if was_training:
            model.train()
    per_window = torch.cat(nlls)
    # A non-finite window (fp16 overflow in a badly pruned model) makes the result inf, not an error,
    # so that comparisons still print; ``nonfinite_windows`` says how many.
    bad = int((~torch.isfinite(per_window)).sum())
    nll = float(per_window.mean()) if bad == 0 else math.inf
    return {
        "ppl": math.exp(nll) if nll < 709 else math.inf,
        "nll": nll,
        "windows": int(n),
        "tokens": int(n * seqlen),
        "seqlen": int(seqlen),
        "text_tokens": int(ids.numel()),
        "nonfinite_windows": bad,
    }


def perplexity_report(model_dir: str, *, dataset: str, seqlen: int, max_windows: Optional[int], device: str = "auto",
                      dtype: str = "auto", progress: Progress | None = None,
                      warn: Callable[[str], None] | None = None) -> dict:
    """Load ``model_dir`` (any model the loader opens) and measure its perplexity on ``dataset``:
    the report ``sparsekit eval --ppl`` prints. ``warn`` receives the notes (seqlen capped, overflow)."""
    t0 = time.perf_counter()
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(None if dtype == "auto" else dtype, dev)
    location = resolve_model(model_dir)  # a bad DIR fails first ...
    text = eval_text(dataset)  # ... then a bad --dataset, both before the model is loaded
    model, tokenizer = load(location, device=dev, dtype=torch_dtype)
    capped = cap_seqlen(model, seqlen)
    if capped != seqlen and warn is not None:
        warn(f"--seqlen {seqlen} exceeds the model context: using {capped}")
    result = perplexity(model, tokenizer, text, seqlen=capped, max_windows=max_windows, device=dev, progress=progress)
    if result["nonfinite_windows"] and warn is not None:
        warn(f"{result['nonfinite_windows']} windows gave a non-finite loss (overflow?): try --dtype float32 or bfloat16")
    return {
        "model": str(model_dir),
        "dataset": dataset,
        "device": str(dev),
        "dtype": str(torch_dtype).removeprefix("torch."),
        **result,
        "elapsed_s": time.perf_counter() - t0,
    }
