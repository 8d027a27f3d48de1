"""The kernels' load-time self-test, remembered on disk once passed, so a second load skips it.

``sparsekit.kernels.health`` compiles and runs one small product before any sparse layer runs on a
GPU (seconds: a numba compile). Its pass is kept per (GPU name, compute capability, torch, numba and
numba-cuda versions, sparsekit version, hash of the bundled kernels' sources, kernel variant from
``SPARSEKIT_KERNEL``) in one JSON file under ``$SPARSEKIT_CACHE/selftest/``, written the way
``runtime.dispatch_cache`` writes its timings (atomically; deleting the folder makes the next load test
again). Only a pass is written: a failed test runs again at every load and says why each time. A
damaged or foreign cache file is said in one line and the test runs (``SPARSEKIT_STRICT=1``: an error).
"""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

from sparsekit.errors import SparsekitError, SparsekitWarning, strict_mode
from sparsekit.hf.models import cache_root
from sparsekit.kernels import health
from sparsekit.runtime import dispatch_cache

VERSION = 1
RECORD = "self_test"


def identity() -> list:
    """What a cached pass is valid for: this GPU, its software and the kernel variant that runs."""
    import numba
    import torch

    from sparsekit import __version__
    from sparsekit.kernels.matmul import kernel_choice

    major, minor = torch.cuda.get_device_capability()
    return [VERSION, torch.cuda.get_device_name(), f"{major}.{minor}", torch.__version__, numba.__version__,
            health.numba_cuda_version(), __version__, dispatch_cache.kernels_hash(), kernel_choice()]


def cache_file(ident: list) -> Path:
    """The cache file of ``ident`` (see :func:`identity`)."""
    return cache_root() / "selftest" / f"{hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:20]}.json"


def kernel_status() -> health.KernelStatus:
    """``health.kernel_status()``, with the self-test skipped when this GPU and software passed it before."""
    pre = health.prerequisites()
    if not pre.ok:
        return pre
    try:
        ident = identity()
    except SparsekitError:  # e.g. a bad SPARSEKIT_KERNEL: the self-test fails on it and says so
        return health.tested(pre.numba_cuda)
    path = cache_file(ident)
    entries, problem = dispatch_cache.load(path)
    record = entries.get(RECORD)
    if record is not None and not (isinstance(record, dict) and isinstance(record.get("passed"), bool)):
        problem = f"its {RECORD!r} entry is malformed"
    if problem:
        _unusable(f"the kernel self-test cache {path} cannot be used ({problem}): running the self-test again")
    elif record is not None and record["passed"] and record.get("identity") == ident:
        return health.passed(pre.numba_cuda, "; self-test passed before, cached")
    status = health.tested(pre.numba_cuda)
    if status.ok:  # only a pass is remembered
        error = dispatch_cache.write(path, {RECORD: {"passed": True, "identity": ident}})
        if error:
            warnings.warn(f"the kernel self-test result could not be cached ({error}): the next load runs it again",
                          SparsekitWarning, stacklevel=2)
    return status


def _unusable(message: str) -> None:
    if strict_mode():
        raise SparsekitError(f"{message} (SPARSEKIT_STRICT is set: delete the file, or unset SPARSEKIT_STRICT)")
    warnings.warn(message, SparsekitWarning, stacklevel=3)
