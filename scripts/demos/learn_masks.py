"""Learned hybrid / 2:4 masks on the demo model (SmolLM2-135M): the results table of docs/results.md.

At 25%, 35% and 45% effective sparsity: one-shot hybrid (Wanda scores, SparseGPT scores), learned
hybrid (``--learn-mask`` from SparseGPT scores, then the SparseGPT update on the learned mask), and
unstructured SparseGPT; once: SparseGPT 2:4, learned 2:4, and dense. Calibration: WikiText-2
validation lines, 128 windows of 512 tokens for the one-shot rows (seed 0), ``--learn-nsamples``
windows for learning; perplexity: the full WikiText-2 test string at seqlen 2048
(``sparsekit.evaluation.ppl``, the protocol of docs/results.md). Records learning time and peak GPU
memory of every learned run.

Meant for ONE device call of at most 9 minutes on an H100: ``--budget`` (seconds, default 450) is
the wall time the whole script aims at; learned runs get the time left after the one-shot rows, as
steps measured from the first learned run's step time (``--steps N`` fixes them instead).

    SPARSEKIT_DEMO_GGUF=... python -m scripts.demos.learn_masks --data ../shared/data/wikitext-2-raw-v1 --json out/learn.json

Checks (exit 0 only if all pass): perplexity rises with sparsity in every family; learned beats
one-shot at every sparsity (hybrid and 2:4); learned hybrid at 35% closes >= 75% of the gap between
SparseGPT 2:4 and dense. ``--smoke`` runs the whole thing on the CPU on a tiny random model (the
checks are printed but not enforced).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from scripts.common import CALIB_FILE as CALIB, EVAL_FILE as EVAL, perplexity_of, smoke_model, wikitext_file


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help=f"directory with {CALIB} and {EVAL}")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sparsities", default="0.25,0.35,0.45")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--learn-nsamples", type=int, default=256, help="calibration windows for the learned runs")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval-seqlen", type=int, default=2048)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="learning steps of every learned run (default: fit --budget)")
    ap.add_argument("--first-steps", type=int, default=150, help="steps of the first learned run when --steps is not given")
    ap.add_argument("--max-steps", type=int, default=1500)
    ap.add_argument("--budget", type=float, default=450.0, help="target wall seconds of the whole script")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--learn-batch", type=int, default=None)
    ap.add_argument("--distill", action="store_true")
    ap.add_argument("--hybrid", default="hybrid", help="the hybrid pattern (hybrid:T)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--smoke", action="store_true", help="tiny random model on the CPU, a few steps")
    args = ap.parse_args()
    t_start = time.perf_counter()

    from transformers.utils import logging as hf_logging

    from sparsekit.hf.data import eval_text
    from sparsekit.pruning.api import prune

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sparsekit-learn-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        torch.set_num_threads(1)
        model, calib, evalf = smoke_model(work)
        args.device, args.hybrid = "cpu", "hybrid:8"
        args.nsamples, args.learn_nsamples, args.seqlen, args.eval_seqlen = 8, 8, 64, 128
        args.steps = args.steps or 6
        args.learn_batch = args.learn_batch or 2
    else:
        model, calib, evalf = args.model, wikitext_file(CALIB, args.data), wikitext_file(EVAL, args.data)
    text = eval_text(evalf)
    sparsities = [float(s) for s in args.sparsities.split(",")]
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    say = lambda msg: print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)  # noqa: E731
    say(f"device {gpu}; work dir {work}")

    def ppl_of(path) -> float:
        r = perplexity_of(path, text, args)
        return r["ppl"]

    rows: list[dict] = []

    def run(label: str, family: str, target: float, learn: dict | None = None, **kw) -> dict:
        out = work / label.replace(" ", "-").replace(":", "of")
        t0 = time.perf_counter()
        rep = prune(model, calib=calib, nsamples=kw.pop("nsamples", args.nsamples), seqlen=args.seqlen, seed=args.seed,
                    device=args.device, output=out, overwrite=True, learn=learn, warn=lambda m: None, **kw)
        prune_s = time.perf_counter() - t0
        row = {"row": label, "family": family, "sparsity": target, "overall_sparsity": rep["overall_sparsity"],
               "prune_s": prune_s, "ppl": ppl_of(out)}
        if "learning" in rep:
            lm = rep["learning"]
            row.update(steps=lm["steps"], learn_s=lm["learn_seconds"], update_s=lm["update_seconds"],
                       peak_gib=(lm["peak_mem_bytes"] or 0) / 2**30, calib_loss=lm["calibration_loss"],
                       loss_first=lm["loss"].get("first"), loss_last=lm["loss"].get("last_10pct_mean"))
        rows.append(row)
        say(f"{label}: ppl {row['ppl']:.3f} (sparsity {row['overall_sparsity']:.4f}, {prune_s:.1f} s"
            + (f", {row['steps']} steps in {row['learn_s']:.1f} s, peak {row['peak_gib']:.2f} GiB" if learn else "") + ")")
        return row

    rows.append({"row": "dense", "family": "dense", "sparsity": 0.0, "overall_sparsity": 0.0, "prune_s": 0.0,
                 "ppl": ppl_of(model)})
    say(f"dense: ppl {rows[-1]['ppl']:.3f}")
    for s in sparsities:
        run(f"one-shot hybrid wanda {s:.2f}", "oneshot-wanda", s, method="wanda", pattern=args.hybrid, sparsity=s)
        run(f"one-shot hybrid sparsegpt {s:.2f}", "oneshot-sparsegpt", s, method="sparsegpt", pattern=args.hybrid, sparsity=s)
        run(f"unstructured sparsegpt {s:.2f}", "unstructured", s, method="sparsegpt", sparsity=s)
    run("2:4 sparsegpt", "2:4-oneshot", 0.5, method="sparsegpt", pattern="2:4")

    learned = [(f"learned hybrid {s:.2f}", "learned-hybrid", s, dict(pattern=args.hybrid, sparsity=s)) for s in sparsities]
    learned.append(("learned 2:4", "2:4-learned", 0.5, dict(pattern="2:4")))
    step_s = None
    for i, (label, family, s, kw) in enumerate(learned):
        if args.steps:
            steps = args.steps
        elif step_s is None:
            steps = args.first_steps
        else:  # the time left, shared by the learned runs left, minus each run's fixed cost
            left = args.budget - (time.perf_counter() - t_start)
            per_run = left / (len(learned) - i) - overhead
            steps = int(max(30, min(args.max_steps, per_run / step_s)))
        learn = {"steps": steps}
        for key, val in (("lr", args.lr), ("batch_size", args.learn_batch)):
            if val is not None:
                learn[key] = val
        if args.distill:
            learn["distill"] = True
        t0 = time.perf_counter()
        row = run(label, family, s, learn=learn, method="sparsegpt", nsamples=args.learn_nsamples, **kw)
        if step_s is None and row["steps"]:
            step_s = row["learn_s"] / row["steps"]
            overhead = time.perf_counter() - t0 - row["learn_s"]

    checks = evaluate(rows, sparsities)
    table = markdown(rows, gpu, args)
    print(table)
    for name, ok in checks.items():
        print(f"{name}: {'PASS' if ok else 'FAIL'}")
    result = {"gpu": gpu, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "settings": vars(args),
              "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
              "rows": rows, "checks": checks, "total_s": time.perf_counter() - t_start}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: result[k] for k in ("gpu", "checks", "total_s")} | {"rows": [
        {k: r.get(k) for k in ("row", "ppl", "overall_sparsity", "steps", "learn_s", "peak_gib")} for r in rows]},
        default=str))
    print(f"total {result['total_s']:.1f} s")
    return 0 if args.smoke or all(checks.values()) else 1


def evaluate(rows: list[dict], sparsities: list[float]) -> dict[str, bool]:
    by = {(r["family"], r["sparsity"]): r["ppl"] for r in rows}
    dense = by[("dense", 0.0)]
    checks = {}
    for fam in ("oneshot-wanda", "oneshot-sparsegpt", "unstructured", "learned-hybrid"):
        seq = [dense] + [by[(fam, s)] for s in sorted(sparsities)]
        checks[f"{fam}: ppl rises with sparsity"] = all(a <= b for a, b in zip(seq, seq[1:]))
    checks["learned hybrid beats one-shot at every sparsity"] = all(
        by[("learned-hybrid", s)] < min(by[("oneshot-wanda", s)], by[("oneshot-sparsegpt", s)]) for s in sparsities)
    checks["learned 2:4 beats SparseGPT 2:4"] = by[("2:4-learned", 0.5)] < by[("2:4-oneshot", 0.5)]
    if 0.35 in sparsities:
        gap = by[("2:4-oneshot", 0.5)] - dense
        closed = (by[("2:4-oneshot", 0.5)] - by[("learned-hybrid", 0.35)]) / gap if gap > 0 else 0.0
        checks[f"learned hybrid 35% closes >= 75% of the 2:4-to-dense gap ({closed:.1%})"] = closed >= 0.75
    return checks


def markdown(rows: list[dict], gpu: str, args) -> str:
    lines = [f"SmolLM2-135M, WikiText-2 test ppl (seqlen {args.eval_seqlen}), {gpu}", "",
             "| row | target sparsity | measured | ppl | steps | learn s | peak GiB | prune s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['row']} | {r['sparsity']:.2f} | {r['overall_sparsity']:.4f} | {r['ppl']:.2f} | "
                     f"{r.get('steps', '-')} | {r['learn_s']:.1f} | {r['peak_gib']:.2f} | {r['prune_s']:.1f} |"
                     if "learn_s" in r else
                     f"| {r['row']} | {r['sparsity']:.2f} | {r['overall_sparsity']:.4f} | {r['ppl']:.2f} | - | - | - | "
                     f"{r['prune_s']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
