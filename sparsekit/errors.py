"""The one exception type users see: a message that says what went wrong and what to do."""


class SparsekitError(Exception):
    """A user-facing error. The CLI prints ``error: <message>`` on one line and exits 2.

    Write messages as one sentence naming the bad input and the fix, e.g.
    ``"no model at ./foo: pass a local HF directory, a hub id, or the demo alias 'smollm2-135m'"``.
    """


class SparsekitWarning(UserWarning):
    """A notice for users (e.g. sparse layers running the slow reference path): the CLI prints
    ``warning: <message>`` on stderr, without a source location."""
