"""How many bytes ``encode`` and ``export-bitmask`` will write, known before they read a weight: the
figure of their start-up space check.

A linear weight's stored size follows from its shape and its zeros, which the pruner records in
``sparsekit.json`` (``layers``: sparsity per module) and a packed index per layer. Every other tensor
is stored as it is (its size is in the safetensors header). A weight whose zeros are not recorded
counts at its dense size, an upper bound. Each stored tensor adds its entry in the shard's header
(``HEADER_BYTES``) and, packed, in ``tcabme.index.json`` (``INDEX_BYTES``); the copied side files
(config, tokenizer, ...) count at their size. For sparsekit's own outputs the figure is within a few
percent of what is written (the dense size, used before, was 1.5x it at 50% sparsity).
"""
from __future__ import annotations

import math

from sparsekit.packed.gain import PACK_MARGIN
from sparsekit.packed.tcabme import ALIGN, BT_PER_GT, FIELDS, GROUP

ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
HEADER_BYTES = 100   # a tensor's entry in a safetensors header (name, dtype, shape, offsets)
INDEX_BYTES = 300    # a packed tensor's entries in tcabme.index.json (weight map, sha256, its layer's info)


def tcabme_nbytes(shape: tuple[int, int], sparsity: float, itemsize: int = 2) -> int:
    """The expected bytes of a TCA-BME weight ``[out, in]`` with this fraction of zeros (each 64x64
    tile's values are padded to a multiple of 8: half of that on average)."""
    m, k = shape
    ngt = math.ceil(m / GROUP) * math.ceil(k / GROUP)
    values = round((1.0 - sparsity) * m * k + ngt * (ALIGN - 1) / 2)
    return ngt * BT_PER_GT * 8 + values * itemsize + (ngt + 1) * 4 + ngt * 4 * 4 + 16


def bitmask_nbytes(shape: tuple[int, int], sparsity: float, itemsize: int) -> int:
    """The bytes of a compressed-tensors sparse-bitmask weight ``[rows, cols]`` (values, bits, row offsets,
    shape, and their four header entries)."""
    rows, cols = shape
    return (round((1.0 - sparsity) * rows * cols) * itemsize + rows * math.ceil(cols / 8) + rows * 8 + 16
            + 4 * HEADER_BYTES)


def files_nbytes(files) -> int:
    """The bytes of files copied as they are."""
    return sum(f.stat().st_size for f in files)


def packed_layer_nbytes(shape: tuple[int, int], sparsity: float | None, *, min_sparsity: float | None = None,
                        force: bool = False, itemsize: int = 2) -> int:
    """What ``encode`` writes for one linear weight, packed or dense by its rule (``encode``'s arguments
    of the same names; dense when the sparsity is unknown), with its header and index entries."""
    dense = shape[0] * shape[1] * itemsize + HEADER_BYTES + INDEX_BYTES
    if sparsity is None:
        return dense
    packed = tcabme_nbytes(shape, sparsity, itemsize) + len(FIELDS) * (HEADER_BYTES + INDEX_BYTES)
    if force or (sparsity >= min_sparsity if min_sparsity is not None else packed <= (1 - PACK_MARGIN) * dense):
        return packed
    return dense


def recorded_sparsity(info) -> float | None:
    """A layer entry's recorded sparsity (``sparsekit.json`` or a packed index), None without one."""
    value = info.get("sparsity") if isinstance(info, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        return None
    return float(value)


def encoded_nbytes(headers: dict[str, tuple[str, list[int]]], linears: dict[str, tuple[bool, float | None]],
                   cast: bool, *, min_sparsity: float | None = None, force: bool = False) -> int:
    """What ``encode`` writes for the tensors of a checkpoint: ``headers`` (name -> safetensors dtype,
    shape), ``linears`` (the linear weights' names -> (stored transposed, recorded sparsity)); ``cast``:
    float32 becomes 16-bit."""
    total = 0
    for name, (dtype, shape) in headers.items():
        item = 2 if cast and dtype == "F32" else ITEM_BYTES.get(dtype, 4)
        if name in linears:
            transposed, sparsity = linears[name]
            out_in = (shape[1], shape[0]) if transposed else (shape[0], shape[1])
            total += packed_layer_nbytes(out_in, sparsity, min_sparsity=min_sparsity, force=force, itemsize=item)
        else:
            total += math.prod(shape) * item + HEADER_BYTES + INDEX_BYTES
    return total
