"""Calibration windows for learning: the held-out windows come from text the training windows never see.

Random windows of one token stream overlap; a held-out window sharing tokens with training windows
would reward memorizing them. So the stream is cut once: the training windows are drawn from its
first ``1 - holdout`` share, the held-out ones (the last windows of the batch) from the rest. C4
windows come from random documents and are used as they are.
"""
from __future__ import annotations

import torch

from sparsekit.hf.data import calibration_text, calibration_windows, sample_windows, tokenize


def learning_windows(source: str, tokenizer, nsamples: int, seqlen: int, seed: int, n_hold: int) -> torch.Tensor:
    """``[nsamples, seqlen]`` token windows whose last ``n_hold`` come from a disjoint tail of the text."""
    if not n_hold or str(source) == "c4":
        return calibration_windows(source, tokenizer, nsamples=nsamples, seqlen=seqlen, seed=seed)
    ids = tokenize(tokenizer, calibration_text(str(source)))
    cut = int(ids.numel() * (1 - n_hold / nsamples))
    if cut < seqlen or ids.numel() - cut < seqlen:  # too short a text to split: windows as usual
        return calibration_windows(source, tokenizer, nsamples=nsamples, seqlen=seqlen, seed=seed)
    train = sample_windows(ids[:cut], nsamples - n_hold, seqlen, seed, source=str(source))
    held = sample_windows(ids[cut:], n_hold, seqlen, seed + 1, source=str(source))
    return torch.cat([train, held])
