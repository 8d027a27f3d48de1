"""The lock a writer holds on its output path for the whole run, and the sweep of what killed runs left.

Beside an output ``DIR`` a run keeps:

- ``.DIR.lock``: ``fcntl.flock``-ed for the whole run (taken before any expensive work); it holds
  ``"<pid> <command>"`` so that a second writer can say who is in the way. Removed on release.
- ``.DIR.tmp-<pid>-<random>``: the directory being written (renamed into place at the end).
- ``.DIR.old-<pid>-<random>``: under ``--overwrite``, the previous output for the moment of the swap.

A run killed with SIGKILL (or a power cut) leaves the last two behind (and its lock file). Whoever
next takes the lock removes those whose process is gone (``os.kill(pid, 0)``), and puts an ``.old-*``
back when the output itself is missing (the kill fell between the two renames of an ``--overwrite``);
a run writing elsewhere in the same folder does the same for the other names, under their locks.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

from sparsekit.errors import SparsekitError

# ".NAME.tmp-<pid>-<random>", ".NAME.old-<pid>-<random>"; earlier versions: ".NAME.tmp-<8 random>", ".NAME.old-<pid>"
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?:(?P<pid>\d+)(?:-[A-Za-z0-9_]+)?|[a-z0-9_]{8})$")


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's process counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def command_line() -> str:
    """A short description of this process for the lock file: ``sparsekit encode ...``."""
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    if prog in ("app.py", "__main__.py", "-c", "-m"):
        prog = "sparsekit"
    return " ".join([prog, *sys.argv[1:]])[:300]


class OutputLock:
    """An exclusive ``flock`` on ``.NAME.lock`` beside ``target``.

    Raises ``SparsekitError`` at once when another process holds it (``wait=False``), naming its PID;
    with ``wait=True`` it blocks until that process is done.
    """

    def __init__(self, target: Path, *, command: str | None = None, wait: bool = False,
                 on_wait: Callable[[str], None] | None = None, shown: str | os.PathLike | None = None):
        self.target = target
        shown = shown if shown is not None else target
        self.path = lock_path(target)
        self.fd: int | None = None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _read_holder(fd)
                    if not wait:
                        raise SparsekitError(
                            f"output {shown} is being written by another sparsekit run ({holder}): wait for it to "
                            f"finish, or choose another output path") from None
                    if on_wait:
                        on_wait(f"waiting for {holder} to finish writing {shown}")
                    fcntl.flock(fd, fcntl.LOCK_EX)
                # The holder before us may have removed the file on release: lock the file that is there now.
                try:
                    same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                break
            os.close(fd)
        self.fd = fd
        try:   # who holds it, for the message of a second writer; the lock holds without it (e.g. disk full)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {command or command_line()}\n".encode(), 0)
        except OSError:
            pass

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)   # still holding the lock: a waiter re-checks the inode (above)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 400, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    pid, _, cmd = text.partition(" ")
    if not pid.isdigit():
        return "PID unknown"
    return f"PID {pid}: {cmd}" if cmd else f"PID {pid}"


def _size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def sweep_leftovers(target: Path, keep: set[str] = frozenset()) -> list[str]:
    """Remove the temp and old folders of ``target`` whose process is gone; returns one note per action.

    Call only while holding ``target``'s lock. ``keep``: names of this run's own folders.
    """
    notes = []
    try:
        entries = sorted(target.parent.iterdir())
    except OSError:
        return notes
    for p in entries:
        m = _LEFTOVER.match(p.name)
        if not m or m["name"] != target.name or p.name in keep:
            continue
        pid = int(m["pid"]) if m["pid"] else None
        if pid is not None and pid != os.getpid() and pid_alive(pid):
            continue
        who = f"an interrupted sparsekit run (PID {pid})" if pid else "an interrupted sparsekit run"
        if m["kind"] == "old" and not os.path.lexists(target) and p.is_dir() and not p.is_symlink():
            try:
                os.rename(p, target)
                notes.append(f"restored {target} from {p.name}, moved aside by {who} that was killed while replacing it")
                continue
            except OSError:
                pass
        size = _size(p) if p.is_dir() and not p.is_symlink() else 0
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
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
    names = set()
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return []
    for p in entries:
        m = _LEFTOVER.match(p.name)
        if not m or m["name"] == target.name:
            continue
        pid = int(m["pid"]) if m["pid"] else None
        if pid is None or (pid != os.getpid() and not pid_alive(pid)):
            names.add(m["name"])
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
