"""The sweep of what killed runs left beside an output, touching only what is provably sparsekit's.

A run writing output ``DIR`` stages it in ``.DIR.tmp-<pid>-<random>`` and, under ``--overwrite``, moves
the previous output aside to ``.DIR.old-<pid>-<random>`` for the moment of the swap. A run killed with
SIGKILL (or a power cut) leaves them behind. The next run that locks ``DIR`` removes such a folder
only when all of these hold:

- it is a directory (not a file, not a link) named for ``DIR`` in exactly that form;
- its PID is gone (``pid_alive``);
- it carries sparsekit's marks: a temp folder the staging marker naming that PID and ``DIR`` (or
  the finished output's marker), a moved-aside output the marks of a sparsekit output;
- the sweeping run holds the lock of ``DIR`` (``sparsekit.host.outlock``).

A moved-aside output is put back when ``DIR`` itself is missing (the kill fell between the two renames
of an ``--overwrite``). Anything else, whoever made it, is left alone.
"""
from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from sparsekit.errors import SparsekitError
from sparsekit.host.manifest import OUTPUT_MARKER, is_output, remove_ours, staged_by
from sparsekit.host.outlock import OutputLock, pid_alive

# ".NAME.tmp-<pid>-<random>" / ".NAME.old-<pid>-<random>" (tempfile.mkdtemp's suffix)
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-(?P<random>[A-Za-z0-9_]+)$")


def _size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def leftover_of(p: Path, name: str | None = None) -> tuple[str, str, int] | None:
    """``(output name, kind, pid)`` when ``p`` is a killed run's folder (see the module doc, all but the
    lock); ``name``: only one for that output. None for anything else."""
    m = _LEFTOVER.match(p.name)
    if not m or (name is not None and m["name"] != name):
        return None
    pid = int(m["pid"])
    if pid == os.getpid() or pid_alive(pid) or p.is_symlink() or not p.is_dir():
        return None
    if m["kind"] == "tmp":
        marked = staged_by(p) == (pid, m["name"]) or (p / OUTPUT_MARKER).is_file()
    else:
        marked = is_output(p)
    return (m["name"], m["kind"], pid) if marked else None


def sweep_leftovers(target: Path) -> list[str]:
    """Remove (or put back) the killed runs' folders of ``target``; one note per action.

    Call only while holding ``target``'s lock."""
    notes = []
    try:
        entries = sorted(target.parent.iterdir())
    except OSError:
        return notes
    for p in entries:
        found = leftover_of(p, target.name)
        if found is None:
            continue
        _, kind, pid = found
        who = f"an interrupted sparsekit run (PID {pid})"
        if kind == "old" and not os.path.lexists(target) and is_output(p):
            try:
                os.rename(p, target)
                notes.append(f"restored {target} from {p.name}, moved aside by {who} that was killed while replacing it")
                continue
            except OSError:
                pass
        size = _size(p)
        try:
            remove_ours(p)
        except OSError as e:
            if e.errno == errno.ENOENT:
                continue
            notes.append(f"could not remove {p} left by {who} ({e.strerror or e}): remove it yourself")
            continue
        notes.append(f"removed {p} ({size / 1e6:,.1f} MB) left by {who}")
    return notes


def sweep_neighbours(target: Path) -> list[str]:
    """``sweep_leftovers`` for the other outputs in ``target``'s folder that a killed run left folders
    of: each under its own lock, taken without waiting (an output being written is left alone)."""
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return []
    names = {found[0] for p in entries if (found := leftover_of(p)) is not None and found[0] != target.name}
    notes = []
    for name in sorted(names):
        try:
            lock = OutputLock(target.parent / name, command="sparsekit: removing what an interrupted run left")
        except (SparsekitError, OSError):
            continue
        try:
            notes += sweep_leftovers(target.parent / name)
        finally:
            lock.release()
    return notes
