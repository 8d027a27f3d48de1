"""Output directories that keep their promises, shared by every command that writes.

A run *claims* its output path before any expensive work (``claim_output``):

- the location is checked (not the working directory or above it, no file in the way, writable, room
  for the estimated output) and an exclusive lock is taken (``sparsekit.host.outlock``): a second
  writer to the same path fails at once, naming the PID that holds it;
- folders left by a killed run beside the output (for this output or another in the same folder)
  are removed, and the caller's ``warn`` says so; only those provably sparsekit's
  (``sparsekit.host.leftovers``);
- an existing output is refused unless ``overwrite``; ``overwrite`` replaces only a sparsekit output
  (a directory with ``sparsekit.json``, a packed index or the ``.sparsekit-output`` marker, or an
  empty one) holding no file that sparsekit did not write (unless ``delete_extra``), never the working
  directory or its ancestors, nor the input, anything inside the input or anything that contains it.

Then ``claim.staging()`` yields a temporary sibling directory to write into, marked as this run's
(``sparsekit.host.manifest``). On success the list of its files is recorded in it and it is renamed
into place: without ``overwrite`` by a rename that fails if the output appeared meanwhile
(``renameat2(RENAME_NOREPLACE)``), with ``overwrite`` by moving the old output aside, renaming the new
one in and deleting the old. On any failure the temporary directory is removed and the output is left
as it was; an ``OSError`` (no space, permission, read-only file system, ...), also one that
safetensors reports as its own ``SafetensorError``, becomes one ``SparsekitError`` line
(``OutputWriteError``, also an ``OSError``).

``atomic_output_dir`` is both steps in one ``with`` (reusing the claim this process already holds).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator

from sparsekit.errors import SparsekitError
from sparsekit.host.filemode import public_dir
from sparsekit.host.leftovers import sweep_leftovers, sweep_neighbours
from sparsekit.host.manifest import OUTPUT_MARKER, OUTPUT_MARKERS, foreign_files, mark_staging, record_output, remove_ours
from sparsekit.host.outlock import OutputLock, command_line
from sparsekit.host.rename import rename_noreplace, signals_deferred

MARKER = OUTPUT_MARKER
SHOWN_EXTRA = 3   # foreign files named in the --overwrite refusal
_held: dict[str, "OutputClaim"] = {}   # target path -> the claim this process holds on it
_held_lock = threading.Lock()


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a cache file: a temporary file beside it, then a rename, so a
    reader sees the old file or the new one, never part of one). Raises ``OSError``; the temporary file
    is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class OutputWriteError(SparsekitError, OSError):
    """Writing the output failed (no space, no permission, ...): one line for the user; still an OSError."""


def _stderr_warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def _target(out: str | os.PathLike) -> Path:
    """The absolute output path, its parent resolved (the output itself may be a symlink)."""
    full = Path(os.path.abspath(os.fspath(out) or "."))
    return full.parent.resolve() / full.name if full.name else full


def is_sparsekit_output(path: str | os.PathLike) -> bool:
    """A directory written by sparsekit (or an empty one): what ``--overwrite`` may replace."""
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        return False
    return any((path / m).is_file() for m in OUTPUT_MARKERS) or not any(path.iterdir())


def check_output_dir(out: str | os.PathLike, overwrite: bool, sources: Iterable[str | os.PathLike] = (),
                     delete_extra: bool = False) -> Path:
    """Every check on an output path that needs no lock; call before any expensive work."""
    out = Path(out)
    target = _target(out)
    real = target.resolve()
    cwd = Path.cwd().resolve()
    shown = str(out) or "."
    if real == cwd or real in cwd.parents:
        raise SparsekitError(f"output {shown} is the current directory or one above it: name a new directory, "
                             f"e.g. -o out/pruned")
    if os.path.lexists(target) and not target.is_dir():
        raise SparsekitError(f"output {shown} is a file, not a directory: choose another path")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise SparsekitError(f"cannot create output {shown}: {parent} is a file, not a directory")
            break
    if os.path.lexists(target):
        if not overwrite:
            raise SparsekitError(f"output {shown} already exists: choose another path or pass --overwrite")
        for src in sources:
            s = Path(src).resolve()
            if real == s or real in s.parents or s in real.parents:
                what = "is" if real == s else "contains" if real in s.parents else "is inside"
                raise SparsekitError(f"output {shown} {what} the input {src}: --overwrite would delete the input; "
                                     f"choose another output path")
        if not is_sparsekit_output(target):
            raise SparsekitError(f"output {shown} is not a sparsekit output (no sparsekit.json or "
                                 f"tcabme.index.json in it): --overwrite replaces only sparsekit outputs; "
                                 f"remove it yourself or choose another path")
        extra = [] if delete_extra else foreign_files(target)
        if extra:
            shown_extra = ", ".join(extra[:SHOWN_EXTRA]) + (f", and {len(extra) - SHOWN_EXTRA} more"
                                                              if len(extra) > SHOWN_EXTRA else "")
            raise SparsekitError(f"output {shown} holds {len(extra)} file{'s' if len(extra) > 1 else ''} sparsekit did "
                                 f"not write ({shown_extra}): --overwrite would delete them; move them out, or pass "
                                 f"--delete-extra to delete them too")
    return out


def check_room(out: str | os.PathLike, estimate: int) -> None:
    """Refuse when the file system holding ``out`` has less free space than ``estimate`` bytes."""
    target = _target(out)
    where = next((p for p in (target, *target.parents) if p.exists()), target.anchor)
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    if estimate and free < estimate:
        raise SparsekitError(f"not enough space for {out}: about {_human(estimate)} needed, {_human(free)} free on "
                             f"{where}: free some space or choose another output path")


def _human(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} bytes"


def os_error(e: BaseException) -> OSError | None:
    """``e`` as an ``OSError``: itself, or the one inside a safetensors ``SafetensorError`` (its message
    ends with ``(os error 28)``; older versions write ``Os { code: 28, ... }``); else None."""
    if isinstance(e, OSError):
        return e
    if type(e).__name__ != "SafetensorError":
        return None
    m = re.search(r"os error (\d+)|code: (\d+)", str(e))
    if not m:
        return None
    code = int(m[1] or m[2])
    return OSError(code, os.strerror(code))


def write_failure(out: str | os.PathLike, e: OSError) -> OutputWriteError:
    """An OSError met while writing ``out`` as one user-facing line."""
    name = Path(os.fspath(out)).name
    internal = e.filename and any(part.startswith(f".{name}.") for part in Path(os.fsdecode(e.filename)).parts)
    what = f" ({e.filename})" if e.filename and not internal else ""   # not our temp folder or lock file
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        msg = f"no space left on the device while writing {out}{what}: free some space or choose another output path"
    elif e.errno in (errno.EACCES, errno.EPERM):
        msg = f"permission denied while writing {out}{what}: choose an output path you can write to"
    elif e.errno == errno.EROFS:
        msg = f"cannot write {out}: the file system is read-only{what}: choose another output path"
    else:
        msg = f"writing {out} failed: {e.strerror or e}{what}: check the location or choose another output path"
    err = OutputWriteError(msg + "; nothing was written")
    err.errno = e.errno
    return err


# --------------------------------------------------------------------------------------------
# The claim


class OutputClaim:
    """A run's hold on its output path: checks done, lock taken, leftovers swept. See the module doc."""

    def __init__(self, out: str | os.PathLike, *, overwrite: bool = False,
                 sources: Iterable[str | os.PathLike] = (), estimate: int = 0,
                 warn: Callable[[str], None] | None = None, command: str | None = None, wait: bool = False,
                 delete_extra: bool = False):
        self.out = Path(out)
        self.target = _target(out)
        self.overwrite = overwrite
        self.delete_extra = delete_extra
        self.sources = [Path(s) for s in sources]
        self.warn = warn or _stderr_warn
        self.notes: list[str] = []
        self._made: list[Path] = []
        check_output_dir(self.out, overwrite, self.sources, delete_extra)   # cheap refusals first, nothing created yet
        try:
            for parent in reversed(self.target.parents):
                if not parent.exists():
                    parent.mkdir()
                    self._made.append(parent)
            self.lock = OutputLock(self.target, command=command or command_line(), wait=wait, on_wait=self.warn,
                                   shown=self.out)
        except OSError as e:
            self._remove_made()
            raise write_failure(self.out, e) from None
        except BaseException:
            self._remove_made()
            raise
        try:
            for note in sweep_leftovers(self.target) + sweep_neighbours(self.target):
                self.notes.append(note)
                self.warn(note)
            check_output_dir(self.out, overwrite, self.sources, delete_extra)   # again, under the lock
            check_room(self.out, estimate)
        except BaseException:
            self.release()
            self._remove_made()   # refused before any work: leave nothing behind
            raise
        with _held_lock:
            _held[str(self.target)] = self

    def add_sources(self, sources: Iterable[str | os.PathLike]) -> None:
        """Inputs known only after the claim (e.g. a resolved model): check them as ``sources``."""
        self.sources += [Path(s) for s in sources]
        check_output_dir(self.out, self.overwrite, self.sources, self.delete_extra)

    def check_room(self, estimate: int) -> None:
        check_room(self.out, estimate)

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A temporary directory beside the output; on success it becomes the output (see the module doc)."""
        target = self.target
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
        except OSError as e:
            raise write_failure(self.out, e) from None
        try:
            mark_staging(tmp, target.name)   # first: what lets a later run tell this folder is ours
            public_dir(tmp)  # mkdtemp makes 0700; the output should look like any mkdir
            yield tmp
            record_output(tmp, command_line())
            self._publish(tmp)
        except BaseException as e:
            _discard(tmp)
            err = None if isinstance(e, SparsekitError) else os_error(e)
            if err is None:
                raise
            raise write_failure(self.out, err) from None

    def _publish(self, tmp: Path) -> None:
        target = self.target
        if not os.path.lexists(target):
            try:
                rename_noreplace(tmp, target)
            except FileExistsError:
                raise OutputWriteError(f"output {self.out} appeared while this run was writing it (made by another "
                                       f"program): it was left as it is; choose another path or pass --overwrite") from None
            return
        if not self.overwrite:
            raise OutputWriteError(f"output {self.out} appeared while this run was writing it (made by another "
                                   f"program): it was left as it is; choose another path or pass --overwrite")
        check_output_dir(self.out, True, self.sources, self.delete_extra)
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-{os.getpid()}-", dir=target.parent))
        with signals_deferred():   # Ctrl-C / SIGTERM wait until the output is in place again
            try:
                os.rename(target, old)    # onto the empty directory just made: atomic, and the name is ours
            except BaseException:
                os.rmdir(old)
                raise
            try:
                rename_noreplace(tmp, target)
            except BaseException:
                os.rename(old, target)
                raise
        try:
            remove_ours(old)
        except OSError as e:
            self.warn(f"could not remove the previous output, moved aside to {old} ({e.strerror or e}): remove it yourself")

    def _remove_made(self) -> None:
        for d in reversed(self._made):
            try:
                d.rmdir()
            except OSError:
                break
        self._made = []

    def release(self) -> None:
        with _held_lock:
            if _held.get(str(self.target)) is self:
                del _held[str(self.target)]
        lock, self.lock = getattr(self, "lock", None), None
        if lock is not None:
            lock.release()

    def __enter__(self) -> "OutputClaim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _discard(tmp: Path) -> None:
    """Remove a temp folder of this run (its marker last, see ``manifest.remove_ours``)."""
    try:
        remove_ours(tmp)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def held_claim(out: str | os.PathLike) -> OutputClaim | None:
    """The claim this process holds on ``out``, if any."""
    with _held_lock:
        return _held.get(str(_target(out)))


def claim_output(out: str | os.PathLike, **kw) -> OutputClaim:
    """``OutputClaim(out, **kw)``: use as ``with claim_output(...) as claim:`` around the whole run."""
    return OutputClaim(out, **kw)


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False, *, sources: Iterable[str | os.PathLike] = (),
                      estimate: int = 0, warn: Callable[[str], None] | None = None,
                      delete_extra: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to ``out``; on success it becomes ``out``.

    Uses the claim this process already holds on ``out``, else claims it for the duration. On any
    exception the temporary directory is removed and ``out`` is left untouched.
    """
    claim = held_claim(out)
    if claim is not None:
        if estimate:
            claim.check_room(estimate)
        with claim.staging() as tmp:
            yield tmp
        return
    with OutputClaim(out, overwrite=overwrite, sources=sources, estimate=estimate, warn=warn,
                     delete_extra=delete_extra) as claim:
        with claim.staging() as tmp:
            yield tmp
