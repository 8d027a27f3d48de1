"""``sparsekit.json``: what a pruned checkpoint records about how it was made, as one typed model::

    {"schema_version": 1, "sparsekit_version", "model", "method", "pattern", "sparsity",
     "calibration": {...}, "skip": [...], "layers": {"<module>": {"sparsity", "shape": [out, in], "kind"}},
     "versions": {...}, "elapsed_s"}

plus ``"cats"`` (CATS thresholds, alone or stacked on a weight method: ``{"target", "quantile",
"activation_sparsity", "mlps": {"<gated MLP>": {"threshold", "activation_sparsity", "samples",
"exact"}}}``) and ``"learning"`` (how a learned or globally allocated mask was made).

``PruneMetadata.read(directory)`` (None when there is no ``sparsekit.json``) and ``.write(directory)``
are the only reading and writing of the file. A file without ``schema_version`` is version 1 (written
before the field existed); a newer one than this sparsekit reads is refused in one line. Keys this
version does not know are kept in ``extra`` and written back as they were.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from sparsekit.errors import SparsekitError
from sparsekit.host.jsonfile import read_json_object

METADATA_FILE = "sparsekit.json"
SCHEMA_VERSION = 1


@dataclass
class PruneMetadata:
    """The contents of ``sparsekit.json`` (see the module doc)."""

    model: str | None = None
    method: str | None = None
    pattern: str | None = None
    sparsity: float | None = None
    calibration: dict[str, Any] = field(default_factory=dict)
    skip: list[str] = field(default_factory=list)
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    elapsed_s: float | None = None
    sparsekit_version: str | None = None
    cats: dict[str, Any] | None = None
    learning: dict[str, Any] | None = None
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = METADATA_FILE) -> "PruneMetadata":
        version = data.get("schema_version", 1)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise SparsekitError(f"{where}: schema_version {version!r} is not a positive integer: fix or remove it")
        if version > SCHEMA_VERSION:
            raise SparsekitError(f"{where} was written by a newer sparsekit (schema {version}; this one reads up to "
                                 f"{SCHEMA_VERSION}): upgrade sparsekit")
        known = {f.name for f in fields(cls)} - {"extra"}
        meta = cls(**{k: v for k, v in data.items() if k in known})
        meta.extra = {k: v for k, v in data.items() if k not in known}
        for name, kind in (("calibration", dict), ("skip", list), ("layers", dict), ("versions", dict)):
            if not isinstance(getattr(meta, name), kind):
                raise SparsekitError(f"{where}: \"{name}\" is not a JSON {'object' if kind is dict else 'list'}: "
                                     "fix or remove it")
        return meta

    @classmethod
    def read(cls, directory: str | os.PathLike) -> "PruneMetadata | None":
        """The ``sparsekit.json`` of ``directory``; None when it has none; one line when it is unreadable."""
        path = Path(directory) / METADATA_FILE
        if not path.is_file():
            return None
        data = read_json_object(path)
        return cls.from_dict(data, str(path))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object, ``schema_version`` first; ``cats`` and ``learning`` only when set."""
        out: dict[str, Any] = {"schema_version": self.schema_version}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("schema_version", "extra") or (f.name in ("cats", "learning") and value is None):
                continue
            out[f.name] = value
        return {**out, **self.extra}

    def write(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / METADATA_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def layer(self, module: str) -> dict[str, Any]:
        """The entry of one pruned linear ({} when it has none)."""
        entry = self.layers.get(module)
        return entry if isinstance(entry, dict) else {}
