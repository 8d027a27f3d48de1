"""End-to-end decode speed of a Llama-2-7B-shaped model at 50% sparsity vs dense (GPU only; ``--pattern 2:4``
or ``hybrid`` for issue 22's rows).

The model: 32 layers, hidden 4096, MLP 11008, 32 heads, vocab 32000, random fp16 weights made
directly on the GPU (normal, std 0.02), every decoder linear pruned 50% by magnitude per output
row. The dense model is timed first; then every decoder linear is encoded with
``sparsekit.packed.tcabme.encode`` on the GPU and swapped for ``SparseLinear``, the logits are checked
against the dense pruned model, and the sparse model is timed. Both use the same harness
(``sparsekit.evaluation.speed.measure_model``): eager prefill into a static KV cache, then greedy decode
steps replayed from a CUDA graph (``--eager`` to compare without graphs), each decoder layer of
the step run through torch.compile (``--no-compile``) and RMSNorm fused (``--hf-norms``), in
both models alike. ``--fuse-proj both`` (default) also measures the pair with q/k/v and gate/up
merged into one matmul each (after the unmerged pair); ``--overhead`` times a step whose linears
cost nothing. Random weights are fine for speed; the tokens are meaningless.

    python -m scripts.bench.e2e [--layers 32] [--batch-sizes 1,8,16,32] [--fuse-proj both] [--json out.json]

Target (issue 4): sparse decode tokens/s >= 1.4x dense at batch 1 and 16.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch


def build_model(layers: int, hidden: int, inter: int, heads: int, vocab: int, seed: int = 0):
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
                      tie_word_embeddings=False, rms_norm_eps=1e-5)
    with init_empty_weights(include_buffers=False):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for name, p in list(model.named_parameters()):
        if p.dim() == 1:  # RMSNorm weights
            t = torch.ones(p.shape, device="cuda", dtype=torch.float16)
        else:
            t = torch.empty(p.shape, device="cuda", dtype=torch.float16).normal_(0, 0.02, generator=gen)
        mod_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(mod_name), attr, torch.nn.Parameter(t, requires_grad=False))
    model.to("cuda")  # rotary buffers
    return model.eval()


def prune_(model, sparsity: float, pattern: str = "unstructured", seed: int = 0) -> None:
    """Every decoder linear: ``unstructured``, by magnitude per output row; ``2:4``, the 2 largest of every 4
    along K; ``hybrid``, random 64x64 tiles 2:4 (a share ``sparsity / 0.5`` of them), the rest dense."""
    from sparsekit.hf.modules import find_decoder_layers, find_linears

    stack_name, stack = find_decoder_layers(model)
    gen = torch.Generator(device="cuda").manual_seed(seed + 7)
    for _, mod in find_linears(stack, prefix=stack_name).items():
        w = mod.weight.data
        if pattern in ("2:4", "hybrid"):
            m, k = w.shape
            g = w.view(m, k // 4, 4)
            drop = g.abs().argsort(dim=-1)[..., :2]                     # the 2 smallest of each group
            pruned = g.clone().scatter_(-1, drop, 0).view(m, k)
            if pattern == "hybrid":
                tiles = torch.rand(-(-m // 64), -(-k // 64), device=w.device, generator=gen) < sparsity / 0.5
                sel = tiles.repeat_interleave(64, 0).repeat_interleave(64, 1)[:m, :k]
                pruned = torch.where(sel, pruned, w)
            w.copy_(pruned)
            continue
        k = int(w.shape[1] * sparsity)
        for i in range(0, w.shape[0], 2048):  # chunks keep the fp32 temporaries small
            blk = w[i:i + 2048]
            a = blk.abs().float()
            thr = a.kthvalue(k, dim=1, keepdim=True).values
            blk.masked_fill_(a <= thr, 0)


class FreeLinear(torch.nn.Module):
    """Stands in for a linear at no cost (an uninitialised output): times everything else."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def forward(self, x):
        return x.new_empty(*x.shape[:-1], self.out_features)


def overhead_probe(model, batches, kw, skip_hf: bool = False) -> dict:
    """Decode step time with every decoder linear made free, norms as HF wrote them and fused."""
    from sparsekit.evaluation.speed import measure_model
    from sparsekit.hf.modules import find_decoder_layers, find_linears
    from sparsekit.runtime.fusion import fuse_rms_norms

    stack_name, stack = find_decoder_layers(model)
    saved = find_linears(stack, prefix=stack_name)
    norms = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}

    def put(mapping):
        for name, mod in mapping.items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, mod)

    put({n: FreeLinear(m.out_features) for n, m in saved.items()})
    out = {}
    for label in ("hf_norms", "fused_norms", "compiled")[1 if skip_hf else 0:]:
        if label == "fused_norms":
            fuse_rms_norms(model)
        for b in batches:
            r = measure_model(model, b, **{**kw, "compile": label == "compiled"})
            out[f"{label}_b{b}_ms"] = r.get("ms_per_token")
            print(f"overhead ({label}, linears free) b={b}: {r.get('ms_per_token')} ms/step", flush=True)
    put(saved)
    put(norms)
    return out


def _table(rows, dk: str, sk: str) -> list[str]:
    out = [f"| batch | dense tok/s | sparse tok/s | speedup | dense ms/tok | sparse ms/tok | "
           f"dense prefill tok/s | sparse prefill tok/s | prefill x | peak GiB dense / sparse |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        d, s = r[dk], r[sk]
        if "decode_tok_s" not in s or "decode_tok_s" not in d:
            out.append(f"| {r['batch_size']} | {d} | {s} |")
            continue
        out.append(f"| {r['batch_size']} | {d['decode_tok_s']:.0f} | {s['decode_tok_s']:.0f} | "
                   f"{s['decode_tok_s'] / d['decode_tok_s']:.2f}x | {d['ms_per_token']:.2f} | {s['ms_per_token']:.2f} | "
                   f"{d['prefill_tok_s']:.0f} | {s['prefill_tok_s']:.0f} | {s['prefill_tok_s'] / d['prefill_tok_s']:.2f}x | "
                   f"{d['peak_mem_gib']:.1f} / {s['peak_mem_gib']:.1f} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--sparsity", type=float, default=0.5, help="hybrid: the overall sparsity (0.35: 70%% of tiles 2:4)")
    ap.add_argument("--pattern", choices=("unstructured", "2:4", "hybrid"), default="unstructured",
                    help="2:4 and hybrid layers may take the 2:4 kernel where it measures faster (--prefer speed; "
                         "on here without SPARSEKIT_SP24)")
    ap.add_argument("--batch-sizes", default="1,8,16,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (both models)")
    ap.add_argument("--hf-norms", action="store_true", help="keep HF's RMSNorm (default: fused, both models)")
    ap.add_argument("--no-compile", action="store_true", help="decode steps not torch.compile-d (both models)")
    ap.add_argument("--fuse-proj", choices=("on", "off", "both"), default="both",
                    help="merge q/k/v and gate/up into one matmul each (both models); 'both' measures each way")
    ap.add_argument("--overhead", action="store_true", help="also time a step whose linears cost nothing")
    ap.add_argument("--prefer", choices=("none", "speed", "memory"), default="none",
                    help="runtime.dispatch plan applied to the sparse model before it is timed (none: every "
                         "sparse layer runs its kernel up to dense_above tokens, as before)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: bench_e2e runs on a GPU machine", file=sys.stderr)
        return 2
    os.environ.setdefault("SPARSEKIT_STRICT", "1")  # a compile or graph fallback fails the run, not the numbers
    from sparsekit.evaluation.speed import measure_model
    from sparsekit.runtime.timing import model_bytes
    from sparsekit.runtime.fusion import equalize_packed_sizes, fuse_projections, fuse_rms_norms
    from sparsekit.runtime.dispatch import TOKEN_COUNTS, plan_dispatch
    from sparsekit.runtime.sparse_linear import SparseLinear, kernel
    from sparsekit.runtime.swap import densify, sparsify

    batches = [int(b) for b in args.batch_sizes.split(",")]
    graphs = not args.eager
    compile_ = not args.no_compile
    kw = dict(prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats, cuda_graphs=graphs,
              compile=compile_)
    gpu = torch.cuda.get_device_name()
    print(f"GPU {gpu}; torch {torch.__version__}; kernel available: {kernel() is not None}", flush=True)

    t0 = time.perf_counter()
    model = build_model(args.layers, args.hidden, args.intermediate, args.heads, args.vocab)
    if args.pattern == "2:4":
        args.sparsity = 0.5
    prune_(model, args.sparsity, args.pattern)
    torch.cuda.synchronize()
    print(f"built + pruned in {time.perf_counter() - t0:.1f} s; weights {model_bytes(model) / 2**30:.2f} GiB", flush=True)

    gen = torch.Generator().manual_seed(1)
    probe = torch.randint(0, args.vocab, (2, 100), generator=gen).cuda()
    with torch.no_grad():
        ref_small = model(probe[:, :8]).logits.float()  # N = 16 tokens: kernel path
        ref_big = model(probe).logits.float()            # N = 200 tokens: prefill path
    errs = {}

    def check_logits(label):
        with torch.no_grad():
            for name, ids, ref in (("N=16", probe[:, :8], ref_small), ("N=200", probe, ref_big)):
                out = model(ids).logits.float()
                errs[f"{label} {name}"] = float((out - ref).norm() / ref.norm())
        print(f"logits rel err vs dense pruned: {errs}", flush=True)

    plans = {}

    def plan(label):
        if args.prefer == "none":
            return
        t = time.perf_counter()
        plans[label] = plan_dispatch(model, prefer=args.prefer, token_counts=sorted(set(TOKEN_COUNTS) | set(batches)),
                                     sp24=args.pattern != "unstructured")
        sizes[label] = model_bytes(model) / 2**30
        print(f"dispatch ({args.prefer}) in {time.perf_counter() - t:.1f} s: "
              + "; ".join(f"{g['shape'][0]}x{g['shape'][1]} {g['form']}" for g in plans[label]["groups"])
              + (f"; 2:4 layouts {plans[label]['sp24_layout_bytes'] / 2**30:.2f} GiB" if plans[label].get("sp24_layout_bytes") else "")
              + f"; weights {sizes[label]:.2f} GiB", flush=True)
        check_logits(f"{label} planned")

    def measure(label):
        res = {}
        for b in batches:
            res[b] = measure_model(model, b, **kw)
            print(f"{label} b={b:3d}: {res[b]}", flush=True)
        return res

    sizes = {"dense": model_bytes(model) / 2**30}
    overhead = (overhead_probe(model, [b for b in batches if b in (1, 16)] or batches[:1], kw, skip_hf=True)
                if args.overhead else None)
    if not args.hf_norms:
        print(f"fused {fuse_rms_norms(model)} RMSNorm modules (both models)", flush=True)
    results = {}
    if args.fuse_proj == "on":
        print(f"merged {fuse_projections(model)} projection groups (both models)", flush=True)
    if args.fuse_proj in ("off", "both"):
        results["dense"] = measure("dense")

    t0 = time.perf_counter()
    swapped = sparsify(model, min_sparsity=min(0.3, args.sparsity - 0.05))
    if compile_:
        pad = equalize_packed_sizes(model)  # before any kernel call (see its docstring)
        print(f"packed values padded by {100 * pad:.3f}% to equal sizes per shape", flush=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    enc_s = time.perf_counter() - t0
    sizes["sparse"] = model_bytes(model) / 2**30
    print(f"encoded {len(swapped)} linears in {enc_s:.1f} s; weights {sizes['sparse']:.2f} GiB", flush=True)
    check_logits("sparse")
    if args.fuse_proj in ("off", "both"):
        plan("sparse")
        results["sparse"] = measure("sparse")
    if args.fuse_proj == "both":
        print(f"merged {fuse_projections(model)} projection groups (both models)", flush=True)
        if compile_:
            equalize_packed_sizes(model)
        check_logits("sparse fused")
    if args.fuse_proj in ("on", "both"):
        plan("sparse_fused")
        results["sparse_fused"] = measure("sparse_fused")
        densify(model)
        torch.cuda.empty_cache()
        results["dense_fused"] = measure("dense_fused")
    del model
    torch.cuda.empty_cache()

    pairs = [(d, s) for d, s in (("dense", "sparse"), ("dense_fused", "sparse_fused")) if d in results and s in results]
    rows = []
    for b in batches:
        row = {"batch_size": b, **{k: v[b] for k, v in results.items()}}
        for d, s in pairs:
            if "decode_tok_s" in row[d] and "decode_tok_s" in row[s]:
                row[f"decode_speedup_{s}"] = row[s]["decode_tok_s"] / row[d]["decode_tok_s"]
        rows.append(row)
    report = {
        "gpu": gpu, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m scripts.bench.e2e " + " ".join(sys.argv[1:]),
        "shape": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                  "heads": args.heads, "vocab": args.vocab},
        "sparsity": args.sparsity, "pattern": args.pattern, "cuda_graphs": graphs, "kernel": kernel() is not None,
        "weights_gib": sizes, "encode_s": enc_s, "fused_norms": not args.hf_norms, "compile": compile_,
        "fuse_proj": args.fuse_proj, "overhead_ms": overhead, "logits_rel_err": errs, "rows": rows,
        "dense_above": SparseLinear.dense_above, "prefer": args.prefer, "dispatch": plans,
        "versions": {"torch": torch.__version__},
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    met = {}
    for d, s in pairs:
        print(f"\n{s} vs {d} (decode: CUDA graphs{', compiled layers' if compile_ else ''}"
              f"{', fused norms' if not args.hf_norms else ''})")
        print("\n".join(_table(rows, d, s)))
        met[s] = all(r.get(f"decode_speedup_{s}", 0) >= 1.4 for r in rows if r["batch_size"] in (1, 16))
    print(f"\nTARGET >= 1.4x at batch 1 and 16: " + ", ".join(f"{k}: {'MET' if v else 'NOT MET'}" for k, v in met.items()),
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
