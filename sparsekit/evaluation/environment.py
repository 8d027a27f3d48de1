"""What this machine offers sparsekit: package versions, the GPU, and whether the kernels can run."""
from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Any

PACKAGES = ("torch", "transformers", "numba", "numba-cuda", "cuda-core", "safetensors", "datasets", "gguf")


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment_report() -> dict[str, Any]:
    """Versions, the GPU torch sees (with its memory bandwidth and which 2:4 plan set it takes:
    ``kernels.gpu_facts``), and :func:`sparsekit.kernels.health.kernel_status` (compiles and runs one small
    kernel when a GPU is there)."""
    import torch

    from sparsekit import __version__
    from sparsekit.kernels.health import kernel_status

    status = kernel_status()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    memory = None
    if gpu:
        from sparsekit.kernels.gpu_facts import bandwidth_gbps, fast_memory

        dev = torch.device("cuda", torch.cuda.current_device())
        memory = {"gbps": round(bandwidth_gbps(dev)) or None, "fast_memory_plans": fast_memory(dev)}
    return {
        "sparsekit": __version__,
        "python": platform.python_version(),
        "packages": {name: _version(name) for name in PACKAGES},
        "torch_cuda": torch.version.cuda,
        "gpu": gpu,
        "gpu_memory": memory,
        "kernels": {"ok": status.ok, "line": status.line, "fix": status.fix},
    }
