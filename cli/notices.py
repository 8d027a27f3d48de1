"""The CLI's display of sparsekit's warnings: one ``warning: <message>`` line on stderr.

Python's default display prints ``file:line: Category: message`` plus a source line, which for a
notice raised inside a forward pass is a line of torch or typer internals.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

from rich.console import Console
from rich.markup import escape

from sparsekit.errors import SparsekitWarning


@contextlib.contextmanager
def brief_warnings(console: Console) -> Iterator[None]:
    """While inside, a ``SparsekitWarning`` prints as ``warning: <message>`` on ``console``; other
    warnings keep Python's display."""
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if isinstance(category, type) and issubclass(category, SparsekitWarning):
            console.print(f"[yellow]warning:[/] {escape(str(message))}", highlight=False, soft_wrap=True)
        else:
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = previous
