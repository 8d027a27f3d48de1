"""Atomic directory output: build into a temporary sibling, then rename into place."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from sparsekit.errors import SparsekitError


def check_output_dir(out: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an existing output unless ``overwrite``; call before any expensive work."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise SparsekitError(f"output {out} already exists: choose another path or pass --overwrite")
    return out


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to ``out``; on success it replaces ``out``.

    On any exception the temporary directory is removed and ``out`` is left untouched.
    """
    out = check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the output should look like any mkdir
    try:
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
