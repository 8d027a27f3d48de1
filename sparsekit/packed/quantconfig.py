"""The ``quantization_config`` of a packed directory: what hands it to sparsekit in ``from_pretrained``.

``sparsekit encode`` adds to the packed ``config.json`` (docs/format.md, "Loading with transformers")::

    "quantization_config": {
        "quant_method": "sparsekit",          # the name sparsekit registers with transformers
        "format": "tcabme",
        "format_version": 1,
        "packed_modules": ["model.layers.0.self_attn.q_proj", ...],
        "cats_thresholds": "sparsekit.json",  # or null: where the CATS thresholds are
        "sparsekit_version": "0.1.0"
    }

and writes ``tcabme.stub.safetensors``, a safetensors file holding no tensor: the file
``from_pretrained`` is pointed at once sparsekit has taken the directory (the weights are in the
``tcabme-*`` shards, read by sparsekit's loader). Without sparsekit imported, transformers skips the
unknown ``quant_method`` and finds no ``model.safetensors``: it fails, it never builds a model.

Every field is data. :func:`check` accepts exactly these keys with these values, and
:func:`check_directory` that the directory holds what they name; a tampered config (another
format, an unknown version, a module path or file name that is not a plain name, a missing shard) is
one ``SparsekitError`` line, and nothing named in it is imported or run.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from sparsekit.errors import SparsekitError
from sparsekit.hf.metadata import METADATA_FILE
from sparsekit.host import filemode
from sparsekit.packed import shards as sh
from sparsekit.packed.tcabme import FORMAT_NAME, FORMAT_VERSION

QUANT_METHOD = "sparsekit"
STUB_NAME = "tcabme.stub.safetensors"
CATS_FILE = METADATA_FILE   # sparsekit.json (sparsekit.hf.metadata)
KEYS = ("quant_method", "format", "format_version", "packed_modules", "cats_thresholds", "sparsekit_version")
_MODULE = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
_VERSION = re.compile(r"[0-9A-Za-z.+\-]{1,40}")
_FIX = "re-run `sparsekit encode`"


def build(layers: dict[str, dict], *, cats: bool) -> dict[str, Any]:
    """The ``quantization_config`` for a directory whose index lists ``layers`` (module -> info)."""
    from sparsekit import __version__

    return {
        "quant_method": QUANT_METHOD,
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "packed_modules": sorted(name for name, info in layers.items() if info.get("packed")),
        "cats_thresholds": CATS_FILE if cats else None,
        "sparsekit_version": __version__,
    }


def _bad(what: str) -> SparsekitError:
    return SparsekitError(f"config.json: quantization_config {what}: the packed directory was altered; {_FIX}")


def check(qc: Any) -> dict[str, Any]:
    """``qc`` if it is a quantization_config sparsekit wrote (see the module doc), else one-line error."""
    if not isinstance(qc, dict):
        raise _bad("is not a JSON object")
    unknown = sorted(set(qc) - set(KEYS))
    if unknown:
        raise _bad(f"has unknown field {unknown[0]!r} (this sparsekit reads {', '.join(KEYS)})")
    missing = [k for k in KEYS if k not in qc]
    if missing:
        raise _bad(f"lacks the field {missing[0]!r}")
    if qc["quant_method"] != QUANT_METHOD:
        raise _bad(f"has quant_method {qc['quant_method']!r}, not {QUANT_METHOD!r}")
    if qc["format"] != FORMAT_NAME:
        raise _bad(f"names format {str(qc['format'])[:80]!r}: sparsekit reads only {FORMAT_NAME!r}")
    if not sh.supported_version(qc["format_version"]):
        raise SparsekitError(f"config.json: quantization_config has format version {qc['format_version']!r}; this "
                             f"sparsekit reads version {FORMAT_VERSION}: upgrade sparsekit or re-encode the checkpoint")
    mods = qc["packed_modules"]
    if not isinstance(mods, list) or not all(isinstance(m, str) and _MODULE.fullmatch(m) for m in mods):
        raise _bad("has packed_modules that are not a list of module names")
    if qc["cats_thresholds"] not in (None, CATS_FILE):
        raise _bad(f"names {str(qc['cats_thresholds'])[:80]!r} for the CATS thresholds (only {CATS_FILE!r} or null)")
    if not (isinstance(qc["sparsekit_version"], str) and _VERSION.fullmatch(qc["sparsekit_version"])):
        raise _bad("has a sparsekit_version that is not a version")
    return qc


def check_directory(qc: dict[str, Any], path: Path) -> dict[str, Any]:
    """The directory holds what ``qc`` (already through :func:`check`) names: its index (returned),
    the stub, every shard the index lists, the same packed modules, and the CATS file when one is named."""
    index = sh.load_index(path)   # missing / not JSON / wrong format or version: one line
    if not (path / STUB_NAME).is_file():
        raise SparsekitError(f"{path} lacks {STUB_NAME}, the file from_pretrained is pointed at: {_FIX}")
    for shard in sorted(set(index["weight_map"].values())):
        if not (path / shard).is_file():
            raise SparsekitError(f"shard {shard} is missing from {path}: the checkpoint is incomplete; {_FIX}")
    packed = sorted(m for m, info in index["layers"].items() if info.get("packed"))
    if packed != sorted(qc["packed_modules"]):
        extra = sorted(set(qc["packed_modules"]) ^ set(packed))
        raise _bad(f"lists packed modules that differ from {sh.INDEX_NAME} (e.g. {extra[0]})")
    if qc["cats_thresholds"] and not (path / qc["cats_thresholds"]).is_file():
        raise SparsekitError(f"{path} has no {qc['cats_thresholds']} although config.json says the CATS thresholds "
                             f"are there: {_FIX}")
    return index


def write(out: Path, layers: dict[str, dict], *, cats: bool) -> dict[str, Any]:
    """Add the quantization_config to ``out/config.json`` (when there is one) and write the stub."""
    from safetensors.torch import save_file

    qc = build(layers, cats=cats)
    config_path = out / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        config["quantization_config"] = qc
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    stub = out / STUB_NAME
    save_file({}, str(stub), metadata={"format": "pt", "sparsekit": f"no tensors: the weights are in the "
                                       f"{sh.SHARD_STEM}-* shards ({sh.INDEX_NAME}); import sparsekit to load them"})
    filemode.public_file(stub)
    return qc
