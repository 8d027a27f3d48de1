"""The one progress-callback shape of the library: ``progress(stage, done, total, item="")``.

``stage`` names the work ("calibration", "layers", "encoding", ...); ``done`` of ``total`` units
are finished; ``item``, optional, names the unit just finished (a tensor, a shard). Library code
calls it with three positional arguments and, where it has one, ``item=`` by keyword. The CLI turns
the calls into rich progress bars; scripts may pass any such callable, or nothing.
"""
from __future__ import annotations

from typing import Optional, Protocol


class Progress(Protocol):
    def __call__(self, stage: str, done: int, total: int, item: str = "") -> None: ...


def report(progress: Optional[Progress], stage: str, done: int, total: int, item: str = "") -> None:
    """Call ``progress`` if there is one (``item`` only when given, so 3-argument callables work)."""
    if progress is not None:
        if item:
            progress(stage, done, total, item=item)
        else:
            progress(stage, done, total)
