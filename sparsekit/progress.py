"""The one progress-callback shape of the library: ``progress(stage, done, total)``.

``stage`` names the work ("calibration", "layers", "encoding", ...), ``done`` of ``total`` units
are finished. The CLI turns these calls into rich progress bars; scripts may pass ``print``-like
callables or nothing.
"""
from __future__ import annotations

from typing import Callable, Optional

Progress = Callable[[str, int, int], None]


def report(progress: Optional[Progress], stage: str, done: int, total: int) -> None:
    """Call ``progress`` if there is one."""
    if progress is not None:
        progress(stage, done, total)
