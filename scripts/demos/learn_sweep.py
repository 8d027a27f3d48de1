"""Learned-mask settings side by side on one GPU (issue 23): each variant is the prune API twin of
``sparsekit prune MODEL --method M --pattern P --learn-mask --calib <validation lines> --nsamples 128 --seqlen 512
--seed S`` with some ``LearnConfig`` fields set, then WikiText-2 test perplexity (the protocol of docs/results.md).
Variants run as separate processes, ``--parallel`` at a time (the demo model leaves the GPU mostly idle, so eight
at once take about as long as one); each prints its row as it finishes.

    SPARSEKIT_DEMO_GGUF=... python -m scripts.demos.learn_sweep --method admm --pattern 2:4 \\
        --variants '{"defaults": {}, "noise1": {"noise": [1.0, 0.0]}}' --seeds 0,1,2

``--variants``: a JSON object {name: {LearnConfig field: value}}; every variant runs at every seed of ``--seeds``.
Prints a markdown table and the mean per variant. ``--smoke`` runs two tiny variants on the CPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.common import CALIB_FILE, EVAL_FILE, add_demo_options, perplexity_of, smoke_model, wikitext_file


def one(args, name: str, learn: dict, seed: int, out: Path) -> dict:
    """Prune with ``learn`` at ``seed`` into ``out``, then its perplexity: one row."""
    from sparsekit.pruning.api import prune

    t = time.time()
    prune(args.model, method=args.method, pattern=args.pattern, sparsity=args.sparsity, calib=args.calib,
          nsamples=args.nsamples, seqlen=args.seqlen, seed=seed, device=args.device, output=out, overwrite=True,
          learn=learn)
    seconds = time.time() - t
    text = Path(args.eval).read_text(encoding="utf-8")
    rep = perplexity_of(out, text, args)
    return {"variant": name, "seed": seed, "learn": learn, "prune_s": round(seconds, 1), "ppl": rep["ppl"],
            "windows": rep["windows"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="admm")
    ap.add_argument("--pattern", default="2:4")
    ap.add_argument("--sparsity", type=float, default=None, help="hybrid patterns: the effective sparsity")
    ap.add_argument("--variants", default='{"defaults": {}}')
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--data", default=None, help=f"directory with {CALIB_FILE} and {EVAL_FILE}")
    ap.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--smoke", action="store_true", help="two tiny variants on the CPU")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # internal: one variant, JSON
    add_demo_options(ap)
    args = ap.parse_args()
    if args.one:                                     # a child: the parent resolved the model and the texts
        job = json.loads(args.one)
        args.model, args.calib, args.eval, args.device = job["model"], job["calib"], job["eval"], job["device"]
        args.nsamples, args.seqlen, args.eval_seqlen = job["nsamples"], job["seqlen"], job["eval_seqlen"]
        args.max_windows = job["max_windows"]
        row = one(args, job["name"], job["learn"], job["seed"], Path(job["out"]))
        print("ROW " + json.dumps(row), flush=True)
        return 0
    work = Path(args.out or tempfile.mkdtemp(prefix="learn-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.model, args.calib, args.eval = smoke_model(work / "smoke")
        args.device, args.nsamples, args.seqlen, args.eval_seqlen = "cpu", 8, 64, 64
        args.variants = '{"a": {"steps": 2, "batch_size": 2}, "b": {"steps": 2, "batch_size": 2, "prior": 2.0}}'
    else:
        args.calib, args.eval = wikitext_file(CALIB_FILE, args.data), wikitext_file(EVAL_FILE, args.data)
    variants = json.loads(args.variants)
    common = {"model": args.model, "calib": args.calib, "eval": args.eval, "device": args.device,
              "nsamples": args.nsamples, "seqlen": args.seqlen, "eval_seqlen": args.eval_seqlen,
              "max_windows": args.max_windows}
    jobs = [{"name": n, "learn": lc, "seed": int(s), "out": str(work / f"{n}-s{s}"), **common}
            for n, lc in variants.items() for s in args.seeds.split(",")]
    base = [sys.executable, "-m", "scripts.demos.learn_sweep"]
    rows = []
    print("| variant | settings | seed | WikiText-2 | prune + learn s |")
    print("|---|---|---:|---:|---:|")
    for i in range(0, len(jobs), max(1, args.parallel)):
        wave = [(j, subprocess.Popen(base + ["--one", json.dumps(j)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)) for j in jobs[i:i + args.parallel]]
        for j, p in wave:
            out, err = p.communicate()
            got = [ln for ln in out.splitlines() if ln.startswith("ROW ")]
            if p.returncode or not got:
                print(f"{j['name']} seed {j['seed']} failed: {(err.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
                return 1
            r = json.loads(got[-1][4:])
            rows.append(r)
            print(f"| {r['variant']} | {json.dumps(r['learn'])} | {r['seed']} | {r['ppl']:.2f} | {r['prune_s']:.0f} |",
                  flush=True)
    for name in variants:
        ppl = [r["ppl"] for r in rows if r["variant"] == name]
        spread = f", {min(ppl):.2f}-{max(ppl):.2f}" if len(ppl) > 1 else ""
        print(f"{name}: mean {statistics.mean(ppl):.2f} over {len(ppl)} seed(s){spread}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
