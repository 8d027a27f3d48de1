"""Run from the root of sparsekit's source tree (``python -m scripts...``, pytest, a notebook there), the
folders that become ``sparsekit.kernels``, ``sparsekit.cli`` and ``sparsekit.recipes`` are also importable under
their bare names, and transformers, which probes at import for the Hub's ``kernels`` package, takes sparsekit's
``kernels/`` folder for it: it then maps every file of every installed distribution, finds no version, and imports
the folder a second time as a top-level ``kernels`` (on the GPU image, 2.1 s of a profiled ``generate`` in
session 20). :func:`hide_bare_folders` makes the tree root's path entry blind to those three names, so each
resolves from the other entries of ``sys.path`` (the Hub's ``kernels`` where installed) or not at all. An installed
sparsekit (no source tree around it) is left as it is.
"""
from __future__ import annotations

import importlib.machinery
import os
import sys
from pathlib import Path

BARE = ("kernels", "cli", "recipes")   # the package-dir mappings of pyproject.toml


class _TreeRootFinder(importlib.machinery.FileFinder):
    """The tree root's path-entry finder, without the bare names of the mapped folders."""

    def find_spec(self, fullname, target=None):
        if fullname in BARE:
            return None
        return super().find_spec(fullname, target)


def hide_bare_folders() -> None:
    """Make every ``sys.path`` entry that is the source tree's root blind to BARE (idempotent)."""
    root = Path(__file__).resolve().parent.parent
    if not ((root / "pyproject.toml").is_file() and (root / "kernels" / "__init__.py").is_file()):
        return
    for entry in list(sys.path):
        try:
            if Path(entry or ".").resolve() != root:
                continue
        except (OSError, TypeError):
            continue
        for key in (entry, os.getcwd()) if entry in ("", ".") else (entry,):   # "" is cached as the cwd
            finder = sys.path_importer_cache.get(key)
            if finder is None:
                for hook in sys.path_hooks:
                    try:
                        finder = hook(key)
                        break
                    except ImportError:
                        continue
            if type(finder) is importlib.machinery.FileFinder:
                finder.__class__ = _TreeRootFinder
                sys.path_importer_cache[key] = finder
