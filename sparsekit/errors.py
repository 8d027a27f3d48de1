"""The one exception type users see: a message that says what went wrong and what to do; and the
strict switch that turns every fallback to a slower path into such an error."""
import os


class SparsekitError(Exception):
    """A user-facing error. The CLI prints ``error: <message>`` on one line and exits 2.

    Write messages as one sentence naming the bad input and the fix, e.g.
    ``"no model at ./foo: pass a local HF directory, a hub id, or the demo alias 'smollm2-135m'"``.
    """


class SparsekitWarning(UserWarning):
    """A notice for users (e.g. sparse layers running the slow reference path): the CLI prints
    ``warning: <message>`` on stderr, without a source location."""


def strict_mode() -> bool:
    """``SPARSEKIT_STRICT=1``: a faster path that cannot be used (compiling the decode step, its CUDA
    graph, the static decoder, the CATS kernels) is an error instead of a fallback with a one-line note.
    The tests and the benchmark scripts set it, so a lost feature cannot hide in their numbers."""
    raw = os.environ.get("SPARSEKIT_STRICT", "")
    if raw not in ("", "0", "1"):
        raise SparsekitError(f"SPARSEKIT_STRICT={raw!r}: set it to 1 (no fallbacks) or 0")
    return raw == "1"
