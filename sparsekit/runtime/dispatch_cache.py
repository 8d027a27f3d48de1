"""The dispatch plan's timings, kept on disk per GPU, software and layer shape, so a model loads in
seconds the second time (``runtime.dispatch`` measures each group of sparse layers against cuBLAS,
which compiles kernel variants and times them: seconds per shape).

One JSON file per (GPU name, multiprocessor count, torch version, numba version, sparsekit version,
hash of the bundled kernels' sources) under ``$SPARSEKIT_CACHE/dispatch/``; inside it, the timing rows
of each (shape, sparsity bucket, bias, token counts) key. A change of kernel code, library or GPU
therefore never reuses old timings. Written atomically (a temporary file, then a rename); a damaged
or foreign file counts as empty and is rewritten. Deleting the folder makes the next load measure again.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from sparsekit.hf.models import cache_root
from sparsekit.host.atomic import replace_file

VERSION = 1


def kernels_hash() -> str:
    """A short hash of the bundled kernels' sources (a changed kernel never reuses a cached result)."""
    from sparsekit.kernels import kcache

    return kcache.source_hash()


def cache_file(device: torch.device) -> Path:
    """The cache file of this GPU and software, and of the TCA-BME kernel choice (``SPARSEKIT_KERNEL``: the
    timings of one kernel never decide for another)."""
    import numba

    from sparsekit import __version__
    from sparsekit.kernels.matmul import kernel_choice

    props = torch.cuda.get_device_properties(device)
    ident = json.dumps([VERSION, props.name, props.multi_processor_count, torch.__version__, numba.__version__,
                        __version__, kernels_hash(), kernel_choice()])
    return cache_root() / "dispatch" / f"{hashlib.sha256(ident.encode()).hexdigest()[:20]}.json"


def entry_key(shape, sparsity: float, bias: bool, counts) -> str:
    return f"{shape[0]}x{shape[1]}|s{sparsity}|b{int(bias)}|n{','.join(str(n) for n in counts)}"


def read(path: Path) -> dict:
    """The cached entries of ``path`` (empty when it is missing, damaged or of another layout)."""
    return load(path)[0]


def load(path: Path) -> tuple[dict, str | None]:
    """``(entries, problem)``: the cached entries of ``path``, and why the file could not be used when it
    exists but is damaged or of another layout (``entries`` is then empty); a missing file is no problem."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):  # no file there (yet)
        return {}, None
    except (OSError, ValueError) as e:
        return {}, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries"), dict):
        return {}, "not a cache file of this sparsekit"
    return data["entries"], None


def write(path: Path, entries: dict) -> str | None:
    """Replace ``path`` with ``entries``, atomically. Returns why it could not (the caller reports it:
    the plan is still right, only the next load measures again), else None."""
    try:
        replace_file(path, json.dumps({"version": VERSION, "entries": entries}).encode())
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"
