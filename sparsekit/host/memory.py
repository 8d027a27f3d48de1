"""Host memory of this process: the resident set now, its peak, and the memory free to use.

:class:`HostPeak` measures the peak resident set (RSS) of one piece of work. On Linux it resets the
kernel's high-water mark first (``/proc/self/clear_refs``, value 5) and reads ``VmHWM`` at the end,
so an earlier, bigger run in the same process does not count; where that cannot be done it falls
back to ``getrusage``'s ``ru_maxrss`` (the peak of the whole process, ``exact`` False).
"""
from __future__ import annotations

import resource
import sys
from pathlib import Path


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def current_rss() -> int | None:
    """Resident bytes of this process now (None where /proc is not there)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def process_peak_rss() -> int:
    """The peak resident bytes of this process so far (``getrusage``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def available_memory() -> int | None:
    """Bytes of host memory available to new work (``MemAvailable``), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class HostPeak:
    """The peak RSS from construction to :meth:`peak` (see the module doc)."""

    def __init__(self):
        self.exact = False
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.exact = _status_kib("VmHWM") is not None
        except OSError:
            pass
        self.start = current_rss()

    def peak(self) -> int:
        if self.exact:
            kib = _status_kib("VmHWM")
            if kib is not None:
                return kib * 1024
        return process_peak_rss()
