"""What makes a folder provably sparsekit's: the markers it writes, and the record of the files it wrote.

- ``.sparsekit-staging`` (``STAGING_MARKER``): written first into every temp folder a run stages its
  output in, ``{"pid", "output"}``: the run and the output name the folder is for. The sweep of a
  killed run's leftovers (``sparsekit.host.leftovers``) removes a temp folder only with it inside.
- ``.sparsekit-output`` (``OUTPUT_MARKER``): written into every finished output just before it is
  renamed into place, ``{"written_by", "files"}``: the command, and every file of the output (relative
  paths, the marker included). ``--overwrite`` replaces an output only when every file in it is listed
  there, unless told to delete the others too (``foreign_files``).

Outputs of earlier versions have no list: their files are judged by name (``KNOWN_NAMES``).
"""
from __future__ import annotations

import json
import os
import shutil
from fnmatch import fnmatch
from pathlib import Path

STAGING_MARKER = ".sparsekit-staging"
OUTPUT_MARKER = ".sparsekit-output"
OUTPUT_MARKERS = ("sparsekit.json", "tcabme.index.json", OUTPUT_MARKER)
# what an output of an earlier version (no list of files) may hold: weights, indexes, config, tokenizer
KNOWN_NAMES = ("*.safetensors", "*.safetensors.index.json", "tcabme.index.json", "sparsekit.json", "config.json",
               "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
               "merges.txt", "chat_template.*", "*.model", "*.tiktoken", "tekken.json", OUTPUT_MARKER)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def mark_staging(folder: Path, output: str) -> None:
    """The first file of a temp folder: this run (PID) stages output ``output`` here."""
    (folder / STAGING_MARKER).write_text(json.dumps({"pid": os.getpid(), "output": output}) + "\n")


def staged_by(folder: Path) -> tuple[int | None, str | None]:
    """``(pid, output name)`` from a temp folder's staging marker; ``(None, None)`` without one."""
    data = _read(folder / STAGING_MARKER)
    pid, name = data.get("pid"), data.get("output")
    return (pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
            name if isinstance(name, str) else None)


def files_under(folder: Path) -> list[str]:
    """Every file (and link) below ``folder``, as sorted relative paths with ``/``."""
    out = []
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder)
        out += [(rel / f).as_posix() for f in files]
        out += [(rel / d).as_posix() for d in dirs if (Path(root) / d).is_symlink()]
    return sorted(out)


def record_output(folder: Path, command: str) -> None:
    """Finish a staged output: write the output marker listing every file, then drop the staging marker."""
    files = sorted({*(f for f in files_under(folder) if f != STAGING_MARKER), OUTPUT_MARKER})
    (folder / OUTPUT_MARKER).write_text(json.dumps({"written_by": command, "files": files}, indent=1) + "\n")
    (folder / STAGING_MARKER).unlink(missing_ok=True)


def written_files(output: Path) -> list[str] | None:
    """The files the output marker lists (None for an output without that list: an earlier version's)."""
    files = _read(Path(output) / OUTPUT_MARKER).get("files")
    if isinstance(files, list) and all(isinstance(f, str) for f in files):
        return files
    return None


def is_output(folder: Path) -> bool:
    """A directory with a sparsekit output's marks (``OUTPUT_MARKERS``)."""
    return any((folder / m).is_file() for m in OUTPUT_MARKERS)


def foreign_files(output: Path) -> list[str]:
    """The files in a sparsekit output that sparsekit did not write (sorted relative paths)."""
    output = Path(output)
    on_disk = files_under(output)
    listed = written_files(output)
    if listed is not None:
        return [f for f in on_disk if f not in set(listed)]
    return [f for f in on_disk if "/" in f or not any(fnmatch(f, p) for p in KNOWN_NAMES)]


def remove_ours(folder: Path) -> None:
    """Delete a folder of ours with its markers last, so that a kill half-way leaves one the next run
    still recognizes (and removes)."""
    markers = (STAGING_MARKER, *OUTPUT_MARKERS)
    for entry in list(os.scandir(folder)):
        if entry.name in markers:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    for name in markers:
        try:
            os.unlink(folder / name)
        except FileNotFoundError:
            pass
    os.rmdir(folder)
