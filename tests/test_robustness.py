"""Issue 15 (parts 2 and 6): verify checks loadability, precise loader messages, and small fixes.

Each test here failed before its fix.
"""
from __future__ import annotations

import os
import stat
import shutil
from pathlib import Path

import pytest

from sparsekit.errors import SparsekitError

from tiny_models import save_tiny, write_corpus


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny Llama, its magnitude-pruned checkpoint and that checkpoint packed."""
    from sparsekit.packed.encoding import encode
    from sparsekit.pruning.api import prune

    d = tmp_path_factory.mktemp("robust")
    save_tiny("llama", d / "base")
    write_corpus(d / "calib.txt")
    prune(str(d / "base"), method="magnitude", output=str(d / "pruned"), device="cpu", warn=lambda m: None)
    encode(d / "pruned", d / "packed")
    return d


def _copy(dirs: Path, name: str, src: str = "packed") -> Path:
    out = dirs / name
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(dirs / src, out)
    return out


# ----------------------------------------------------------------------------- file modes
def test_pruned_files_follow_the_umask(dirs, tmp_path):
    """model.safetensors was written 0600 while every other file was 0644."""
    from sparsekit.hf.filemode import umask

    want = 0o666 & ~umask()
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (dirs / "pruned").iterdir()}
    assert "model.safetensors" in modes
    assert modes == {name: want for name in modes}
