"""sparsekit: prune a Hugging Face causal LM, pack it as TCA-BME, run it on sparse GPU kernels.

The library API is what the CLI calls; scripts can import it directly.
Heavy modules are imported lazily so that ``import sparsekit`` stays cheap.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "SparsekitError": "sparsekit.errors",
    "prune": "sparsekit.prune",
    "encode": "sparsekit.encode",
    "decode": "sparsekit.tcabme",
    "load_packed": "sparsekit.runtime.loader",
    "perplexity": "sparsekit.perplexity",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sparsekit' has no attribute {name!r}")


__all__ = ["__version__", *_EXPORTS]
