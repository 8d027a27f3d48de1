"""``sparsekit encode`` (``encode_checkpoint``): a pruned HF checkpoint directory (dense weights with
zeros) -> a TCA-BME directory. ``tcabme.encode`` packs one tensor.

Which tensors are linear weights comes from ``sparsekit.json`` ("layers") when the pruner wrote
one, else from the model skeleton built on the meta device from ``config.json``. Each linear
weight (GPT-2 ``Conv1D`` transposed to ``[out, in]``) is packed when it is sparse enough, else
kept dense with the reason recorded. Everything else is stored as it is. The copied ``config.json``
gains the ``quantization_config`` that hands the directory to sparsekit in transformers'
``from_pretrained`` (``sparsekit.packed.quantconfig``), and a model card (``README.md``) is written
unless the source holds a README of the user's, which is copied instead.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from sparsekit.hf import modelcard
from sparsekit.host.atomic import atomic_output_dir, check_output_dir
from sparsekit.errors import SparsekitError
from sparsekit.hf.metadata import PruneMetadata
from sparsekit.packed.sp24 import tile_census
from sparsekit.host.jsonfile import read_json_object
from sparsekit.progress import Progress
from sparsekit.packed import shards as sh
from sparsekit.packed import quantconfig, tcabme
from sparsekit.packed.estimate import encoded_nbytes, files_nbytes, recorded_sparsity
from sparsekit.pruning.methods.cats import thresholds_from_metadata


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", sh.INDEX_NAME)
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


# --------------------------------------------------------------------------------------------
# Reading a source checkpoint


def checkpoint_files(src: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, for a single-file or sharded HF checkpoint."""
    if not src.is_dir():
        raise SparsekitError(f"no checkpoint directory at {src}: pass the output directory of `sparsekit prune`")
    if sh.is_packed_dir(src):
        raise SparsekitError(f"{src} is already a TCA-BME checkpoint: pass the pruned (dense) checkpoint instead")
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        out = {name: src / file for name, file in weight_map.items()}
        for file in set(out.values()):
            if not file.is_file():
                raise SparsekitError(f"shard {file.name} listed in {index.name} is missing from {src}")
        return out
    files = sorted(src.glob("*.safetensors"))
    if not files:
        if any(src.glob("*.bin")):
            raise SparsekitError(
                f"{src} holds only PyTorch .bin weights: re-save it with save_pretrained(..., safe_serialization=True)"
            )
        raise SparsekitError(f"no safetensors weights in {src}: pass an HF checkpoint directory")
    from safetensors import safe_open

    out = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                out.update({k: file for k in f.keys()})
        except Exception as e:
            raise SparsekitError(f"cannot read {file} ({e}): the checkpoint is corrupt") from None
    return out


def header_info(files: dict[str, Path]) -> dict[str, tuple[str, list[int]]]:
    """tensor name -> (safetensors dtype string, shape), from the headers only."""
    info = {}
    for file in sorted(set(files.values())):
        header, _ = sh.read_header(file, fix="the input checkpoint is damaged; re-create it")
        info.update({k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return info


def load_json(path: Path) -> dict[str, Any]:
    """A JSON object file as a dict ({} when absent); anything else is one line naming the file."""
    return read_json_object(path) if path.is_file() else {}


def refuse_bitmask_source(src: Path, config: dict) -> None:
    """A compressed-tensors sparse-bitmask checkpoint has no dense weights to read: say what to run."""
    qc = config.get("quantization_config") or config.get("compression_config") or {}
    if isinstance(qc, dict) and (qc.get("sparsity_config") or {}).get("format") == "sparse-bitmask":
        raise SparsekitError(f"{src} is a compressed-tensors sparse-bitmask checkpoint: run "
                             f"`sparsekit import-bitmask {src} -o DIR` first and pass DIR")


def check_loadable_source(src: Path) -> None:
    """What ``sparsekit verify`` asks of the output, asked of the source before any work: a config.json
    transformers reads, and tokenizer files (both are copied over)."""
    from sparsekit.hf.models import check_tokenizer_files, read_config

    fix = "copy {} of the source model into it (the packed checkpoint would not load without it)"
    read_config(src, fix=fix.format("config.json"))
    check_tokenizer_files(src, fix=fix.format("the tokenizer files"))


def linear_modules(src: Path, config: dict, layers: dict) -> dict[str, bool]:
    """module name -> transposed (True for GPT-2 Conv1D, stored [in, out]): the pruned ``layers`` that
    ``sparsekit.json`` records, else the linears of the model ``config`` describes."""
    if isinstance(layers, dict) and layers:
        return {name: info.get("kind") == "conv1d" for name, info in layers.items()}
    if not config:
        raise SparsekitError(f"{src} has neither sparsekit.json nor config.json: cannot tell which tensors are linear layers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from sparsekit.hf.modules import Conv1D, find_decoder_layers, find_linears

    try:
        cfg = AutoConfig.from_pretrained(str(src))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as e:
        raise SparsekitError(f"cannot build the model described by {src}/config.json ({e}): is it a causal LM?") from None
    prefix, blocks = find_decoder_layers(model)
    return {name: bool(Conv1D) and isinstance(mod, Conv1D) for name, mod in find_linears(blocks, prefix=prefix).items()}


def resolve_key(module: str, names: set[str] | dict) -> str | None:
    """The checkpoint tensor holding ``module``'s weight (also without a base-model prefix)."""
    key = f"{module}.weight"
    if key in names:
        return key
    parts = module.split(".")
    for i in range(1, len(parts)):
        k = ".".join(parts[i:]) + ".weight"
        if k in names:
            return k
    ends = [n for n in names if n.endswith("." + key)]
    return ends[0] if len(ends) == 1 else None


def target_dtype(config: dict) -> torch.dtype:
    name = str(config.get("torch_dtype") or config.get("dtype") or "")
    return torch.bfloat16 if "bfloat16" in name else torch.float16


def detect_pattern(raw) -> str:
    """A label for a weight's sparsity pattern: "dense", "2:4" (along the input dim) or "unstructured".

    ``raw`` is the [out, in] weight's 16-bit patterns as a numpy array.
    """
    nonzero = raw != 0
    if bool(nonzero.all()):
        return "dense"
    if raw.shape[1] % 4 == 0:
        groups = np.ascontiguousarray(nonzero).view(np.uint32)   # 4 bools (0/1 bytes) per group
        per_group = np.bitwise_count(groups) if hasattr(np, "bitwise_count") else nonzero.reshape(-1, 4).sum(-1)
        if int(per_group.max()) <= 2:
            return "2:4"
    return "unstructured"


def side_files(src: Path) -> list[Path]:
    """Config, generation config, tokenizer files, sparsekit.json, a README of the user's...: everything
    but weights, dot files and sparsekit's model card (which describes ``src``, not a copy)."""
    card = modelcard.is_card(src)
    return [f for f in sorted(src.iterdir()) if f.is_file() and f.name not in WEIGHT_INDEXES
            and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.startswith(".")
            and not (card and f.name == modelcard.CARD_NAME)]


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy ``side_files(src)`` into ``dst``; their names."""
    for f in side_files(src):
        shutil.copy2(f, dst / f.name)
    return [f.name for f in side_files(src)]


# --------------------------------------------------------------------------------------------
# Encoding


def encode_checkpoint(
    pruned_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    min_sparsity: float | None = None,
    force: bool = False,
    max_shard_size: int | str = "2GB",
    overwrite: bool = False,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
    delete_extra: bool = False,
) -> dict[str, Any]:
    """Pack ``pruned_dir`` into ``out_dir`` (atomic). Returns a report (per-layer info and totals).

    ``progress("encoding", done, total, item=tensor_name)`` is called after each source tensor when given.
    ``min_sparsity`` None (the default) packs each linear when packing gains bytes for its pattern
    (``sparsekit.packed.gain.worth_packing``); a number packs those with at least that fraction of zeros.
    ``max_shard_size`` is bytes or a string such as "2GB" / "500MB" / "1GiB". The output is locked,
    checked and written as ``sparsekit.host.atomic`` describes; ``warn`` (default: stderr) hears about
    leftovers of killed runs that were cleaned up; ``delete_extra`` lets ``overwrite`` delete files in
    the old output that sparsekit did not write (refused otherwise).
    """
    t0 = time.perf_counter()
    src, out = Path(pruned_dir), Path(out_dir)
    if min_sparsity is not None and not 0.0 <= float(min_sparsity) <= 1.0:
        raise SparsekitError(f"--min-sparsity must be between 0 and 1, got {min_sparsity}")
    max_bytes = sh.parse_size(max_shard_size)
    if not src.exists():
        raise SparsekitError(f"no pruned checkpoint at {src}: pass the output directory of `sparsekit prune`")
    if out.resolve() == src.resolve():
        raise SparsekitError("the output directory must differ from the input: pass another -o")
    check_output_dir(out, overwrite, [src], delete_extra)

    files = checkpoint_files(src)
    headers = header_info(files)
    config = load_json(src / "config.json")
    refuse_bitmask_source(src, config)
    check_loadable_source(src)
    recorded = PruneMetadata.read(src)
    meta = recorded or PruneMetadata()
    manifest = recorded.to_dict() if recorded else {}   # what sparsekit.json says, for the card
    modules = linear_modules(src, config, meta.layers)

    # Validate every linear weight from the headers before any heavy work.
    weight_keys: dict[str, tuple[str, bool]] = {}   # checkpoint key -> (module name, transposed)
    recorded: dict[str, float | None] = {}          # checkpoint key -> the sparsity sparsekit.json records
    for module, transposed in modules.items():
        key = resolve_key(module, headers)
        if key is None:
            raise SparsekitError(f"linear layer {module} has no weight tensor in {src}: the checkpoint does not match its config")
        dtype, shape = headers[key]
        if len(shape) != 2:
            raise SparsekitError(f"weight {key} has shape {shape}: TCA-BME packs 2-D linear weights only")
        if dtype not in ("F16", "BF16", "F32"):
            raise SparsekitError(
                f"weight {key} has unsupported dtype {dtype}: sparsekit encode reads float16, bfloat16 or float32 checkpoints"
            )
        weight_keys[key] = (key[: -len(".weight")], transposed)
        recorded[key] = recorded_sparsity(meta.layer(module))
    cast_to = target_dtype(config)
    cast = any(headers[k][0] == "F32" for k in weight_keys)

    from safetensors import safe_open

    file_meta = {"format": tcabme.FORMAT_NAME, "format_version": str(tcabme.FORMAT_VERSION)}
    layers: dict[str, dict[str, Any]] = {}
    names = list(files)
    estimate = files_nbytes(side_files(src)) + encoded_nbytes(   # what will be written
        headers, {k: (t, recorded[k]) for k, (_, t) in weight_keys.items()}, cast, min_sparsity=min_sparsity, force=force)
    with atomic_output_dir(out, overwrite=overwrite, sources=[src], estimate=estimate, warn=warn,
                           delete_extra=delete_extra) as tmp:
        writer = sh.ShardWriter(tmp, max_bytes, file_metadata=file_meta)
        done = 0
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(files[n], []).append(n)
        for file, keys in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in keys:
                    t = f.get_tensor(key)
                    if cast and t.dtype == torch.float32:
                        c = t.to(cast_to)
                        if bool((torch.isinf(c) & torch.isfinite(t)).any()):
                            raise SparsekitError(
                                f"tensor {key} in {file.name} has values beyond the {DTYPE_NAMES[cast_to]} range: "
                                "casting the float32 checkpoint would turn them into inf; set \"torch_dtype\": "
                                "\"bfloat16\" in its config.json to pack it as bfloat16")
                        t = c
                    if key in weight_keys:
                        module, transposed = weight_keys[key]
                        info, tensors = _encode_layer(module, t, transposed, min_sparsity, force, meta)
                        if not info["packed"]:
                            info["weight"] = key
                        layers[module] = info
                        writer.add(tensors if info["packed"] else {key: t})
                    else:
                        writer.add({key: t})
                    done += 1
                    if progress:
                        progress("encoding", done, len(names), item=key)
        weight_map, shard_info = writer.close()
        copied = copy_side_files(src, tmp)
        quantconfig.write(tmp, layers, cats=bool(thresholds_from_metadata(manifest)))
        dense_b = sum(i["dense_bytes"] for i in layers.values())
        stored_b = sum(i["stored_bytes"] for i in layers.values())
        metadata = {
            "format": tcabme.FORMAT_NAME,
            "format_version": tcabme.FORMAT_VERSION,
            "sparsekit_version": _version(),
            "source_model": meta.model or config.get("_name_or_path") or str(src),
            "source_dir": str(src),
            "method": meta.method,
            "pattern": meta.pattern,
            "dtype": DTYPE_NAMES.get(cast_to if cast else _first_dtype(layers), "float16"),
            "cast_from": "float32" if cast else None,
            "min_sparsity": None if min_sparsity is None else float(min_sparsity),
            "force": bool(force),
            "max_shard_size": max_bytes,
            "total_size": writer.total_bytes,
            "linear_dense_bytes": dense_b,
            "linear_stored_bytes": stored_b,
        }
        index = {"metadata": metadata, "layers": layers, "weight_map": weight_map,
                 "shards": shard_info, "checksums": writer.checksums}
        (tmp / sh.INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        modelcard.keep_user_readme(out, tmp)
        card = {"model": metadata["source_model"], "method": metadata["method"], "pattern": metadata["pattern"],
                **manifest}
        modelcard.write_card(tmp, modelcard.render(card, packed=metadata, size_bytes=writer.total_bytes))
    elapsed = time.perf_counter() - t0
    n_packed = sum(1 for i in layers.values() if i["packed"])
    return {
        "output": str(out),
        "source": str(src),
        "layers": len(layers),
        "packed_layers": n_packed,
        "dense_layers": len(layers) - n_packed,
        "linear_dense_bytes": dense_b,
        "linear_stored_bytes": stored_b,
        "ratio": stored_b / dense_b if dense_b else None,
        "total_bytes": writer.total_bytes,
        "shards": len(shard_info),
        "cast_from": metadata["cast_from"],
        "dtype": metadata["dtype"],
        "copied_files": copied,
        "elapsed_s": round(elapsed, 3),
        "per_layer": layers,
    }


encode = encode_checkpoint   # the old name (beside tcabme.encode, which packs one tensor): kept for one release


def _encode_layer(module: str, t: torch.Tensor, transposed: bool, min_sparsity: float, force: bool,
                  meta: PruneMetadata) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    w = (t.t() if transposed else t).contiguous()
    # A pruner that masks by multiplying (w * mask) leaves -0.0 where w was negative. Those are
    # pruned weights, not values: store them as zeros (tcabme.encode itself keeps -0.0 bit-exact).
    negative_zero = w.view(torch.int16) == -32768          # 0x8000 is -0.0 in fp16 and bf16
    n_negative_zero = int(negative_zero.sum())
    if n_negative_zero:
        w = w.masked_fill(negative_zero, 0)
    raw = w.view(torch.int16).numpy()
    nnz = int(np.count_nonzero(raw))
    numel = w.numel()
    sparsity = 1.0 - nnz / numel if numel else 0.0
    dense_bytes = numel * w.element_size()
    info: dict[str, Any] = {
        "shape": [int(w.shape[0]), int(w.shape[1])],
        "transposed": bool(transposed),
        "dtype": DTYPE_NAMES[w.dtype],
        "sparsity": round(sparsity, 6),
        "pattern": _layer_pattern(meta, module) or detect_pattern(raw),
        "dense_bytes": dense_bytes,
    }
    if n_negative_zero:
        info["negative_zeros_cleared"] = n_negative_zero
    if min_sparsity is None:  # by what packing gains for this layer (sparsekit.packed.gain)
        from sparsekit.packed.gain import worth_packing

        gains, _, why = worth_packing(w, info["pattern"])
    else:
        gains = sparsity >= min_sparsity
        why = (f"sparsity {sparsity:.1%} >= min-sparsity {min_sparsity:.0%}" if gains else
               f"sparsity {sparsity:.1%} < min-sparsity {min_sparsity:.0%}: too dense to gain; kept dense (--force packs it anyway)")
    if not gains and not force:
        info.update(packed=False, stored_bytes=dense_bytes, reason=why)
        return info, {}
    packed = tcabme.encode(w)
    info.update(packed=True, stored_bytes=packed.nbytes, nnz=nnz, reason=why if gains else "forced (--force)")
    info["tiles"] = tile_census(w)   # which 64x64 tiles are 2:4 / dense / neither: the loader's 2:4 choice
    return info, packed.tensors(module)


def _layer_pattern(meta: PruneMetadata, module: str) -> str | None:
    """The pattern the pruner recorded for this layer (its own entry first, then the run's)."""
    entry = meta.layer(module)
    info = entry.get("info") if isinstance(entry.get("info"), dict) else {}
    return entry.get("pattern") or info.get("pattern") or meta.pattern


def _first_dtype(layers: dict) -> torch.dtype:
    for info in layers.values():
        return torch.bfloat16 if info["dtype"] == "bfloat16" else torch.float16
    return torch.float16


def _version() -> str:
    from sparsekit import __version__

    return __version__
