"""How the console script ends (issue 20): after a command whose objects live to the exit (``generate``, under
``cli.common.long_lived``) and succeeded, ``cli.common.finish`` runs the ``atexit`` handlers, flushes stdout
and stderr and ends with ``os._exit(0)``, skipping the interpreter's teardown; in any other case it returns
and Python exits as usual. Each case runs in a fresh interpreter (no torch: well under a second)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import atexit, sys, threading
from sparsekit.cli import common
own, code, thread, at_once = {own!r}, {code!r}, {thread!r}, {at_once!r}
atexit.register(lambda: print("ATEXIT", flush=True))
if own:
    common.own_process()
if at_once:   # eval: nothing frozen, the work is done
    common.ends_at_once()
else:
    with common.long_lived():
        pass
if thread:
    gate = threading.Event()
    threading.Thread(target=gate.wait).start()
    atexit.register(gate.set)
print("OUT", end="")   # still in stdout's buffer: finish flushes it first
common.finish(code)
print(" RETURNED", flush=True)
if thread:
    gate.set()
"""


def run(own: bool = True, code=0, thread: bool = False, at_once: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(own=own, code=code, thread=thread, at_once=at_once)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("at_once", [False, True])
def test_after_a_long_lived_command_the_process_ends_at_once_handlers_run_and_output_flushed(at_once):
    res = run(at_once=at_once)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout == "OUTATEXIT\n"   # flushed, then the handlers; nothing after finish ran


@pytest.mark.parametrize("case", [dict(code=2), dict(code=130), dict(code="message"), dict(own=False),
                                  dict(thread=True), dict(at_once=True, own=False), dict(at_once=True, code=2)])
def test_otherwise_python_exits_as_usual(case):
    res = run(**case)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout == "OUT RETURNED\nATEXIT\n"
