"""Compiled kernels kept on disk, so a new process launches them without numba compiling them again.

numba compiles each kernel variant at its first launch in every process: 2-6 s per variant on an
H100, most of what a packed ``sparsekit generate`` spends before its first token. numba's own
``cache=True`` cannot help: its cache key hashes a pickle of the kernel's closure, which holds our
device functions, and that pickle differs from one process to the next (checked on numba-cuda
0.30.4), so every lookup would miss.

So the launcher keeps the cubin itself. A kernel factory ``tag``s each kernel with its name and build
key; after numba's first launch of a tagged kernel (and once the direct launch has checked numba's
argument packing, see ``compat_numba.fast_entry``) the launcher ``save``s its cubin under
``$SPARSEKIT_CACHE/kernels/``. The file's name hashes everything the machine code depends on: the
tag, the module's constants, the argument types, the GPU's compute capability, numba's and
numba-cuda's versions, the ``NUMBA_*`` settings and the bundled kernels' sources. A later process
``load``s it and launches it directly (cuda.core), never calling numba. Written atomically; a damaged
file is said once and compiled again. ``SPARSEKIT_KERNEL_CACHE=0`` turns the cache off (numba compiles
every variant, as before).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path

VERSION = 1
_TAG = "_sparsekit_tag"


def tag(kern, name: str, key) -> object:
    """Mark ``kern`` (a numba CUDA dispatcher) as built by ``name`` from ``key``; returns ``kern``.
    The key, together with the integer, float, bool and string constants of the kernel's module at
    this moment, must determine the kernel's code."""
    py_func = getattr(kern, "py_func", None)
    mod = sys.modules.get(py_func.__module__) if py_func is not None else None
    consts = sorted((k, v) for k, v in vars(mod).items()
                    if k.isupper() and isinstance(v, (bool, int, float, str))) if mod else []
    try:
        setattr(kern, _TAG, json.dumps([name, repr(key), consts]))
    except AttributeError:   # not a dispatcher we can mark: it is simply not cached
        pass
    return kern


def tag_of(kern) -> str | None:
    """What ``tag`` recorded on ``kern`` (None: untagged, never cached)."""
    return getattr(kern, _TAG, None)


def enabled() -> bool:
    """``SPARSEKIT_KERNEL_CACHE``: on unless ``0`` (``1`` or empty: on; anything else one error line)."""
    from sparsekit.errors import SparsekitError

    raw = os.environ.get("SPARSEKIT_KERNEL_CACHE", "")
    if raw not in ("", "0", "1"):
        raise SparsekitError(f"SPARSEKIT_KERNEL_CACHE={raw!r}: set it to 0 (numba compiles every kernel in "
                             "every process) or 1 (keep compiled kernels on disk, the default)")
    if raw == "0":
        note("SPARSEKIT_KERNEL_CACHE=0: the on-disk kernel cache is off; numba compiles every kernel variant in "
             "every process")
    return raw != "0"


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """A short hash of the bundled kernels' sources (a changed kernel never reuses a cached result);
    computed once per process (``source_hash.cache_clear()`` forgets it)."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def arg_signature(args) -> list:
    """How numba types ``args``: arrays by dtype and dimensions, the rest as int64 scalars."""
    return [f"{str(a.dtype).removeprefix('torch.')}[{a.ndim}]" if hasattr(a, "dtype") and hasattr(a, "ndim")
            else "i8" for a in args]


def key_of(kern, args, cc) -> str | None:
    """The cache file stem of ``kern`` launched with ``args`` on a GPU of compute capability ``cc``;
    None for an untagged kernel."""
    t = tag_of(kern)
    if t is None:
        return None
    import numba

    try:
        import numba_cuda
        ncv = numba_cuda.__version__
    except ImportError:   # the CUDA target bundled with numba
        ncv = ""
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("NUMBA_"))
    ident = json.dumps([VERSION, t, arg_signature(args), list(cc), numba.__version__, ncv, env, source_hash()])
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


_said: set = set()


def note(msg: str) -> None:
    """One ``SparsekitWarning`` per message and process (the kernels still run: numba compiles them)."""
    import warnings

    from sparsekit.errors import SparsekitWarning

    if msg not in _said:
        _said.add(msg)
        warnings.warn(msg, SparsekitWarning, stacklevel=3)


def folder() -> Path:
    from sparsekit.hf.models import cache_root

    return cache_root() / "kernels"


def read(stem: str) -> tuple[bytes, str] | None:
    """``(cubin, entry name)`` stored under ``stem``, or None when there is none. A file that cannot
    be read as one raises ``ValueError`` (the caller says so once and compiles)."""
    base = folder() / stem
    try:
        meta = json.loads((base.parent / f"{stem}.json").read_text())
        data = base.with_suffix(".cubin").read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise ValueError(f"{type(e).__name__}: {e}") from e
    if not isinstance(meta, dict) or meta.get("version") != VERSION or not isinstance(meta.get("entry"), str):
        raise ValueError("not a kernel cache file of this sparsekit")
    if len(data) != meta.get("bytes") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise ValueError("its cubin does not match its record (damaged or half-written)")
    return data, meta["entry"]


def write(stem: str, cubin: bytes, entry: str) -> str | None:
    """Store ``cubin`` (and its entry name) under ``stem``, each file atomically; the record is written
    last and names the cubin's hash, so a reader never takes a half-written pair. Returns why it could
    not, else None."""
    from sparsekit.host.atomic import replace_file

    d = folder()
    meta = {"version": VERSION, "entry": entry, "bytes": len(cubin), "sha256": hashlib.sha256(cubin).hexdigest()}
    try:
        replace_file(d / f"{stem}.cubin", cubin)
        replace_file(d / f"{stem}.json", json.dumps(meta).encode())
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None
