"""Wall time of ``sparsekit eval MODEL --speed`` as a user runs it (issue 20: <= 30 s on the demo, imports and load
included, and prefill >= 0.95x dense where both models run the same matmuls), cold and warm, and where it goes.

Runs ``sparsekit eval MODEL --speed --json`` ``--runs`` times in a row, each in a fresh process. With ``--cold``
every run sees the caches of a new temporary directory (``SPARSEKIT_CACHE``, ``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR``), empty for the first run, so the first run is what a fresh machine gets and the later ones
are warm. ``--timeline`` runs the command through this module instead (``--inner``), which marks, in seconds:
interpreter up, ``import torch``, ``import transformers``, the other imports, command line to measurement,
``measure_speed``, the exit handlers, and the interpreter's own exit (the rest of the wall time). Per run: the
wall, the report's phases, the prefill ratio per batch size (with its number of pairs) and the range of the
decode ratios::

    python -m scripts.bench.eval_wall out/wanda50.tcabme [--runs 3] [--cold] [--timeline]
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

from scripts.bench.wall import parser_or_inner, run_timed, start_marks


def inner(argv: list[str]) -> None:
    """Run ``sparsekit`` with ``argv`` in this process, printing a ``TIMELINE`` line to stderr at exit."""
    marks = start_marks()   # its exit report runs after every library's own handler
    import torch  # noqa: F401

    marks.append(("import torch", time.time()))
    import transformers  # noqa: F401

    marks.append(("import transformers", time.time()))
    import sparsekit.cli.app as app
    import sparsekit.evaluation.speed as speed

    marks.append(("imports", time.time()))
    measure = speed.measure_speed

    def timed(*a, **k):
        marks.append(("to measure", time.time()))
        out = measure(*a, **k)
        marks.append(("measure_speed", time.time()))
        return out

    speed.measure_speed = timed
    sys.argv = ["sparsekit", *argv]
    app.main()


def run_once(model: str, extra: list[str], timeline: bool, env: dict) -> dict:
    argv = ["eval", model, "--speed", "--json", *extra]
    cmd = ([sys.executable, "-m", "scripts.bench.eval_wall", "--inner", *argv] if timeline
           else [shutil.which("sparsekit") or "sparsekit", *argv])
    res, row = run_timed(cmd, dict(env, COLUMNS="80"))
    if res.returncode:
        return row
    speed = json.loads(res.stdout)["speed"]
    row["phases"] = "; ".join(f"{k[:-2]} {v:.1f}" for k, v in speed.get("phases_s", {}).items()
                              if k in ("load_s", "capture_s", "decode_s", "prefill_s"))
    rows = speed.get("rows", [])
    row["prefill_x"] = " / ".join(f"{r['ratio']['prefill_tok_s']:.3f}"
                                  + (f" ({len(r['paired']['prefill_x'])})" if r.get("paired") else "")
                                  for r in rows if r.get("ratio"))
    dec = [r["ratio"]["decode_tok_s"] for r in rows if r.get("ratio")]
    row["decode_x"] = f"{min(dec):.3f}-{max(dec):.3f}" if dec else ""
    return row


def main() -> int:
    ap = parser_or_inner(__doc__, inner, "packed directory (from `sparsekit encode`) or pruned HF directory", 3)
    if ap is None:
        return 0
    ap.add_argument("--cold", action="store_true", help="the runs share new, empty caches (the first run is cold)")
    ap.add_argument("--batch-sizes", default=None, help="passed to eval (default: its own)")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    extra = ["--batch-sizes", args.batch_sizes] if args.batch_sizes else []
    env = dict(os.environ)
    tmp = tempfile.TemporaryDirectory(prefix="eval_wall_") if args.cold else None
    if tmp:
        for var, sub in (("SPARSEKIT_CACHE", "sparsekit"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                         ("TRITON_CACHE_DIR", "triton")):
            env[var] = os.path.join(tmp.name, sub)
    print("| run | wall s | phases (s) | prefill x per batch size | decode x | timeline (s) |")
    print("|---:|---:|---|---|---|---|")
    try:
        for i in range(1, args.runs + 1):
            r = run_once(args.model, extra, args.timeline, env)
            if r["rc"]:
                print(f"run {i} failed (exit {r['rc']}): {r['error']}", file=sys.stderr)
                return 1
            label = f"{i} (cold)" if tmp and i == 1 else str(i)
            print(f"| {label} | {r['wall_s']:.1f} | {r['phases']} | {r['prefill_x']} | {r['decode_x']} | "
                  f"{r.get('timeline', '')} |", flush=True)
    finally:
        if tmp:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
