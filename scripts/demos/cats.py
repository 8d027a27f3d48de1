"""CATS on the demo model (SmolLM2-135M): perplexity at several activation sparsities, and stacked on
50% weight sparsity, dense and packed (issue 13's acceptance rows for docs/results.md).

Rows: dense; CATS 0%, 30%, 50%, 70% (weights unchanged); Wanda 50% + CATS 50%; SparseGPT 50% +
CATS 50%; and both combinations packed (``sparsekit encode``) and reloaded through the runtime loader.
Each checkpoint is made by ``sparsekit.prune`` (calibration: 128 windows of 512 tokens from the
WikiText-2 validation lines, seed 0) and scored by the code behind ``sparsekit eval --ppl`` (the
WikiText-2 test string, seqlen 2048, every window). Per row: the perplexity, its ratio to dense, the
activation sparsity each gated MLP reached on the calibration data (from sparsekit.json; checked to
be within 1% of the target, issue 13's acceptance) and on the evaluation text, and the exact
``sparsekit`` commands that reproduce the row.

    python -m scripts.demos.cats ../shared/data/wikitext-2-raw-v1 --device cuda --json out/demo_cats.json

Prints a markdown table (the commands listed under it) and, last, the JSON summary. Exit status 0
when every CATS row is within 1% of its target on the calibration data for every MLP.
``--smoke`` runs the same rows on a tiny random Llama and a synthetic text, on the CPU, in seconds.
``--speed`` (CUDA) adds ``eval --speed`` at batch 1 for cats50 and wanda50-cats50.tcabme: the CATS model
against dense, on the CATS kernels where ``sparsekit.runtime.cats_mlp`` provides them.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from scripts.common import CALIB_FILE, EVAL_FILE, add_demo_options, smoke_model, wikitext_file

TOLERANCE = 0.01  # achieved activation sparsity on the calibration data, per MLP, vs the target

# name, method, weight sparsity, CATS target (None: no CATS), packed
ROWS = (
    ("dense", None, None, None, False),
    ("cats0", "cats", 0.0, None, False),
    ("cats30", "cats", 0.3, None, False),
    ("cats50", "cats", 0.5, None, False),
    ("cats70", "cats", 0.7, None, False),
    ("wanda50-cats50", "wanda", 0.5, 0.5, False),
    ("sparsegpt50-cats50", "sparsegpt", 0.5, 0.5, False),
    ("wanda50-cats50.tcabme", "wanda", 0.5, 0.5, True),
    ("sparsegpt50-cats50.tcabme", "sparsegpt", 0.5, 0.5, True),
)


def spread(values) -> dict:
    vals = list(values)
    return {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals)} if vals else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wikitext", nargs="?", default=None, help="WikiText-2 raw folder (with "
                    f"{CALIB_FILE} and {EVAL_FILE}); default: the usual places")
    ap.add_argument("--model", default="smollm2-135m")
    add_demo_options(ap)
    ap.add_argument("--out", default="/tmp/sparsekit-demo-cats")
    ap.add_argument("--json", default=None, help="also write the JSON summary here")
    ap.add_argument("--smoke", action="store_true", help="tiny random Llama, synthetic text, CPU, small settings")
    ap.add_argument("--speed", action="store_true", help="also `eval --speed` (batch 1) on cats50 and "
                    "wanda50-cats50.tcabme: the CATS model against dense (CUDA only; about a minute each)")
    args = ap.parse_args()

    import torch
    from transformers.utils import logging as hf_logging

    from sparsekit.evaluation.ppl import perplexity_report
    from sparsekit.hf.models import resolve_model
    from sparsekit.packed.encoding import encode
    from sparsekit.pruning.api import prune

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    out = Path(args.out)
    t0 = time.perf_counter()
    if args.smoke:
        args.model, calib, evalf = smoke_model(out / "smoke")
        args.nsamples, args.seqlen, args.eval_seqlen, args.max_windows = 4, 64, 128, 4
        args.device = "cpu"
    else:
        calib, evalf = wikitext_file(CALIB_FILE, args.wikitext), wikitext_file(EVAL_FILE, args.wikitext)
    source = resolve_model(args.model)  # the demo conversion happens once, here
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"model {args.model} ({source}); device {gpu}; ready after {time.perf_counter() - t0:.1f} s", flush=True)

    def q(x) -> str:
        return shlex.quote(str(x))

    prune_flags = (f"--calib {q(calib)} --nsamples {args.nsamples} --seqlen {args.seqlen} --seed {args.seed} "
                   f"--device {args.device}")
    eval_flags = (f"--ppl --dataset {q(evalf)} --seqlen {args.eval_seqlen} --device {args.device}"
                  + (f" --max-windows {args.max_windows}" if args.max_windows else ""))
    warn = lambda m: print(f"warning: {m}", file=sys.stderr)  # noqa: E731

    rows, dense_ppl = [], None
    for name, method, sparsity, cats, packed in ROWS:
        t = time.perf_counter()
        target = cats if cats is not None else (sparsity if method == "cats" else None)
        row: dict = {"row": name, "method": method or "dense", "weight_sparsity": None if method == "cats" else sparsity,
                     "cats_target": target, "packed": packed}
        commands = []
        if method is None:
            path = args.model  # the alias, as the command says; resolved (converted) above
        else:
            pruned = out / name.removesuffix(".tcabme")
            flags = f"--method {method} --sparsity {sparsity:g}" + (f" --cats {cats:g}" if cats is not None else "")
            if not packed:  # the packed rows reuse the checkpoint of the row before them
                rep = prune(args.model, method=method, sparsity=sparsity, cats=cats, calib=calib,
                            nsamples=args.nsamples, seqlen=args.seqlen, seed=args.seed, device=args.device,
                            output=pruned, overwrite=True, warn=warn)
                row["prune_s"] = rep["elapsed_s"]
            commands.append(f"sparsekit prune {q(args.model)} {flags} {prune_flags} -o {q(pruned)}")
            meta = json.loads((pruned / "sparsekit.json").read_text())
            mlps = {n: r["activation_sparsity"] for n, r in meta["cats"]["mlps"].items()}
            row["calib_activation_sparsity"] = {**spread(mlps.values()), "mlps": mlps}
            row["calib_within_1pct"] = all(abs(v - target) <= TOLERANCE for v in mlps.values())
            if method != "cats":
                lay = meta["layers"]
                row["weight_zeros"] = spread(r["sparsity"] for r in lay.values())
            path = pruned
            if packed:
                path = out / name
                enc = encode(pruned, path, overwrite=True, warn=warn)
                row["packed_layers"] = enc["packed_layers"]
                commands.append(f"sparsekit encode {q(pruned)} -o {q(path)}")
        rep = perplexity_report(str(path), dataset=evalf, seqlen=args.eval_seqlen, max_windows=args.max_windows,
                                device=args.device, warn=warn)
        commands.append(f"sparsekit eval {q(path)} {eval_flags}")
        row.update(ppl=rep["ppl"], windows=rep["windows"], eval_s=rep["elapsed_s"], commands=commands)
        if "activation_sparsity" in rep:
            a = rep["activation_sparsity"]
            row["eval_activation_sparsity"] = {**spread(a["mlps"].values()), "mlps": a["mlps"]}
        if method is None:
            dense_ppl = rep["ppl"]
        row["x_dense"] = rep["ppl"] / dense_ppl if dense_ppl else None
        row["row_s"] = time.perf_counter() - t
        rows.append(row)
        calib_s = row.get("calib_activation_sparsity", {})
        print(f"{name}: ppl {rep['ppl']:.3f} ({rep['windows']} windows)"
              + (f", calibration act. sparsity {calib_s['min']:.4f}..{calib_s['max']:.4f}" if calib_s else "")
              + f", {row['row_s']:.1f} s", flush=True)

    for packed in (r for r in rows if r["packed"]):  # the packed model against its unpacked checkpoint
        twin = next(r for r in rows if r["row"] == packed["row"].removesuffix(".tcabme"))
        packed["ppl_vs_unpacked"] = packed["ppl"] / twin["ppl"]

    def pct(x) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    def act(r, key) -> str:
        s = r.get(key)
        return f"{s['mean']:.4f} ({s['min']:.4f}-{s['max']:.4f})" if s else "-"

    print()
    print(f"SmolLM2-135M, WikiText-2 test perplexity at seqlen {args.eval_seqlen} on {gpu}; calibration "
          f"{args.nsamples} x {args.seqlen} tokens, seed {args.seed}" if not args.smoke else "smoke run (tiny random Llama)")
    print()
    print("| row | weights | CATS | packed | ppl | x dense | act. sparsity, calibration: mean (min-max) "
          "| act. sparsity, eval text: mean (min-max) | commands (below) |")
    print("|---|---|---|---|---:|---:|---|---|---|")
    for i, r in enumerate(rows, 1):
        weights = "dense" if r["method"] in ("dense", "cats") else f"{r['method']} {pct(r['weight_sparsity'])}"
        print(f"| {r['row']} | {weights} | {pct(r['cats_target'])} | {'yes' if r['packed'] else 'no'} | "
              f"{r['ppl']:.2f} | {r['x_dense']:.3f} | {act(r, 'calib_activation_sparsity')} | "
              f"{act(r, 'eval_activation_sparsity')} | {i} |")
    print()
    for i, r in enumerate(rows, 1):
        print(f"{i}. `" + " && ".join(r["commands"]) + "`")
    checked = [r for r in rows if "calib_within_1pct" in r]
    ok = bool(checked) and all(r["calib_within_1pct"] for r in checked)
    print()
    print(f"activation sparsity on the calibration data within {TOLERANCE:.0%} of the target for every MLP "
          f"of every CATS row: {'PASS' if ok else 'FAIL'}")
    speed = {}
    if args.speed and not args.device.startswith("cuda"):
        print("--speed needs --device cuda: skipped")
    elif args.speed:
        from sparsekit.evaluation.speed import measure_speed

        for name in ("cats50", "wanda50-cats50.tcabme"):
            try:
                rep = measure_speed(out / name, batch_sizes=(1,), new_tokens=32, repeats=2)
            except Exception as e:  # a report line, not a lost table
                speed[name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"speed {name}: FAILED {speed[name]['error']}")
                continue
            r = rep["rows"][0]
            speed[name] = {"decode_x_dense": r["ratio"].get("decode_tok_s"), "ms_per_token": r["packed"].get("ms_per_token"),
                           "dense_ms_per_token": r["dense"].get("ms_per_token"), "sparse_layers": rep["sparse_layers"],
                           "cats_mlps": rep["cats_mlps"], "cats_kernel_mlps": rep["cats_kernel_mlps"], "notes": rep["notes"]}
            print(f"speed {name} (batch 1): decode {speed[name]['decode_x_dense']}x dense, {rep['cats_kernel_mlps']} of "
                  f"{rep['cats_mlps']} CATS MLPs on the kernel; notes: {rep['notes']}")
    summary = {
        "gpu": gpu, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model,
        "settings": {k: v for k, v in vars(args).items()}, "calib": calib, "eval": evalf,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "rows": rows, "speed": speed, "ok": ok, "total_s": time.perf_counter() - t0,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    brief_rows = []
    for r in rows:  # the printout: per-MLP figures as a list in layer order (by name in --json)
        b = {k: v for k, v in r.items() if k != "commands"}
        for key in ("calib_activation_sparsity", "eval_activation_sparsity"):
            if key in r:
                b[key] = {k: round(v, 5) for k, v in r[key].items() if k != "mlps"}
                b[key]["per_mlp"] = [round(v, 4) for v in r[key]["mlps"].values()]
        brief_rows.append(b)
    print(json.dumps({**summary, "rows": brief_rows}, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
