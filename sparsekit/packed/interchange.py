"""Interchange with compressed-tensors ``sparse-bitmask`` checkpoints (llm-compressor's sparse format).

Per compressed weight ``<prefix>.weight`` of shape ``[rows, cols]`` (as stored, no transpose):

- ``<prefix>.shape``        int64 [2]
- ``<prefix>.compressed``   the nonzero values, row-major (dtype of the weight)
- ``<prefix>.bitmask``      uint8 [rows, ceil(cols/8)], ``numpy.packbits(mask, axis=-1, bitorder="little")``
- ``<prefix>.row_offsets``  int64 [rows], index in ``compressed`` where each row starts

and ``config.json`` carries ``quantization_config.sparsity_config`` with format "sparse-bitmask".
"Nonzero" is judged on the bit pattern, so ``-0.0`` is kept and the round trip is bit-exact.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from sparsekit.packed import shards as sh
from sparsekit.host.atomic import atomic_output_dir, check_output_dir
from sparsekit.errors import SparsekitError
from sparsekit.hf.metadata import PruneMetadata
from sparsekit.progress import Progress
from sparsekit.packed.encoding import (checkpoint_files, copy_side_files, header_info, linear_modules,
                                       load_json, refuse_bitmask_source, resolve_key, side_files)
from sparsekit.packed.estimate import HEADER_BYTES, ITEM_BYTES, bitmask_nbytes, files_nbytes, recorded_sparsity

FORMAT = "sparse-bitmask"
PARTS = ("shape", "compressed", "bitmask", "row_offsets")


def _raw(t: torch.Tensor) -> np.ndarray:
    """Bit patterns as a numpy array of the same item size (numpy has no bf16)."""
    t = t.contiguous()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(view).numpy()


def bitmask_compress(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A 2-D weight -> the four sparse-bitmask tensors (without the name prefix)."""
    if weight.dim() != 2:
        raise SparsekitError(f"sparse-bitmask stores 2-D weights, got shape {tuple(weight.shape)}")
    raw = _raw(weight.cpu())
    mask = raw != 0
    counts = mask.sum(axis=1, dtype=np.int64)
    values = torch.from_numpy(np.compress(mask.reshape(-1), raw.reshape(-1))).view(weight.dtype)
    return {
        "shape": torch.tensor(list(weight.shape), dtype=torch.int64),
        "compressed": values,
        "bitmask": torch.from_numpy(np.packbits(mask, axis=-1, bitorder="little")),
        "row_offsets": torch.from_numpy(np.cumsum(counts) - counts),
    }


def bitmask_decompress(parts: dict[str, torch.Tensor], name: str = "weight") -> torch.Tensor:
    """The four tensors -> the dense weight, checking that they agree with each other."""
    shape = [int(s) for s in parts["shape"].tolist()]
    if len(shape) != 2 or min(shape) < 0:
        raise SparsekitError(f"{name}.shape is {shape}: sparse-bitmask weights must be 2-D")
    rows, cols = shape
    bm = parts["bitmask"].cpu().contiguous()
    if tuple(bm.shape) != (rows, -(-cols // 8)) or bm.element_size() != 1:
        raise SparsekitError(f"{name}.bitmask has shape {tuple(bm.shape)}, expected {(rows, -(-cols // 8))} bytes")
    mask = np.unpackbits(bm.view(torch.uint8).numpy(), axis=-1, count=cols, bitorder="little").astype(bool)
    values = parts["compressed"].cpu().contiguous()
    nnz = int(mask.sum())
    if values.numel() != nnz:
        raise SparsekitError(f"{name}.compressed holds {values.numel()} values but the bitmask marks {nnz}: the checkpoint is corrupt")
    if "row_offsets" in parts:
        counts = mask.sum(axis=1, dtype=np.int64)
        if not np.array_equal(parts["row_offsets"].cpu().numpy().astype(np.int64), np.cumsum(counts) - counts):
            raise SparsekitError(f"{name}.row_offsets disagree with the bitmask: the checkpoint is corrupt")
    raw = np.zeros((rows, cols), dtype=_raw(values[:0]).dtype)
    raw.reshape(-1)[np.flatnonzero(mask)] = _raw(values).reshape(-1)
    return torch.from_numpy(raw).view(values.dtype)


def _packed_tensors(src: Path):
    """Like ``_dense_tensors`` over a packed directory, one shard open at a time: a packed weight is
    decoded as soon as its five tensors are read (they share a shard), each tensor checked against
    the index's sha256."""
    from safetensors import safe_open

    from sparsekit.packed.tcabme import FIELDS, TcaBme, decode

    index = sh.load_index(src)
    layers, checksums = index["layers"], index.get("checksums", {})
    parts = {f"{m}{sh.TCABME_INFIX}{f}": m for m, info in layers.items() if info.get("packed") for f in FIELDS}
    dense_linear = {info.get("weight", f"{m}.weight") for m, info in layers.items() if not info.get("packed")}
    by_shard: dict[str, list[str]] = {}
    for name, shard in index["weight_map"].items():
        by_shard.setdefault(shard, []).append(name)
    yield len(index["weight_map"]) - len(parts) + len(set(parts.values()))
    got: dict[str, dict[str, torch.Tensor]] = {}
    for shard, names in by_shard.items():
        sh.read_header(src / shard)  # clear errors for missing / truncated shards
        try:
            with safe_open(str(src / shard), framework="pt", device="cpu") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise SparsekitError(f"shard {shard} lacks tensor {name} listed in {sh.INDEX_NAME}: "
                                             "the checkpoint is corrupt; re-run `sparsekit encode`")
                    t = f.get_tensor(name)
                    if name in checksums and sh.tensor_sha256(t) != checksums[name]:
                        raise SparsekitError(f"corrupt shard {shard}, tensor {name}: sha256 mismatch (its bytes were "
                                             "changed); re-run `sparsekit encode`")
                    if name not in parts:
                        yield name, t, name in dense_linear
                        continue
                    module = parts[name]
                    got.setdefault(module, {})[name] = t
                    if len(got[module]) == len(FIELDS):
                        w = decode(TcaBme.from_tensors(got.pop(module), module))
                        yield f"{module}.weight", (w.t().contiguous() if layers[module].get("transposed") else w), True
        except SparsekitError:
            raise
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise SparsekitError(f"shard {shard} cannot be read ({e}): re-run `sparsekit encode`") from None


def _dense_tensors(src: Path):
    """(name, tensor, is_linear_weight) over a pruned HF checkpoint or a packed directory, after
    their count; one tensor (one packed weight) and one open shard at a time."""
    if sh.is_packed_dir(src):
        yield from _packed_tensors(src)
        return
    files = checkpoint_files(src)
    modules = linear_modules(src, load_json(src / "config.json"), (PruneMetadata.read(src) or PruneMetadata()).layers)
    keys = {resolve_key(m, files) for m in modules} - {None}
    yield len(files)
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for n, f in files.items():
        by_file.setdefault(f, []).append(n)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for n in names:
                yield n, f.get_tensor(n), n in keys


def _nbytes(dtype: str, shape) -> int:
    return int(np.prod(shape)) * ITEM_BYTES.get(dtype, 4)


def _export_estimate(src: Path, config: dict) -> int:
    """The bytes ``export_bitmask`` writes, from the headers and the recorded sparsity of each linear
    (``sparsekit.packed.estimate``; a linear without one counts as dense)."""
    from sparsekit.packed.tcabme import FIELDS

    if sh.is_packed_dir(src):
        index = sh.load_index(src)
        headers: dict[str, tuple[str, list[int]]] = {}
        for shard in set(index["weight_map"].values()):
            header, _ = sh.read_header(src / shard)
            headers.update({k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"})
        linears = {}   # tensor names the linears take -> (rows, cols as stored, sparsity, item bytes)
        for m, info in index["layers"].items():
            out, inp = info["shape"]
            shape = (inp, out) if info.get("transposed") else (out, inp)
            names = ([f"{m}{sh.TCABME_INFIX}{f}" for f in FIELDS] if info.get("packed")
                     else [info.get("weight", f"{m}.weight")])
            linears[m] = (names, shape, recorded_sparsity(info), 4 if info.get("dtype") == "float32" else 2)
    else:
        headers = header_info(checkpoint_files(src))
        meta = PruneMetadata.read(src) or PruneMetadata()
        linears = {}
        for m in linear_modules(src, config, meta.layers):
            key = resolve_key(m, headers)
            if key is not None:
                dt, shape = headers[key]
                linears[m] = ([key], tuple(shape), recorded_sparsity(meta.layer(m)),
                              ITEM_BYTES.get(dt, 4))
    taken = {n for names, *_ in linears.values() for n in names}
    total = files_nbytes(side_files(src)) + sum(_nbytes(dt, shape) + HEADER_BYTES
                                                for n, (dt, shape) in headers.items() if n not in taken)
    return total + sum(bitmask_nbytes(shape, sparsity or 0.0, item) for _, shape, sparsity, item in linears.values())


def _prepare(src, out, overwrite: bool, max_shard_size, what: str, delete_extra: bool = False):
    """The checks both directions start with: ``(src, out, max shard bytes, config.json as a dict)``."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise SparsekitError(f"no checkpoint directory at {src}: pass {what}")
    max_bytes = sh.parse_size(max_shard_size)
    check_output_dir(out, overwrite, [src], delete_extra)
    return src, out, max_bytes, load_json(src / "config.json")


def _finish_shards(writer, src: Path, tmp: Path) -> list:
    """Close the HF-layout shards (with their index when there are several) and copy the side files."""
    weight_map, shards = writer.close(single_name="model.safetensors")
    if len(shards) > 1:
        idx = {"metadata": {"total_size": writer.total_bytes}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(idx, indent=2) + "\n")
    copy_side_files(src, tmp)
    return shards


def export_bitmask(src: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
                   max_shard_size: int | str = "2GB", progress: Progress | None = None,
                   warn: Callable[[str], None] | None = None, delete_extra: bool = False) -> dict[str, Any]:
    """Write ``src`` (pruned HF dir or TCA-BME dir) as a compressed-tensors sparse-bitmask checkpoint.

    The output is locked, checked and written as ``sparsekit.host.atomic`` describes (``warn``,
    ``delete_extra``: see ``encode``).
    """
    t0 = time.perf_counter()
    src, out, max_bytes, config = _prepare(src, out, overwrite, max_shard_size, "a pruned or packed sparsekit checkpoint",
                                              delete_extra)
    if not config:
        raise SparsekitError(f"{src} has no config.json: cannot write a loadable checkpoint")
    refuse_bitmask_source(src, config)
    it = _dense_tensors(src)
    total = next(it)
    compressed, zeros, numel, done = [], 0, 0, 0
    estimate = _export_estimate(src, config)
    with atomic_output_dir(out, overwrite=overwrite, sources=[src], estimate=estimate, warn=warn,
                           delete_extra=delete_extra) as tmp:
        writer = sh.ShardWriter(tmp, max_bytes, stem="model", file_metadata={"format": "pt"})
        for name, t, is_linear in it:
            if is_linear and name.endswith(".weight") and t.dim() == 2 and t.is_floating_point():
                prefix = name[: -len(".weight")]
                parts = bitmask_compress(t)
                writer.add({f"{prefix}.{k}": v for k, v in parts.items()})
                compressed.append(prefix)
                numel += t.numel()
                zeros += t.numel() - parts["compressed"].numel()
            else:
                writer.add({name: t})
            done += 1
            if progress:
                progress("exporting", done, total, item=name)
        shards = _finish_shards(writer, src, tmp)
        meta = PruneMetadata.read(src) or PruneMetadata()
        config = dict(config)
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "sparsity_config": {
                "format": FORMAT,
                "global_sparsity": zeros / numel if numel else 0.0,
                "sparsity_structure": _structure(meta.pattern),
                "targets": sorted(compressed),
                "ignore": [],
            },
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"output": str(out), "source": str(src), "format": FORMAT, "compressed_weights": len(compressed),
            "global_sparsity": zeros / numel if numel else 0.0, "bytes": writer.total_bytes,
            "shards": len(shards), "elapsed_s": round(time.perf_counter() - t0, 3)}


def _structure(pattern: str | None) -> str:
    if pattern and ":" in pattern and not pattern.startswith("hybrid"):
        return pattern
    return "unstructured"


def _dense_estimate(files: dict[str, Path], groups: dict[str, dict[str, str]]) -> int:
    """The size of the dense checkpoint import-bitmask writes, from the safetensors headers alone."""
    headers = header_info(files)
    grouped = {n for parts in groups.values() for n in parts.values()}
    total = sum(_nbytes(dt, shape) for n, (dt, shape) in headers.items() if n not in grouped)
    for parts in groups.values():
        bm_shape = headers[parts["bitmask"]][1]
        numel = int(np.prod(bm_shape)) * 8   # rows x ceil(cols / 8) bytes of bits
        total += numel * ITEM_BYTES.get(headers[parts["compressed"]][0], 4)
    return total


def import_bitmask(src: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
                   max_shard_size: int | str = "2GB", progress: Progress | None = None,
                   warn: Callable[[str], None] | None = None, delete_extra: bool = False) -> dict[str, Any]:
    """Rebuild a dense pruned HF checkpoint (what `sparsekit encode` reads) from a sparse-bitmask one.

    The output is locked, checked and written as ``sparsekit.host.atomic`` describes (``warn``,
    ``delete_extra``: see ``encode``).
    """
    t0 = time.perf_counter()
    src, out, max_bytes, config = _prepare(src, out, overwrite, max_shard_size,
                                           "a compressed-tensors sparse-bitmask checkpoint", delete_extra)
    qc = config.get("quantization_config") or config.get("compression_config") or {}
    sc = qc.get("sparsity_config") or {}
    if sc.get("format") != FORMAT:
        raise SparsekitError(
            f"{src}/config.json has no quantization_config.sparsity_config with format {FORMAT!r} "
            f"(found {sc.get('format')!r}): not a sparse-bitmask checkpoint"
        )
    if qc.get("config_groups"):
        raise SparsekitError(f"{src} is also quantized: sparsekit imports only unquantized sparse-bitmask checkpoints")
    files = checkpoint_files(src)
    groups: dict[str, dict[str, str]] = {}
    for name in files:
        prefix, _, part = name.rpartition(".")
        if part in PARTS:
            groups.setdefault(prefix, {})[part] = name
    for prefix, parts in groups.items():
        missing = [p for p in ("shape", "compressed", "bitmask") if p not in parts]
        if missing:
            raise SparsekitError(f"compressed weight {prefix} lacks {prefix}.{missing[0]}: the checkpoint is incomplete")
    grouped = {n for parts in groups.values() for n in parts.values()}
    from safetensors import safe_open

    handles: dict[Path, Any] = {}   # one shard open at a time: its mapped pages leave with it

    def get(name: str) -> torch.Tensor:
        file = files[name]
        if file not in handles:
            handles.clear()
            handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return handles[file].get_tensor(name)

    total = len(groups) + len(files) - len(grouped)
    done = 0
    with atomic_output_dir(out, overwrite=overwrite, sources=[src], estimate=_dense_estimate(files, groups),
                           warn=warn, delete_extra=delete_extra) as tmp:
        writer = sh.ShardWriter(tmp, max_bytes, stem="model", file_metadata={"format": "pt"})
        emitted = set()
        for name in files:
            if name in grouped:
                prefix = name.rpartition(".")[0]
                if prefix in emitted:
                    continue
                emitted.add(prefix)
                w = bitmask_decompress({p: get(n) for p, n in groups[prefix].items()}, prefix)
                writer.add({f"{prefix}.weight": w})
                name = f"{prefix}.weight"
            else:
                writer.add({name: get(name)})
            done += 1
            if progress:
                progress("importing", done, total, item=name)
        shards = _finish_shards(writer, src, tmp)
        config = dict(config)
        for key in ("quantization_config", "compression_config"):
            config.pop(key, None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"output": str(out), "source": str(src), "format": FORMAT, "decompressed_weights": len(groups),
            "bytes": writer.total_bytes, "shards": len(shards), "elapsed_s": round(time.perf_counter() - t0, 3)}
