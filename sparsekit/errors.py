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


def env_switch(name: str, what: str) -> bool:
    """An on/off environment variable: ``1`` on, unset, empty or ``0`` off, anything else one error line
    (``what`` says what ``1`` does)."""
    raw = os.environ.get(name, "")
    if raw not in ("", "0", "1"):
        raise SparsekitError(f"{name}={raw!r}: set it to 1 ({what}) or 0")
    return raw == "1"


def strict_mode() -> bool:
    """``SPARSEKIT_STRICT=1``: a faster path that cannot be used (compiling the decode step, its CUDA
    graph, the static decoder, the CATS kernels) is an error instead of a fallback with a one-line note.
    The tests and the benchmark scripts set it, so a lost feature cannot hide in their numbers."""
    return env_switch("SPARSEKIT_STRICT", "no fallbacks")
