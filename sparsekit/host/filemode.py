"""File modes of written outputs: what ``open()`` / ``mkdir`` give under the process umask.

Some writers create files 0600 (safetensors' ``save_file``) and ``tempfile.mkdtemp`` makes 0700
directories; an output should look like any other file the user writes (0644 / 0755 with the
usual umask 022). Call these where output files are finalized.
"""
from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """The process umask (read without changing it for good)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def public_file(path: str | os.PathLike) -> None:
    """Give a written file the mode a plain ``open(path, "w")`` would have given it."""
    os.chmod(path, 0o666 & ~umask())


def public_dir(path: str | os.PathLike) -> None:
    """Give a directory the mode a plain ``mkdir`` would have given it."""
    os.chmod(path, 0o777 & ~umask())


def public_tree(path: str | os.PathLike) -> None:
    """``public_dir`` on ``path`` and every folder below it, ``public_file`` on every file."""
    path = Path(path)
    public_dir(path)
    for root, dirs, files in os.walk(path):  # links are left alone (their targets are not ours)
        for d in dirs:
            if not (Path(root) / d).is_symlink():
                public_dir(Path(root) / d)
        for f in files:
            if not (Path(root) / f).is_symlink():
                public_file(Path(root) / f)
