"""Wall time of ``sparsekit generate`` as a user runs it (issue 20: the demo answers 64 tokens in <= 8 s, imports
and load included, the first token <= 1 s after the load), and where it goes.

Runs the console script ``--runs`` times in a row (fresh processes; the first on whatever caches exist), each
``sparsekit generate MODEL -p PROMPT -n TOKENS --json``, and prints per run the wall time and the command's own
timings. ``--timeline`` runs the same command through this module instead (``--inner``), which marks, in
seconds: interpreter up, ``import torch``, the other imports, command line to load, load (synchronized),
generation, and exit (after the last ``atexit`` handler of the marks, the rest of the wall time)::

    python -m scripts.bench.generate_wall out/wanda50.tcabme [--runs 5] [--tokens 64] [--timeline]
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

from scripts.bench.wall import parser_or_inner, run_timed, start_marks

PROMPT = "The capital of France is"


def inner(argv: list[str]) -> None:
    """Run ``sparsekit`` with ``argv`` in this process, printing a ``TIMELINE`` line to stderr at exit."""
    marks = start_marks()
    import torch

    marks.append(("import torch", time.time()))
    import sparsekit.cli.app as app
    import sparsekit.runtime.generate as gen
    import sparsekit.runtime.loader as loader

    marks.append(("imports", time.time()))
    load, generate_text = loader.load, gen.generate_text

    def timed_load(*a, **k):
        marks.append(("to load", time.time()))
        out = load(*a, **k)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        marks.append(("load", time.time()))
        return out

    def timed_generate(*a, **k):
        out = generate_text(*a, **k)
        marks.append(("generate", time.time()))
        return out

    loader.load, gen.generate_text = timed_load, timed_generate
    sys.argv = ["sparsekit", *argv]
    app.main()


def run_once(model: str, tokens: int, extra: list[str], timeline: bool) -> dict:
    argv = ["generate", model, "-p", PROMPT, "-n", str(tokens), "--json", *extra]
    cmd = ([sys.executable, "-m", "scripts.bench.generate_wall", "--inner", *argv] if timeline
           else [shutil.which("sparsekit") or "sparsekit", *argv])
    res, row = run_timed(cmd, dict(os.environ))
    if res.returncode:
        return row
    d = json.loads(res.stdout)
    row.update({k: d[k] for k in ("new_tokens", "seconds", "first_token_s", "warmup_s", "engine")})
    return row


def main() -> int:
    ap = parser_or_inner(__doc__, inner, "packed or pruned directory, hub id, or smollm2-135m", 5)
    if ap is None:
        return 0
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default=None, help="passed to generate (default: its own)")
    args = ap.parse_args()
    extra = ["--device", args.device] if args.device else []
    print("| run | wall s | tokens | generation s | first token s | warm-up s | timeline (s) |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    walls = []
    for i in range(1, args.runs + 1):
        r = run_once(args.model, args.tokens, extra, args.timeline)
        if r["rc"]:
            print(f"run {i} failed (exit {r['rc']}): {r['error']}", file=sys.stderr)
            return 1
        walls.append(r["wall_s"])
        print(f"| {i} | {r['wall_s']:.2f} | {r['new_tokens']} | {r['seconds']:.2f} | {r['first_token_s']:.2f} | "
              f"{r['warmup_s']:.2f} | {r.get('timeline', '')} |", flush=True)
    walls.sort()
    print(f"median wall {walls[len(walls) // 2]:.2f} s over {len(walls)} runs (min {walls[0]:.2f}, max {walls[-1]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
