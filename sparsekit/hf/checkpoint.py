"""Write a pruned model: an ordinary HF checkpoint directory plus ``sparsekit.json``.

The pruned weights are stored dense, with zeros (the contract between pruning and packing).
``sparsekit.json``::

    {"sparsekit_version", "model", "method", "pattern", "sparsity", "calibration": {...},
     "skip": [...], "layers": {"<module name>": {"sparsity", "shape": [out, in], "kind"}},
     "versions": {...}, "elapsed_s"}

plus, for ``--method cats`` (no weight changed), ``"cats": {"target", "quantile", "activation_sparsity",
"mlps": {"<gated MLP name>": {"threshold", "activation_sparsity", "samples", "exact"}}}``.

A model card (``README.md``) is written beside it. The directory is written atomically (temporary
sibling, then rename); an existing output is refused unless ``overwrite``.
"""
from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from sparsekit.hf import modelcard
from sparsekit.hf.atomic import atomic_output_dir
from sparsekit.hf.filemode import public_tree

METADATA_FILE = "sparsekit.json"


def package_versions() -> dict[str, str]:
    import safetensors
    import torch
    import transformers

    from sparsekit import __version__

    return {
        "sparsekit": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


def build_metadata(*, model: str, method: str, pattern: str, sparsity: float, calibration: dict,
                   skip: list[str], layers: dict[str, dict], elapsed_s: float,
                   cats: dict | None = None) -> dict[str, Any]:
    from sparsekit import __version__

    meta = {
        "sparsekit_version": __version__,
        "model": model,
        "method": method,
        "pattern": pattern,
        "sparsity": sparsity,
        "calibration": calibration,
        "skip": list(skip),
        "layers": {
            name: {"sparsity": float(r["sparsity"]), "shape": [int(x) for x in r["shape"]], "kind": r["kind"]}
            for name, r in layers.items()
        },
        "versions": package_versions(),
        "elapsed_s": float(elapsed_s),
    }
    if cats is not None:
        meta["cats"] = cats
    return meta


def save_pruned(model, tokenizer, output: str | Path, metadata: dict, *, overwrite: bool = False,
                max_shard_size: str = "5GB") -> Path:
    """Save ``model`` (on the CPU), its tokenizer and ``metadata`` into ``output`` atomically."""
    with atomic_output_dir(output, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_metadata(tmp, metadata, replacing=Path(output))
        public_tree(tmp)  # safetensors writes its files 0600: every file follows the umask
    return Path(output)


def write_metadata(directory: Path, metadata: dict, *, replacing: Path | None = None) -> None:
    """``sparsekit.json`` and the model card (``README.md``, ``sparsekit.hf.modelcard``) of a pruned
    checkpoint, beside its weights; a README of the user's in the output it replaces stays instead."""
    (directory / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    modelcard.keep_user_readme(replacing, directory)
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    modelcard.write_card(directory, modelcard.render(metadata, packed=None, size_bytes=size))


def read_metadata(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / METADATA_FILE).read_text())
