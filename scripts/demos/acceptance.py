"""Acceptance run of issue 2 on the demo model (SmolLM2-135M, from the bundled Q4_1 GGUF).

For magnitude, wanda and sparsegpt x {50% unstructured, 2:4}: calibrate on 128 windows of 512
tokens (seed 0) from the WikiText-2 validation lines, evaluate perplexity on the WikiText-2 test
string at seqlen 2048 (Wanda/SparseGPT protocol), check every pruned linear's sparsity against the
request from the saved weights themselves, and check the ordering
ppl(sparsegpt) < ppl(wanda) < ppl(magnitude) for both patterns. Also the dense baseline.

    python -m scripts.demos.acceptance --device cuda --json out/acceptance.json

Exit status 0 only when every check passes. Small settings (e.g. --nsamples 8 --seqlen 128
--eval-seqlen 256 --max-windows 4 --device cpu) make a quick CPU dry run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from scripts.common import CALIB_FILE, EVAL_FILE, add_demo_options, perplexity_of, wikitext_file
METHODS = ("magnitude", "wanda", "sparsegpt")
PATTERNS = (("unstructured", 0.5), ("2:4", None))


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def check_sparsity(pruned_dir: Path, dense: dict[str, torch.Tensor], pattern: str, sparsity: float) -> dict:
    """Per pruned linear, from the saved tensors: the zeros are exactly the requested count, except
    for weights that were already zero in the dense model (the Q4_1 dequantized demo has a few
    hundred per matrix) and that the mask keeps; under N:M every group of M has >= M-N zeros."""
    meta = json.loads((pruned_dir / "sparsekit.json").read_text())
    weights = load_weights(pruned_dir)
    bad, fracs, excess_total, min_group_zeros = [], [], 0, None
    for name, info in meta["layers"].items():
        w = weights[f"{name}.weight"]
        d = dense[f"{name}.weight"]
        if info.get("kind") == "conv1d":
            w, d = w.t(), d.t()
        zero, dzero = w == 0, d == 0
        numel = w.numel()
        if pattern == "unstructured":  # the whole matrix is one group: round(s * numel) zeros
            per, axis_len = int(round(sparsity * numel)), numel
            groups, gdzero = zero.reshape(1, 1, -1), (zero & dzero).reshape(1, 1, -1)
        else:
            n, m = (int(x) for x in pattern.split(":"))
            per, axis_len = m - n, m
            groups, gdzero = zero.reshape(w.shape[0], -1, m), (zero & dzero).reshape(w.shape[0], -1, m)
        gz = groups.sum(-1)
        want = gz.numel() * per
        excess = gz - per
        if int(gz.min()) < per:
            bad.append(f"{name}: a group of {axis_len} has only {int(gz.min())} zeros, want {per}")
        # a zero beyond the requested count must be a weight the dense model already had at zero
        unexplained = int((excess > gdzero.sum(-1)).sum())
        if unexplained:
            bad.append(f"{name}: {unexplained} groups hold more zeros than requested that were not zero before")
        zeros = int(zero.sum())
        excess_total += zeros - want
        if abs(info["sparsity"] - zeros / numel) > 1e-6:
            bad.append(f"{name}: sparsekit.json says {info['sparsity']}, weights say {zeros / numel}")
        if pattern != "unstructured":
            g = int(gz.min())
            min_group_zeros = g if min_group_zeros is None else min(min_group_zeros, g)
        fracs.append(zeros / numel)
    return {"layers": len(fracs), "min": min(fracs), "max": max(fracs), "min_group_zeros": min_group_zeros,
            "dense_zeros_kept": excess_total, "problems": bad, "ok": not bad and len(fracs) > 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib", default=None, help="calibration text (default: WikiText-2 validation lines)")
    ap.add_argument("--eval", default=None, help="evaluation text (default: the WikiText-2 test string)")
    add_demo_options(ap)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default="/tmp/sparsekit-acceptance")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from sparsekit.hf.data import eval_text
    from sparsekit.hf.models import resolve_model
    from sparsekit.pruning.api import prune
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    console = Console(width=140)
    calib = args.calib or wikitext_file(CALIB_FILE)
    text = eval_text(args.eval or wikitext_file(EVAL_FILE))
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    t0 = time.perf_counter()
    demo = Path(resolve_model("smollm2-135m"))
    console.print(f"demo model: {demo} (ready after {time.perf_counter() - t0:.1f} s); device {gpu}")
    dense_weights = load_weights(demo)

    def ppl_of(path) -> dict:
        r = perplexity_of(path, text, args)
        return r

    rows = []
    t = time.perf_counter()
    dense = ppl_of(demo)
    rows.append({"method": "dense", "pattern": "-", "ppl": dense["ppl"], "windows": dense["windows"],
                 "eval_s": time.perf_counter() - t})
    console.print(f"dense: ppl {dense['ppl']:.3f} over {dense['windows']} windows of {args.eval_seqlen}")
    for pattern, sparsity in PATTERNS:
        for method in args.methods.split(","):
            out = Path(args.out) / f"{method}-{pattern.replace(':', 'of')}"
            rep = prune("smollm2-135m", method=method, pattern=pattern, sparsity=sparsity, calib=calib,
                        nsamples=args.nsamples, seqlen=args.seqlen, seed=args.seed, device=args.device,
                        output=out, overwrite=True, warn=lambda m: console.print(f"[yellow]warning:[/] {m}"))
            check = check_sparsity(out, dense_weights, pattern, 0.5)
            t = time.perf_counter()
            r = ppl_of(out)
            rows.append({"method": method, "pattern": pattern, "ppl": r["ppl"], "windows": r["windows"],
                         "prune_s": rep.get("elapsed_s"), "eval_s": time.perf_counter() - t,
                         "overall_sparsity": rep.get("overall_sparsity"), "check": check})
            console.print(f"{method} {pattern}: ppl {r['ppl']:.3f}, pruned in {rep.get('elapsed_s', 0):.1f} s, "
                          f"{check['layers']} linears at {check['min']:.4f}..{check['max']:.4f} zeros "
                          f"({'ok' if check['ok'] else 'FAIL: ' + '; '.join(check['problems'][:3])})")

    orderings = {}
    for pattern, _ in PATTERNS:
        p = {r["method"]: r["ppl"] for r in rows if r["pattern"] == pattern}
        if all(m in p for m in METHODS):
            orderings[pattern] = p["sparsegpt"] < p["wanda"] < p["magnitude"]
    ok = all(orderings.values()) and len(orderings) == len(PATTERNS) and all(r["check"]["ok"] for r in rows[1:])

    table = Table(title=f"SmolLM2-135M (Q4_1 dequantized), WikiText-2 test ppl at seqlen {args.eval_seqlen} on {gpu}")
    for head in ("method", "pattern", "ppl", "linears pruned", "zeros per linear", "min zeros / group",
                 "dense zeros kept", "prune s"):
        table.add_column(head, justify="left" if head in ("method", "pattern") else "right")
    for r in rows:
        c = r.get("check")
        table.add_row(r["method"], r["pattern"], f"{r['ppl']:.2f}", str(c["layers"]) if c else "-",
                      (f"{c['min']:.4f}" if c["min"] == c["max"] else f"{c['min']:.4f}-{c['max']:.4f}") if c else "-",
                      str(c["min_group_zeros"]) if c and c["min_group_zeros"] is not None else "-",
                      str(c["dense_zeros_kept"]) if c else "-",
                      f"{r['prune_s']:.1f}" if r.get("prune_s") is not None else "-")
    console.print(table)
    for pattern, good in orderings.items():
        console.print(f"{pattern}: ppl(sparsegpt) < ppl(wanda) < ppl(magnitude): {'PASS' if good else 'FAIL'}")
    console.print(f"sparsity checks: {'PASS' if all(r['check']['ok'] for r in rows[1:]) else 'FAIL'}")
    result = {
        "gpu": gpu, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "settings": {k: v for k, v in vars(args).items()}, "calib": calib,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "rows": rows, "orderings": orderings, "ok": ok, "total_s": time.perf_counter() - t0,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    console.print(f"total {result['total_s']:.1f} s: {'ALL PASS' if ok else 'SOME CHECKS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
