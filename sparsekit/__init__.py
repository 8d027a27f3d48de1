"""sparsekit: prune a Hugging Face causal LM, pack it as TCA-BME, run it on sparse GPU kernels.

The library API is what the CLI calls; scripts can import it directly.
Heavy modules are imported lazily so that ``import sparsekit`` stays cheap. Module names differ
from the exported function names on purpose: importing ``sparsekit.foo`` sets the package
attribute ``foo`` to the module, which would shadow a function of the same name.

Run from the source tree's root, ``import sparsekit`` keeps the bare names of its mapped folders
(``kernels``, ...) from resolving to them (``sparsekit.source_tree``). It also registers the
``"sparsekit"`` quantizer with transformers, so that ``AutoModelForCausalLM.from_pretrained(packed_dir)``
works (lazily: ``sparsekit.autoregister``).
"""
from __future__ import annotations

import importlib

from sparsekit import autoregister, source_tree

source_tree.hide_bare_folders()   # from the tree's root, ``kernels`` is not sparsekit's folder (transformers probes it)

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "SparsekitError": "sparsekit.errors",
    "prune": "sparsekit.pruning.api",            # prune(model, ..., output) -> report
    "encode_checkpoint": "sparsekit.packed.encoding",   # encode_checkpoint(pruned_dir, out_dir, ...) -> report
    "encode": "sparsekit.packed.encoding",       # the old name of encode_checkpoint, kept for one release
    "decode": "sparsekit.packed.tcabme",         # decode(TcaBme) -> dense tensor, bit-exact (one weight)
    "load": "sparsekit.runtime.loader",          # load(dir | hub id | alias, device, dtype) -> (model, tokenizer)
    "load_packed": "sparsekit.runtime.loader",   # load_packed(dir, device="auto") -> HF model
    "perplexity": "sparsekit.evaluation.ppl",    # perplexity(model, tokenizer, text, ...) -> dict
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sparsekit' has no attribute {name!r}")


__all__ = ["__version__", *_EXPORTS]

autoregister.install()  # from_pretrained loads packed directories (registered once transformers.quantizers is imported)
