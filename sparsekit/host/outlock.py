"""The lock a writer holds on its output path for the whole run.

Beside an output ``DIR`` a run keeps ``.DIR.lock``: ``fcntl.flock``-ed for the whole run (taken before
any expensive work); it holds ``"<pid> <command>"`` so that a second writer can say who is in the way.
Removed on release; a killed run's lock file is taken over by the next run. What else a killed run
leaves (its temp folder) is swept by ``sparsekit.host.leftovers``.
"""
from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path
from typing import Callable

from sparsekit.errors import SparsekitError


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
