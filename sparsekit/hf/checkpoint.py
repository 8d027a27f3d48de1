"""Write a pruned model: an ordinary HF checkpoint directory plus ``sparsekit.json``
(``sparsekit.hf.metadata.PruneMetadata``).

The pruned weights are stored dense, with zeros (the contract between pruning and packing).
A model card (``README.md``) is written beside it. The directory is written atomically (temporary
sibling, then rename); an existing output is refused unless ``overwrite``.
"""
from __future__ import annotations

import platform
from pathlib import Path

from sparsekit.hf import modelcard
from sparsekit.hf.metadata import PruneMetadata
from sparsekit.host.atomic import atomic_output_dir
from sparsekit.host.filemode import public_tree


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
                   cats: dict | None = None) -> PruneMetadata:
    """The ``sparsekit.json`` of a prune run (this sparsekit's and its packages' versions included)."""
    from sparsekit import __version__

    return PruneMetadata(
        sparsekit_version=__version__, model=model, method=method, pattern=pattern, sparsity=sparsity,
        calibration=calibration, skip=list(skip),
        layers={name: {"sparsity": float(r["sparsity"]), "shape": [int(x) for x in r["shape"]], "kind": r["kind"]}
                for name, r in layers.items()},
        versions=package_versions(), elapsed_s=float(elapsed_s), cats=cats)


def save_pruned(model, tokenizer, output: str | Path, metadata: PruneMetadata, *, overwrite: bool = False,
                max_shard_size: str = "5GB") -> Path:
    """Save ``model`` (on the CPU), its tokenizer and ``metadata`` into ``output`` atomically."""
    with atomic_output_dir(output, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_metadata(tmp, metadata, replacing=Path(output))
        public_tree(tmp)  # safetensors writes its files 0600: every file follows the umask
    return Path(output)


def write_metadata(directory: Path, metadata: PruneMetadata, *, replacing: Path | None = None) -> None:
    """``sparsekit.json`` and the model card (``README.md``, ``sparsekit.hf.modelcard``) of a pruned
    checkpoint, beside its weights; a README of the user's in the output it replaces stays instead."""
    metadata.write(directory)
    modelcard.keep_user_readme(replacing, directory)
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    modelcard.write_card(directory, modelcard.render(metadata.to_dict(), packed=None, size_bytes=size))
