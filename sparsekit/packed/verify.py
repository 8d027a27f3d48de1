"""``sparsekit verify`` and ``sparsekit inspect``: check a packed directory, and tabulate it.

verify: the index (format name and version, entries), every shard (present, complete, size and
sha256; a damaged shard is traced to the tensor whose sha256 differs), and the structure of every
packed weight (dtypes, sizes, offsets monotone and multiples of 8, per-GroupTile popcounts match
the value counts, strip offsets consistent, shapes consistent). The first problem raises one
SparsekitError naming the shard and the tensor.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable

import torch

from sparsekit.hf import models
from sparsekit.packed import shards as sh
from sparsekit.packed import quantconfig, tcabme
from sparsekit.errors import SparsekitError
from sparsekit.progress import Progress


_DTYPES = {"bitmaps": ("U64",), "values": ("F16", "BF16"), "gtile_offsets": ("I32",),
           "strip_offsets": ("I32",), "shape": ("I64",)}


def _bad(shard: str, tensor: str, what: str) -> SparsekitError:
    return SparsekitError(f"corrupt shard {shard}, tensor {tensor}: {what}; re-run `sparsekit encode`")


def _hash_range(file: Path, start: int, end: int, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            block = f.read(min(chunk, left))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _check_shard(path: Path, shard: str, info: dict, names: list[str], index: dict) -> dict[str, Any]:
    file = path / shard
    header, start = sh.read_header(file)   # missing / truncated -> clear error naming the shard
    size = file.stat().st_size
    if size != info.get("bytes"):
        raise SparsekitError(f"shard {shard} has {size} bytes, the index records {info.get('bytes')}: "
                             "it is truncated or was replaced; re-run `sparsekit encode`")
    for name in names:
        if name not in header:
            raise _bad(shard, name, f"listed in {sh.INDEX_NAME} but absent from the shard")
    extra = sorted(set(header) - set(names) - {"__metadata__"})
    if extra:
        raise _bad(shard, extra[0], f"present in the shard but missing from {sh.INDEX_NAME}")
    meta = header.get("__metadata__", {})
    if meta.get("format") != tcabme.FORMAT_NAME or not sh.supported_version(meta.get("format_version")):
        raise SparsekitError(f"shard {shard} says format {meta.get('format')!r} version {meta.get('format_version')!r}, "
                             f"expected {tcabme.FORMAT_NAME!r} version {tcabme.FORMAT_VERSION}: re-run `sparsekit encode`")
    if sh.file_sha256(file) != info.get("sha256"):
        checksums = index.get("checksums", {})
        for name in names:
            lo, hi = header[name]["data_offsets"]
            if name in checksums and _hash_range(file, start + lo, start + hi) != checksums[name]:
                raise _bad(shard, name, "sha256 mismatch (its bytes were changed)")
        raise SparsekitError(f"corrupt shard {shard}: sha256 mismatch in its header: re-run `sparsekit encode`")
    return header


def check_structure(p: tcabme.TcaBme, module: str, shard_of: Callable[[str], str]) -> None:
    """Structural invariants of one packed weight (docs/format.md)."""
    def bad(field: str, what: str) -> SparsekitError:
        name = f"{module}{sh.TCABME_INFIX}{field}"
        return _bad(shard_of(name), name, what)

    m, k = p.shape
    if m <= 0 or k <= 0:
        raise bad("shape", f"shape {p.shape} is not a positive [out, in]")
    gm, gk = p.grid
    ngt = gm * gk
    if p.bitmaps.dim() != 1 or p.bitmaps.numel() != 64 * ngt:
        raise bad("bitmaps", f"has {p.bitmaps.numel()} bitmaps, shape {p.shape} needs {64 * ngt}")
    if p.gtile_offsets.dim() != 1 or p.gtile_offsets.numel() != ngt + 1:
        raise bad("gtile_offsets", f"has {p.gtile_offsets.numel()} entries, shape {p.shape} needs {ngt + 1}")
    if p.strip_offsets.dim() != 1 or p.strip_offsets.numel() != 4 * ngt:
        raise bad("strip_offsets", f"has {p.strip_offsets.numel()} entries, shape {p.shape} needs {4 * ngt}")
    off = p.gtile_offsets.long()
    if int(off[0]) != 0:
        raise bad("gtile_offsets", "does not start at 0")
    if bool((off.diff() < 0).any()):
        raise bad("gtile_offsets", "offsets are not monotone")
    if bool((off % tcabme.ALIGN != 0).any()):
        raise bad("gtile_offsets", f"offsets are not multiples of {tcabme.ALIGN}")
    if int(off[-1]) != p.values.numel():
        raise bad("values", f"holds {p.values.numel()} values, the GroupTile offsets end at {int(off[-1])}")
    pc = tcabme.popcount(p.bitmaps).long().reshape(ngt, 4, 16).sum(-1)   # [NGT, 4 strips]
    per_gt = pc.sum(1)
    room = off.diff()
    wrong = (room < per_gt) | (room >= per_gt + tcabme.ALIGN)
    if bool(wrong.any()):
        g = int(wrong.nonzero()[0, 0])
        raise bad("bitmaps", f"GroupTile {g} has {int(per_gt[g])} set bits but {int(room[g])} stored values "
                             "(popcount does not match the value count)")
    so = p.strip_offsets.long().reshape(ngt, 4)
    expect = off[:-1, None] + torch.cumsum(pc, 1) - pc
    if not torch.equal(so, expect):
        g = int((so != expect).any(1).nonzero()[0, 0])
        raise bad("strip_offsets", f"strip offsets of GroupTile {g} disagree with the bitmap popcounts")


_CONFIG_FIX = "copy config.json of the source model into it (or re-run `sparsekit encode`)"


def check_model_fit(path: Path, config, index: dict) -> None:
    """config.json builds a causal LM (parameters on the meta device, nothing allocated) in which
    every packed layer of the index exists as a linear of the recorded shape: what the loader needs."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:
        raise SparsekitError(f"{path / 'config.json'}: transformers cannot build a causal LM from it "
                             f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}): "
                             f"{_CONFIG_FIX}") from None
    for module, info in index["layers"].items():
        if not info.get("packed"):
            continue
        try:
            mod = model.get_submodule(module)
            weight = mod.weight
        except AttributeError:
            raise SparsekitError(f"{sh.INDEX_NAME}: packed layer {module} does not exist in the "
                                 f"{type(model).__name__} that config.json describes: the shards do not match "
                                 f"config.json; {_CONFIG_FIX}") from None
        shape = info.get("shape")
        transposed = info.get("transposed", not isinstance(mod, torch.nn.Linear))  # as the loader reads it
        want = list(weight.shape[::-1]) if transposed else list(weight.shape)
        if shape is not None and list(shape) != want:
            raise SparsekitError(f"{sh.INDEX_NAME}: packed layer {module} is {shape[0]}x{shape[1]}, the model of "
                                 f"config.json expects {want[0]}x{want[1]}: the shards do not match config.json; "
                                 f"{_CONFIG_FIX}")


def verify_packed(path: str | os.PathLike, progress: Progress | None = None) -> dict[str, Any]:
    """Check everything the loader needs; raise SparsekitError on the first problem; return a summary
    on success. Besides the shards and packed weights: config.json (present, JSON, a config
    transformers reads and builds a causal LM from, whose linears fit the packed layers, and whose
    ``quantization_config``, when there is one, matches the directory) and at least one tokenizer
    file (``sparsekit.hf.models.TOKENIZER_FILES``)."""
    path = Path(path)
    index = sh.load_index(path)
    config = models.read_config(path, fix=_CONFIG_FIX)
    qc = getattr(config, "quantization_config", None)
    if qc is not None:  # what from_pretrained reads (absent in directories encoded before it existed)
        quantconfig.check_directory(quantconfig.check(qc if isinstance(qc, dict) else qc.to_dict()), path)
    models.check_tokenizer_files(path)
    check_model_fit(path, config, index)
    by_shard: dict[str, list[str]] = {}
    for name, shard in index["weight_map"].items():
        by_shard.setdefault(shard, []).append(name)
    total = len(index["shards"]) + len(index["layers"])
    done = 0
    headers = {}
    nbytes = 0
    for shard, info in index["shards"].items():
        headers[shard] = _check_shard(path, shard, info, by_shard.get(shard, []), index)
        nbytes += info["bytes"]
        done += 1
        if progress:
            progress("verifying", done, total, item=shard)
    shard_of = index["weight_map"].__getitem__
    for module, info in index["layers"].items():
        if info.get("packed"):
            names = {f: f"{module}{sh.TCABME_INFIX}{f}" for f in tcabme.FIELDS}
            for f, name in names.items():
                entry = headers[shard_of(name)][name]
                if entry["dtype"] not in _DTYPES[f]:
                    raise _bad(shard_of(name), name, f"dtype {entry['dtype']}, expected {'/'.join(_DTYPES[f])}")
            tensors = _load(path, names.values(), shard_of)
            p = tcabme.TcaBme.from_tensors(tensors, module) if tensors[names["shape"]].numel() == 2 else None
            if p is None:
                raise _bad(shard_of(names["shape"]), names["shape"], "is not 2 integers")
            if list(p.shape) != list(info.get("shape", p.shape)):
                raise _bad(shard_of(names["shape"]), names["shape"],
                           f"says {list(p.shape)}, the index says {info.get('shape')}")
            check_structure(p, module, shard_of)
        else:
            key = info.get("weight", f"{module}.weight")
            if key not in index["weight_map"]:
                raise SparsekitError(f"{sh.INDEX_NAME}: index entry for dense weight {key} is missing: re-run `sparsekit encode`")
        done += 1
        if progress:
            progress("verifying", done, total, item=module)
    return {"ok": True, "path": str(path), "format": tcabme.FORMAT_NAME,
            "format_version": tcabme.FORMAT_VERSION, "shards": len(index["shards"]),
            "tensors": len(index["weight_map"]), "layers": len(index["layers"]),
            "packed_layers": sum(1 for i in index["layers"].values() if i.get("packed")), "bytes": nbytes,
            "from_pretrained": qc is not None}


def _load(path: Path, names, shard_of) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for name in names:
        shard = shard_of(name)
        try:
            with safe_open(str(path / shard), framework="pt", device="cpu") as f:
                out[name] = f.get_tensor(name)
        except Exception as e:
            raise _bad(shard, name, f"cannot be read ({e})") from None
    return out


def inspect_packed(path: str | os.PathLike) -> dict[str, Any]:
    """Per linear layer: shape, sparsity, dense bytes, stored bytes, ratio; plus totals. Reads the
    index and the shard headers only: no checksum is checked (``checksums_verified`` is False)."""
    path = Path(path)
    index = sh.load_index(path)
    sizes: dict[str, int] = {}
    for shard in index["shards"]:
        header, _ = sh.read_header(path / shard)
        sizes.update({k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"})
    rows = []
    for module, info in index["layers"].items():
        if info.get("packed"):
            stored = sum(sizes.get(f"{module}{sh.TCABME_INFIX}{f}", 0) for f in tcabme.FIELDS)
        else:
            stored = sizes.get(info.get("weight", f"{module}.weight"), info.get("dense_bytes", 0))
        dense = info.get("dense_bytes", 0)
        rows.append({"layer": module, "shape": info.get("shape"), "sparsity": info.get("sparsity"),
                     "pattern": info.get("pattern"), "packed": bool(info.get("packed")),
                     "dense_bytes": dense, "packed_bytes": stored,
                     "ratio": stored / dense if dense else None, "reason": info.get("reason")})
    rows.sort(key=lambda r: _natural(r["layer"]))
    dense_t = sum(r["dense_bytes"] for r in rows)
    stored_t = sum(r["packed_bytes"] for r in rows)
    numel = sum(r["shape"][0] * r["shape"][1] for r in rows if r["shape"])
    zeros = sum(r["sparsity"] * r["shape"][0] * r["shape"][1] for r in rows if r["shape"] and r["sparsity"] is not None)
    all_bytes = sum(sizes.values())
    other = all_bytes - sum(sizes.get(n, 0) for n in _linear_tensor_names(index))
    return {
        "path": str(path),
        "metadata": index["metadata"],
        "checksums_verified": False,  # inspect reads headers only: `sparsekit verify` checks the bytes
        "layers": rows,
        "totals": {
            "layers": len(rows),
            "packed_layers": sum(1 for r in rows if r["packed"]),
            "sparsity": zeros / numel if numel else None,
            "dense_bytes": dense_t,
            "packed_bytes": stored_t,
            "ratio": stored_t / dense_t if dense_t else None,
            "other_bytes": other,
            "checkpoint_bytes": all_bytes,
            "shards": len(index["shards"]),
        },
    }


def _natural(name: str) -> list:
    """Sort key putting layers.2 before layers.10."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def _linear_tensor_names(index: dict) -> list[str]:
    out = []
    for module, info in index["layers"].items():
        if info.get("packed"):
            out += [f"{module}{sh.TCABME_INFIX}{f}" for f in tcabme.FIELDS]
        else:
            out.append(info.get("weight", f"{module}.weight"))
    return out
