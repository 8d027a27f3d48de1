"""Shared CLI plumbing: one-line errors, JSON output, consoles."""
from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable

import typer
from rich.console import Console

from sparsekit.errors import SparsekitError

# Tables and summaries go to stdout; progress bars and notes go to stderr,
# so that ``--json`` leaves stdout holding exactly one JSON document.
console = Console()
err_console = Console(stderr=True)


def handle_errors(fn: Callable) -> Callable:
    """Turn SparsekitError (and Ctrl-C) into a one-line message and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SparsekitError as e:
            err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]: no output was written")
            raise typer.Exit(130)

    return wrapper


def emit_json(obj: Any) -> None:
    """Print one JSON document on stdout (the only thing on stdout under --json)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


JSON_OPTION = typer.Option(False, "--json", help="Print a machine-readable JSON report on stdout instead of tables.")
