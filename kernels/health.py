"""Can the bundled kernels run here? One cached check, done before any model runs a sparse layer.

The kernels need numba's CUDA target from the ``numba-cuda`` package (numba's own, built-in CUDA
target cannot type them: ``cuda.shared.array(..., alignment=16)`` fails) and a CUDA GPU that torch
sees. :func:`kernel_status` checks both and then compiles and runs one small product against the
reference, so that a kernel that cannot compile is found at load time, never in the middle of a
model's forward. Its ``line`` is what ``sparsekit env`` and ``eval --speed`` print; ``fix`` says
exactly what to install.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelStatus:
    ok: bool
    line: str                 # one line for a terminal: "kernels: ..." with the reason
    fix: str | None = None    # what to install or change, when not ok
    numba_cuda: str | None = None  # the numba-cuda version in use, if any


def gpu_extra() -> str:
    """The pip extra of sparsekit whose numba-cuda matches the installed torch's CUDA major."""
    import torch

    major = (torch.version.cuda or "13").split(".")[0]
    return "gpu-cu12" if major == "12" else "gpu"


def install_hint() -> str:
    extra = gpu_extra()
    cu = "cu12" if extra == "gpu-cu12" else "cu13"
    return f'pip install "sparsekit[{extra}]" (that is numba-cuda[{cu}] and cuda-core)'


def numba_cuda_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("numba-cuda")
    except Exception:
        return None


def self_test() -> None:
    """One tiny product through the public entry point, checked against the reference."""
    import torch

    from .matmul import tcabme_matmul
    from .reference import reference_matmul
    from sparsekit.packed.tcabme import encode

    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(64, 128, generator=g, dtype=torch.float32)
    w = torch.where(torch.rand(64, 128, generator=g) < 0.5, torch.zeros_like(w), w).half()
    x = torch.randn(1, 128, generator=g).half()   # N = 1: the variant a decode step compiles anyway
    packed = encode(w.cuda())
    y = tcabme_matmul(x.cuda(), packed)
    ref = reference_matmul(x.cuda(), packed).float()
    err = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-6))
    if not err < 1e-2:
        raise RuntimeError(f"self-test product is off by {err:.3g} (relative)")


@functools.lru_cache(maxsize=None)
def kernel_status() -> KernelStatus:
    """Whether the kernels can run on this machine, and if not, why and what to do (cached)."""
    pre = prerequisites()
    return tested(pre.numba_cuda) if pre.ok else pre


def prerequisites() -> KernelStatus:
    """Everything :func:`kernel_status` checks before the self-test: a failed status saying why, or
    ``ok`` with the numba-cuda version when only the self-test is left (``sparsekit.runtime.selftest_cache``
    takes that result from disk when this GPU and software passed it before)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1":
        return KernelStatus(False, "kernels: Numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1): tests only")
    try:
        import torch
    except Exception as e:  # pragma: no cover - torch is a dependency
        return KernelStatus(False, f"kernels: torch does not import ({e})")
    if not torch.cuda.is_available():
        return KernelStatus(False, "kernels: no CUDA GPU visible to torch: sparse layers run the reference path")
    version = numba_cuda_version()
    try:
        from numba import cuda

        implementation = getattr(cuda, "implementation", "")
    except Exception as e:
        return KernelStatus(False, f"kernels: numba.cuda does not import ({type(e).__name__}: {e}): {install_hint()}",
                            install_hint())
    if version is None:
        return KernelStatus(False, f"kernels: numba-cuda is not installed (numba's built-in CUDA target cannot "
                                   f"compile them): {install_hint()}", install_hint())
    if implementation == "Built-in":  # installed, but its import redirector (a .pth file) never ran
        return KernelStatus(False, f"kernels: numba-cuda {version} is installed but inactive (numba.cuda is numba's "
                                   f"built-in target, which cannot compile them; its _numba_cuda_redirector.pth did "
                                   f"not run in this environment): {install_hint()} in this environment",
                            install_hint(), version)
    try:
        if not cuda.is_available():
            return KernelStatus(False, "kernels: numba-cuda sees no usable GPU (driver?)", install_hint(), version)
    except Exception as e:
        return _failed(e, version)
    return KernelStatus(True, "kernels: prerequisites ok, self-test to run", None, version)


def tested(version: str | None) -> KernelStatus:
    """The status after running :func:`self_test` (``version``: numba-cuda's, from :func:`prerequisites`)."""
    try:
        self_test()
    except Exception as e:
        return _failed(e, version)
    return passed(version)


def passed(version: str | None, note: str = "") -> KernelStatus:
    import torch

    return KernelStatus(True, f"kernels: ok (numba-cuda {version}, {torch.cuda.get_device_name()}{note})", None, version)


def _failed(e: Exception, version: str | None) -> KernelStatus:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return KernelStatus(False, f"kernels: a test kernel failed to compile or run ({type(e).__name__}: {first[:200]}): "
                               f"{install_hint()}", install_hint(), version)
