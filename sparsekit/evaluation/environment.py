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
    """Versions, the GPU torch sees, and :func:`sparsekit.kernels.health.kernel_status` (compiles and
    runs one small kernel when a GPU is there)."""
    import torch

    from sparsekit import __version__
    from sparsekit.kernels.health import kernel_status

    status = kernel_status()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "sparsekit": __version__,
        "python": platform.python_version(),
        "packages": {name: _version(name) for name in PACKAGES},
        "torch_cuda": torch.version.cuda,
        "gpu": gpu,
        "kernels": {"ok": status.ok, "line": status.line, "fix": status.fix},
    }
