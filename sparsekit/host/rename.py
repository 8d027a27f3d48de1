"""Renames that never replace what they should not: ``rename_noreplace`` (``renameat2(RENAME_NOREPLACE)``
where the kernel has it), and ``signals_deferred`` to hold Ctrl-C / SIGTERM back across a swap."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
from pathlib import Path
from typing import Iterator

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2_fn = _renameat2() if sys.platform.startswith("linux") else None


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; ``FileExistsError`` if ``dst`` exists (atomically where the kernel can)."""
    if _renameat2_fn is not None:
        if _renameat2_fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(dst))
    if os.path.lexists(dst):   # no renameat2 here: we hold the lock, so only an outsider can race this
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for a few system calls (their handlers run right after)."""
    import signal

    sigs = {signal.SIGINT, signal.SIGTERM}
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    except (AttributeError, OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
