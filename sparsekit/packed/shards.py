"""safetensors shards + the ``tcabme.index.json`` index of a packed checkpoint (docs/format.md).

Writing: ``ShardWriter`` packs groups of tensors (a module's five TCA-BME tensors stay together)
into files of at most ``max_shard_size`` bytes and records, per shard, its size and sha256 and,
per tensor, its shard and the sha256 of its bytes. Reading: ``read_packed(dir, device)``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparsekit.errors import SparsekitError
from sparsekit.host import filemode
from sparsekit.packed.tcabme import FIELDS, FORMAT_NAME, FORMAT_VERSION, TcaBme

INDEX_NAME = "tcabme.index.json"
SHARD_STEM = "tcabme"
TCABME_INFIX = ".tcabme."

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``"2GB"`` -> 2_000_000_000; also ``"500MB"``, ``"1.5GiB"``, ``"1024"``, or an int."""
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if not m or m.group(2) not in _UNITS:
            raise SparsekitError(f"cannot read size {size!r}: write e.g. 2GB, 500MB or 1GiB")
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n <= 0:
        raise SparsekitError(f"shard size must be positive, got {size!r}: pass e.g. --max-shard-size 2GB")
    return n


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw little-endian bytes, as stored in a safetensors file."""
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().data).hexdigest()


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class ShardWriter:
    """Groups tensors into shards of at most ``max_bytes`` (a group larger than that gets its own)."""

    out_dir: Path
    max_bytes: int
    stem: str = SHARD_STEM
    file_metadata: dict[str, str] = field(default_factory=dict)
    _pending: dict[str, torch.Tensor] = field(default_factory=dict)
    _pending_bytes: int = 0
    _written: list[tuple[Path, list[str]]] = field(default_factory=list)
    checksums: dict[str, str] = field(default_factory=dict)
    total_bytes: int = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        size = sum(tensor_nbytes(t) for t in tensors.values())
        if self._pending and self._pending_bytes + size > self.max_bytes:
            self._flush()
        for name, t in tensors.items():
            if name in self._pending or name in self.checksums:
                raise SparsekitError(f"tensor {name} appears twice in the checkpoint: fix the source checkpoint")
            t = t.detach().cpu().contiguous()
            self._pending[name] = t
            self.checksums[name] = tensor_sha256(t)
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out_dir / f".{self.stem}-{len(self._written) + 1:05d}.part"
        save_file(self._pending, str(path), metadata=self.file_metadata)
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self, single_name: str | None = None) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
        """Write the last shard; return ``(weight_map, shards)`` with shards = {file: {bytes, sha256}}.

        Files are named ``<stem>-00001-of-0000N.safetensors`` (or ``single_name`` for one shard).
        """
        if self._pending or not self._written:
            self._flush()
        n = len(self._written)
        weight_map, shards = {}, {}
        for i, (tmp, names) in enumerate(self._written, 1):
            name = single_name if (single_name and n == 1) else f"{self.stem}-{i:05d}-of-{n:05d}.safetensors"
            final = self.out_dir / name
            os.replace(tmp, final)
            filemode.public_file(final)
            shards[name] = {"bytes": final.stat().st_size, "sha256": file_sha256(final)}
            weight_map.update({t: name for t in names})
        return weight_map, shards


def supported_version(version: Any) -> bool:
    """Whether ``version`` is this sparsekit's ``FORMAT_VERSION``, in either spelling: the index
    stores it as a number, the shard metadata as a string (safetensors metadata holds strings only)."""
    if isinstance(version, bool):
        return False
    if isinstance(version, int):
        return version == FORMAT_VERSION
    return isinstance(version, str) and version.strip() == str(FORMAT_VERSION)


# --------------------------------------------------------------------------------------------
# Reading


@dataclass
class PackedCheckpoint:
    dense: dict[str, torch.Tensor]      # tensors stored as they are, by their usual names
    packed: dict[str, TcaBme]           # module name -> packed weight ([out, in])
    layers: dict[str, dict[str, Any]]   # module name -> info (packed, reason, sparsity, transposed, ...)
    metadata: dict[str, Any]            # index metadata (format, version, sparsekit version, source, ...)
    path: Path | None = None


def is_packed_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / INDEX_NAME).is_file()


def load_index(path: str | os.PathLike) -> dict[str, Any]:
    """Read and sanity-check ``tcabme.index.json`` (format name, version, required keys)."""
    path = Path(path)
    if not path.exists():
        raise SparsekitError(f"no packed checkpoint at {path}: pass the directory written by `sparsekit encode`")
    idx_path = path / INDEX_NAME
    if not idx_path.is_file():
        raise SparsekitError(f"{path} has no {INDEX_NAME}: it is not a TCA-BME checkpoint; run `sparsekit encode` first")
    try:
        index = json.loads(idx_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SparsekitError(f"{idx_path} is not valid JSON ({e}): re-run `sparsekit encode`") from None
    if not isinstance(index, dict):
        raise SparsekitError(f"{idx_path} is not a TCA-BME index: re-run `sparsekit encode`")
    meta = index.get("metadata", {})
    fmt, version = meta.get("format"), meta.get("format_version")
    if fmt != FORMAT_NAME:
        raise SparsekitError(f"{idx_path}: format is {fmt!r}, expected {FORMAT_NAME!r}: not a TCA-BME checkpoint")
    if not supported_version(version):
        raise SparsekitError(
            f"{idx_path}: format version {version!r} is not supported (this sparsekit reads version "
            f"{FORMAT_VERSION}): re-encode the checkpoint with this sparsekit"
        )
    for key in ("weight_map", "shards", "layers"):
        if not isinstance(index.get(key), dict):
            raise SparsekitError(f"{idx_path} lacks its {key!r} table: re-run `sparsekit encode`")
    for module, info in index["layers"].items():
        if info.get("packed"):
            for f in FIELDS:
                name = f"{module}{TCABME_INFIX}{f}"
                if name not in index["weight_map"]:
                    raise SparsekitError(
                        f"{idx_path}: index entry for tensor {name} is missing: the checkpoint is incomplete; re-run `sparsekit encode`"
                    )
    for name, shard in index["weight_map"].items():
        if shard not in index["shards"]:
            raise SparsekitError(f"{idx_path}: tensor {name} points to unknown shard {shard}: re-run `sparsekit encode`")
    return index


def read_header(path: Path, fix: str = "re-run `sparsekit encode`") -> tuple[dict[str, Any], int]:
    """Parse a safetensors header; returns ``(header, data_start)``. Checks the file is complete."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("file shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"header of {n} bytes does not fit in a {size}-byte file")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise SparsekitError(f"shard {path.name} is missing from {path.parent}: the checkpoint is incomplete") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SparsekitError(f"shard {path.name} is corrupt or truncated ({e}): {fix}") from None
    start = 8 + n
    if not isinstance(header, dict):
        raise SparsekitError(f"shard {path.name} is corrupt: its header is not a JSON object: {fix}")
    for name, v in header.items():
        if name == "__metadata__":
            continue
        offsets = v.get("data_offsets") if isinstance(v, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] or "dtype" not in v or not isinstance(v.get("shape"), list)):
            raise SparsekitError(f"shard {path.name} is corrupt: the header entry of tensor {name} is damaged "
                                 f"(no valid dtype, shape and data_offsets): {fix}")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if start + end != size:
        raise SparsekitError(
            f"shard {path.name} is truncated or corrupt: its header describes {start + end} bytes but the file "
            f"has {size}: {fix}"
        )
    return header, start


def _check_sums(shard: str, tensors: dict[str, torch.Tensor], checksums: dict[str, str]) -> None:
    """Each tensor's sha256 against the index, hashed on several threads (hashlib lets go of the GIL)."""
    names = list(tensors)
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        sums = list(pool.map(lambda n: tensor_sha256(tensors[n]), names))
    for name, got in zip(names, sums):
        if got != checksums[name]:
            raise SparsekitError(f"corrupt shard {shard}, tensor {name}: sha256 mismatch (its bytes were changed); "
                                 "re-run `sparsekit encode`")


def read_packed(path: str | os.PathLike, device: str | torch.device = "cpu", *,
                check_checksums: bool = True, rehash: bool = False) -> PackedCheckpoint:
    """Load a packed directory: dense tensors, TcaBme weights (on ``device``), layer info, metadata.

    Every tensor is checked against the sha256 recorded in the index (``check_checksums``), so a
    damaged shard is one clear error naming the shard and tensor instead of silently wrong weights.
    A shard that passed before and whose file has not changed since is not hashed again
    (``sparsekit.packed.trusted``) unless ``rehash``.
    """
    from safetensors import safe_open

    from sparsekit.packed import trusted

    path = Path(path)
    index = load_index(path)
    checksums = index.get("checksums", {}) if check_checksums else {}
    by_shard: dict[str, list[str]] = {}
    for name, shard in index["weight_map"].items():
        by_shard.setdefault(shard, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for shard, names in by_shard.items():
        file = path / shard
        read_header(file)  # clear errors for missing / truncated shards
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise SparsekitError(
                            f"shard {shard} lacks tensor {name} listed in {INDEX_NAME}: the checkpoint is corrupt; re-run `sparsekit encode`"
                        )
                    tensors[name] = f.get_tensor(name)
                digest = trusted.checksums_digest(names, checksums) if checksums else None
                if digest and (rehash or not trusted.passed_before(file, digest)):
                    _check_sums(shard, {n: tensors[n] for n in names if n in checksums}, checksums)
                    trusted.remember(file, digest)
                for name in names:
                    tensors[name] = tensors[name].to(device)
        except SparsekitError:
            raise
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise SparsekitError(f"shard {shard} cannot be read ({e}): re-run `sparsekit encode`") from None
    packed = {}
    for module, info in index["layers"].items():
        if info.get("packed"):
            packed[module] = TcaBme.from_tensors(tensors, module)
            for f in FIELDS:
                tensors.pop(f"{module}{TCABME_INFIX}{f}")
    return PackedCheckpoint(dense=tensors, packed=packed, layers=index["layers"],
                            metadata=index["metadata"], path=path)
