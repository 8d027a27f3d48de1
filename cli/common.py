"""Shared CLI plumbing: one-line errors, JSON output, consoles."""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import json
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator

import typer
from rich.console import Console
from rich.markup import escape

from sparsekit.cli.notices import brief_warnings
from sparsekit.errors import SparsekitError
from sparsekit.progress import Progress

# Tables and summaries go to stdout; progress bars and notes go to stderr,
# so that ``--json`` leaves stdout holding exactly one JSON document.
console = Console()
err_console = Console(stderr=True)


# Set by ``main`` (the console script): the CLI runs as its own process, not inside another program (a test's
# CliRunner, a notebook), so it may set process-wide policies such as the garbage collector's (``long_lived``).
_own_process = False


def own_process() -> None:
    """Say that the CLI owns this process (only the console script's ``main`` calls it)."""
    global _own_process
    _own_process = True


@contextlib.contextmanager
def long_lived(enabled: bool | None = None) -> Iterator[None]:
    """Around the imports and the model load of a command that then works on that model (``generate``):
    CPython's automatic garbage collection off inside, since those ~600k objects live to the exit and its full
    collections would walk them again and again (~0.6 s on the demo model); on leaving normally,
    ``gc.freeze()``, so that later collections and the interpreter's exit skip them (~0.9 s less to exit).
    No collection first: it would walk all of them once more (0.3-0.4 s on an H100 machine) to free ~12k
    small objects in reference cycles (functions, tuples; no tensor storage, a test checks), which stay.
    The console script then ends without the interpreter's teardown (:func:`finish`).
    On an error the collector is simply on again. ``enabled`` None: only where the CLI owns the process
    (``own_process``); inside another program it changes nothing."""
    global _lives_to_exit
    _lives_to_exit = False
    if not (_own_process if enabled is None else enabled) or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
        gc.freeze()
        _lives_to_exit = True   # nothing left for the interpreter's teardown to do but free it (``finish``)
    finally:
        gc.enable()


_lives_to_exit = False   # set by ``long_lived`` when it froze what it made


def ends_at_once() -> None:
    """Say that the command's work is done and what it made is the OS's to free (``eval``: the models, Inductor's
    compiled graphs, the CUDA graphs): the console script then ends without the interpreter's teardown
    (:func:`finish`), as after ``long_lived``. On an H200, ~1.6 s of ``eval --speed``'s wall time was that
    teardown (docs/benchmarks.md "Session 22"). Only where the CLI owns the process (``own_process``)."""
    global _lives_to_exit
    _lives_to_exit = _own_process


def _other_threads_running() -> bool:
    main = threading.main_thread()
    return any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate())


def finish(code: Any = 0) -> None:
    """The console script's end (``main``, with the exit code): after a command that succeeded and whose
    objects lived to the exit (``long_lived``: ``generate``; ``ends_at_once``: ``eval``), the process ends here
    with ``os._exit(0)`` once Python's exit handlers (``atexit``) have run and stdout and stderr are flushed.
    What is skipped is the interpreter's teardown of ~3000 modules and the model, object by object, which the
    OS takes back at once anyway (~0.15 s on a 2-core CPU machine; with a CUDA context, more). In every other
    case it returns and Python exits as usual: another command, an error or interrupt (a code other than 0),
    threads still running, a profiler or tracer attached (cProfile, coverage: they write their results at the
    very end), stdout or stderr that cannot be flushed, or outside the console script (``own_process``)."""
    if not (_own_process and _lives_to_exit) or code not in (0, None):
        return
    if sys.gettrace() is not None or sys.getprofile() is not None or _other_threads_running():
        return
    run_handlers = getattr(atexit, "_run_exitfuncs", None)   # CPython's; the interpreter calls it at exit
    if run_handlers is None:
        return
    try:
        _flush_std()
    except (OSError, ValueError):   # a closed pipe, say: Python's own exit says so, as usual
        return
    run_handlers()   # each handler once, in the usual order; it also empties the list
    try:
        _flush_std()
    except (OSError, ValueError):
        os._exit(120)   # what Python exits with when flushing stdout fails at its exit
    os._exit(0)


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C so that every ``with`` cleans up (temp dirs, locks)."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises ``Terminated`` (a second one is ignored during the clean-up)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def handle_errors(fn: Callable) -> Callable:
    """Turn SparsekitError, Ctrl-C and SIGTERM into a one-line message and a non-zero exit (2, 130, 143)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with sigterm_raises(), brief_warnings(err_console):  # a sparsekit warning: its message only
                return fn(*args, **kwargs)
        except SparsekitError as e:
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        except Terminated:
            err_console.print("[bold red]terminated[/] (SIGTERM): no output was written")
            raise typer.Exit(143)
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]: no output was written")
            raise typer.Exit(130)

    return wrapper


def emit_json(obj: Any) -> None:
    """Print one JSON document on stdout (the only thing on stdout under --json)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


JSON_OPTION = typer.Option(False, "--json", help="Print a machine-readable JSON report on stdout instead of tables.")


@contextlib.contextmanager
def progress_bar() -> Iterator[Progress]:
    """One rich progress bar on stderr, driven by a ``sparsekit.progress.Progress`` callback: the
    first call adds the bar, later calls move it; its description is the latest stage."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.progress import Progress as Bars

    with Bars(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
              TimeRemainingColumn(), console=err_console) as bars:
        task = None

        def update(stage: str, done: int, total: int) -> None:
            nonlocal task
            if task is None:
                task = bars.add_task(stage, total=total, completed=done)
            else:
                bars.update(task, description=stage, completed=done, total=total)

        yield update
