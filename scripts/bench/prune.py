"""Pruning speed on random-weight models of real shapes (GPU).

    python -m scripts.bench.prune --shape llama2-7b --methods wanda sparsegpt --json out.json
    python -m scripts.bench.prune --shape smollm2-135m --methods magnitude wanda sparsegpt
    python -m scripts.bench.prune --disk --compare llama2-7b:4 --stream llama2-70b:8   # streamed pruning
    python -m scripts.bench.prune --shape llama2-7b --methods sparsegpt admm wanda wanda+owl sparsegpt+owl \
        wanda+dsnot sparsegpt+admm --ratios     # issue 23: the new methods against SparseGPT, OWL against its base

A method spec is a method name with optional ``+owl`` (OWL allocation), ``+dsnot`` (--refine dsnot) and
``+admm`` (--update admm); ``--ratios`` prints each spec's time over sparsegpt's and OWL's over its base.

With ``--disk`` (see ``disk_bench``) a random-weight fp16 checkpoint of the first N layers of a
shape is written to disk first and pruned from there: ``--compare SHAPE:N`` prunes it in memory
(from_pretrained, prune, save_pretrained) and streamed (``--offload disk``), ``--stream SHAPE:N``
streamed only; the times of the N layers are extrapolated to the full depth and say so.

The model is built fast: on the meta device, then ``to_empty`` on the CPU and filled with random
fp16 values generated on the GPU layer by layer (HF's own init would take minutes on 7B). The
calibration set is random token ids. Pruning time does not depend on the weight values: the same
matmuls, sorts and OBS sweeps run whatever the numbers are (only a Cholesky failure, which adds a
retry, could change it; the report counts those warnings).

The model stays in CPU memory; the engine moves one decoder layer at a time to the GPU, so the
peak GPU memory is one layer plus the calibration activations.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time

import torch

from scripts.common import SHAPES


def build_model(shape: str, dtype=torch.float16, seed: int = 0, layers: int | None = None):
    """A LlamaForCausalLM of the given shape with random weights, on the CPU (see module doc); ``layers``
    keeps only the first decoder layers (every layer of a shape does the same work)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).to_empty(device="cpu")
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers were left empty
    gen_dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=gen_dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights
                p.fill_(1.0)
                continue
            std = 1.0 if "embed" in name else 0.02
            for r0 in range(0, p.shape[0], 4096):  # chunks keep the GPU scratch small
                rows = p[r0:r0 + 4096]
                rows.copy_(torch.randn(rows.shape, generator=g, device=gen_dev, dtype=dtype).mul_(std))
    return model.eval()


def run_one(shape: str, method: str, pattern: str, nsamples: int, seqlen: int, device: str, batch_size=None,
            overlap: bool = True, layers: int | None = None) -> dict:
    from sparsekit.pruning.engine import prune_model
    from sparsekit.pruning.methods import get_method
    from sparsekit.pruning.methods.steps import with_steps
    from sparsekit.pruning.owl import OwlSettings
    from sparsekit.pruning.patterns import Pattern

    spec = method
    method, *extras = spec.split("+")
    meth = with_steps(get_method(method), update="admm" if "admm" in extras else None,
                      refine="dsnot" if "dsnot" in extras else None)
    owl = OwlSettings() if "owl" in extras else None

    t0 = time.perf_counter()
    model = build_model(shape, layers=layers)
    t_build = time.perf_counter() - t0
    vocab = model.config.vocab_size
    calib = (torch.randint(0, vocab, (nsamples, seqlen), generator=torch.Generator().manual_seed(0))
             if meth.needs_stats or owl is not None else None)
    warnings: list[str] = []
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    pat = Pattern.parse(pattern)
    rep = prune_model(model, calib, method=meth, sparsity=pat.resolve_sparsity(None), pattern=pat,
                      skip=["lm_head"], device=device, batch_size=batch_size, overlap=overlap,
                      warn=warnings.append, owl=owl)
    # the pruned values really landed in the CPU model (first and last layer)
    cpu_sparsity = [round(float((lay.mlp.down_proj.weight == 0).float().mean()), 4)
                    for lay in (model.model.layers[0], model.model.layers[-1])]
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    act_bytes = nsamples * seqlen * model.config.hidden_size * 2 if calib is not None else 0
    per = rep["per_layer"]
    phases: dict[str, float] = {}
    for r in per:
        for k, v in r["phases"].items():
            phases[k] = phases.get(k, 0.0) + v
    sp = [v["sparsity"] for v in rep["layers"].values()]
    out = {
        "shape": shape, "method": spec, "pattern": pattern, "nsamples": nsamples, "seqlen": seqlen,
        "layers": model.config.num_hidden_layers,
        "overlap": overlap,
        "build_s": round(t_build, 2),
        "total_s": round(rep["seconds"], 2),
        "capture_s": round(rep["capture_seconds"], 2),
        "per_layer_mean_s": round(sum(r["seconds"] for r in per) / len(per), 3),
        "per_layer_max_s": round(max(r["seconds"] for r in per), 3),
        "phase_totals_s": {k: round(v, 2) for k, v in phases.items()},
        "peak_gpu_mib": round((rep["peak_mem_bytes"] or 0) / 2**20),
        "layer_mib": round(layer_bytes / 2**20),
        "activations_mib": round(act_bytes / 2**20),
        "linears": len(sp), "min_sparsity": min(sp), "max_sparsity": max(sp),
        "cpu_down_proj_sparsity_first_last": cpu_sparsity,
        "warnings": len(warnings), "first_warning": warnings[0] if warnings else None,
    }
    del model
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=["smollm2-135m", "llama2-7b"])
    ap.add_argument("--methods", nargs="+", default=["wanda", "sparsegpt"])
    ap.add_argument("--pattern", default="unstructured")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None,
                    help="keep only the first N decoder layers of each shape (time ratios between methods hold per layer)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-overlap", action="store_true", help="move layers synchronously (no background copies)")
    ap.add_argument("--warmup", action="store_true", help="run the first (shape, method) once untimed first")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the methods this many times, interleaved (a, b, a, b, ...), and report each one's median "
                         "total_s (ratios of single runs move by +-10%% on a GPU)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--ratios", action="store_true", help="print each method's time over sparsegpt's and +owl's over its base")
    ap.add_argument("--disk", action="store_true", help="disk-backed mode: write checkpoints, prune them from disk")
    ap.add_argument("--compare", nargs="*", default=[], metavar="SHAPE:N", help="--disk: in memory vs streamed")
    ap.add_argument("--stream", nargs="*", default=[], metavar="SHAPE:N", help="--disk: streamed only")
    ap.add_argument("--workdir", default="bench-prune-work", help="--disk: where checkpoints are written (removed after)")
    ap.add_argument("--warm-cache", action="store_true", help="--disk: leave the written checkpoint in the page cache")
    ap.add_argument("--budget-s", type=float, default=None, help="--disk: skip runs that would end past this many seconds")
    ap.add_argument("--smoke", action="store_true", help="--disk: toy shape, 4 x 64 tokens, CPU (a test of the script)")
    args = ap.parse_args(argv)
    if args.disk:
        from scripts.bench.prune_disk import disk_bench

        return disk_bench(args)

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__, "python": platform.python_version(),
        "command": "python " + " ".join(sys.argv),
    }
    import transformers

    info["transformers"] = transformers.__version__
    print(json.dumps(info), flush=True)
    results = []
    if args.warmup:
        run_one(args.shape[0], args.methods[0], args.pattern, 8, min(args.seqlen, 512), args.device, args.batch_size,
                layers=args.layers)
    if args.repeats < 1:
        print("--repeats must be 1 or more", file=sys.stderr)
        return 2
    for shape in args.shape:
        runs: dict[str, list] = {m: [] for m in args.methods}
        for _ in range(args.repeats):
            for method in args.methods:
                r = run_one(shape, method, args.pattern, args.nsamples, args.seqlen, args.device, args.batch_size,
                            overlap=not args.no_overlap, layers=args.layers)
                print(json.dumps(r), flush=True)
                runs[method].append(r)
        for method, rs in runs.items():
            r = dict(rs[0])
            if len(rs) > 1:
                r["runs_total_s"] = [x["total_s"] for x in rs]
                r["total_s"] = round(statistics.median(r["runs_total_s"]), 3)
            results.append(r)
    if args.ratios:
        for r in results:
            same = {x["method"]: x["total_s"] for x in results if x["shape"] == r["shape"]}
            base = r["method"].replace("+owl", "")
            r["vs_sparsegpt"] = round(r["total_s"] / same["sparsegpt"], 3) if "sparsegpt" in same else None
            r["owl_vs_base"] = round(r["total_s"] / same[base], 3) if "+owl" in r["method"] and base in same else None
            print(json.dumps({k: r[k] for k in ("shape", "method", "total_s", "vs_sparsegpt", "owl_vs_base")}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
