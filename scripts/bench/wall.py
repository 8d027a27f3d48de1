"""What ``generate_wall`` and ``eval_wall`` share: a command timed as a fresh process, and the phases marked inside
it. Imports nothing heavy (the marks start before ``import torch``)."""
from __future__ import annotations

import argparse
import atexit
import os
import subprocess
import sys
import time

T0_VAR = "WALL_T0_NS"   # the launcher's clock at the start, read by the inner process


def start_marks() -> list[tuple[str, float]]:
    """The phase marks of this (inner) process: the first one now ("python": interpreter up, counted from the
    launcher's start); at exit, after every handler registered later, one ``TIMELINE`` line to stderr with each
    phase's seconds and the clock at that moment. Append ``(name, time.time())`` at the end of each phase."""
    t0 = int(os.environ[T0_VAR]) / 1e9
    marks = [("python", time.time())]

    def report() -> None:
        marks.append(("exit handlers", time.time()))
        parts, prev = [], t0
        for name, t in marks:
            parts.append(f"{name} {t - prev:.2f}")
            prev = t
        sys.stderr.write(f"TIMELINE {marks[-1][1]:.3f} " + "; ".join(parts) + "\n")

    atexit.register(report)
    return marks


def run_timed(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``cmd``; ``(result, row)``: ``row`` has ``wall_s``, ``rc``, ``error`` (a failed command's last line to
    stderr) and ``timeline`` (its ``TIMELINE`` line, then the interpreter's exit after the last handler)."""
    t0 = time.time_ns()
    res = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, **{T0_VAR: str(t0)}))
    end = time.time_ns()
    row = {"wall_s": (end - t0) / 1e9, "rc": res.returncode}
    if res.returncode:
        row["error"] = error_line(res)
    line = next((ln for ln in res.stderr.splitlines() if ln.startswith("TIMELINE ")), None)
    if line:
        at, rest = line[len("TIMELINE "):].split(" ", 1)
        row["timeline"] = rest + f"; exit {end / 1e9 - float(at):.2f}"
    return res, row


def error_line(res: subprocess.CompletedProcess) -> str:
    """The last line a failed command wrote to stderr, its ``TIMELINE`` line aside."""
    lines = [ln for ln in res.stderr.strip().splitlines() if not ln.startswith("TIMELINE ")]
    return lines[-1] if lines else "?"


def parser_or_inner(doc: str, inner, model_help: str, runs: int) -> argparse.ArgumentParser | None:
    """With ``--inner ARGV...`` on the command line: ``inner(ARGV)``, then None. Else the parser of the arguments
    both scripts take (``model``, ``--runs``, ``--timeline``), for the caller to add its own."""
    if len(sys.argv) > 1 and sys.argv[1] == "--inner":
        inner(sys.argv[2:])
        return None
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("model", help=model_help)
    ap.add_argument("--runs", type=int, default=runs)
    ap.add_argument("--timeline", action="store_true", help="also mark the phases of each run (see above)")
    return ap
