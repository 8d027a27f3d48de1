"""GPU check of the runtime (run through the device tool; needs a CUDA GPU).

1. Correctness: a random Llama (fp16, 50% magnitude-pruned per row) written as an HF dir, packed
   with ``sparsekit.packed.encoding.encode`` and loaded with ``load_packed(device="cuda")`` (falls back to
   swapping in ``SparseLinear`` in memory while packing is unavailable). Logits vs the dense
   pruned model, relative error < 1e-2, both at decode size (N <= dense_above tokens: the bundled
   kernel) and at prefill size (above: the decode kernel + cuBLAS). The decode kernel is checked
   bit-exact against ``tcabme.decode`` on 7B shapes. Outputs of the kernel path are poisoned first.
2. CUDA graphs vs eager: the same greedy tokens, packed model and dense model.
3. The prefill threshold: per N, time the kernel and decode + cuBLAS on 7B shapes at 50%
   (4 rotated weight copies, CUDA events, medians; decode = what SparseLinear runs, the decode
   kernel) and print the crossover, which becomes ``SparseLinear.dense_above``.

    python -m scripts.checks.gpu_runtime [--skip-threshold] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from scripts.common import save_stub_tokenizer
from sparsekit.runtime.timing import time_ms as cuda_time_ms
from sparsekit.packed.tcabme import decode, decode_dense, encode
from sparsekit.runtime.sparse_linear import SparseLinear, kernel as sparse_kernel
from sparsekit.runtime.swap import sparsify
from scripts.common import cuda_or_exit

FAIL = []


def check(ok: bool, what: str) -> None:
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAIL.append(what)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def prune_rows_(w: torch.Tensor, sparsity: float) -> None:
    """Zero the smallest-magnitude ``sparsity`` fraction of each row, in place."""
    k = int(w.shape[1] * sparsity)
    if k == 0:
        return
    thr = w.abs().float().kthvalue(k, dim=1, keepdim=True).values
    w.masked_fill_(w.abs().float() <= thr, 0)


def tiny_llama(hidden=1024, inter=2816, layers=4, vocab=8000, heads=16, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    # built like load_packed builds it (dtype at construction), so that the rotary frequencies
    # stay fp32: a model.half() would round them to fp16 and drift at long positions
    model = LlamaForCausalLM._from_config(cfg, dtype=torch.float16).to("cuda").eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2 and ".layers." in n:
                p.normal_(0, 0.05)
                prune_rows_(p.data, 0.5)
    return model


def packed_copy(model, tmp: Path):
    """The model through disk: save_pretrained -> packing.encode -> load_packed (or in-memory swap)."""
    try:
        from sparsekit.packed.encoding import encode as pack_dir
        from sparsekit.runtime.loader import load_packed
    except ImportError as e:
        print(f"note: packing unavailable ({e}); swapping SparseLinear in memory", flush=True)
        import copy

        m = copy.deepcopy(model)
        sparsify(m)
        return m, "in-memory sparsify"
    model.save_pretrained(tmp / "pruned")
    save_stub_tokenizer(tmp / "pruned", model.config.vocab_size)
    pack_dir(tmp / "pruned", tmp / "packed")
    return load_packed(tmp / "packed", device="cuda", dtype=torch.float16), "packing.encode + load_packed"


def check_correctness(results: dict) -> None:
    from sparsekit.runtime.decoder import GreedyDecoder

    dense = tiny_llama()
    with tempfile.TemporaryDirectory() as tmp:
        packed, how = packed_copy(dense, Path(tmp))
    n_sparse = sum(isinstance(m, SparseLinear) for m in packed.modules())
    print(f"packed model via {how}: {n_sparse} SparseLinear layers", flush=True)
    check(n_sparse == 7 * 4, f"all 28 decoder linears are SparseLinear (got {n_sparse})")
    gen = torch.Generator().manual_seed(1)
    for b, n in ((1, 1), (4, 1), (2, 16), (1, 64), (2, 200), (2, 300)):
        ids = torch.randint(0, 8000, (b, n), generator=gen).cuda()
        with torch.no_grad():
            ref = dense(ids).logits.float()
            out = packed(ids).logits.float()
        e = rel_err(out, ref)
        results.setdefault("logits_rel_err", {})[f"{b}x{n}"] = e
        check(bool(torch.isfinite(out).all()) and e < 1e-2, f"load_packed logits batch {b} x {n} tokens: rel err {e:.2e} < 1e-2")

    # one SparseLinear, kernel path, poisoned output buffer impossible to reuse: compare fresh calls
    lin = packed.model.layers[0].mlp.down_proj
    for n in (1, 8, 16, 32, 64):
        x = torch.randn(n, lin.in_features, device="cuda", dtype=torch.float16)
        y = torch.full((n, lin.out_features), float("nan"), device="cuda", dtype=torch.float16)
        y.copy_(lin(x))
        ref = x.double() @ decode(lin.packed).double().t()
        e = rel_err(y, ref)
        check(bool(torch.isfinite(y).all()) and e < 1e-2, f"SparseLinear N={n}: rel err vs float64 {e:.2e}")

    # above dense_above inside a compiled step replayed from a CUDA graph: the decode kernel through the op
    for n in (lin.dense_above + 1, 130):
        xs = torch.randn(n, lin.in_features, device="cuda", dtype=torch.float16)
        fn = torch.compile(lin, fullgraph=True, dynamic=False)
        fn(xs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ys = fn(xs)
        xs.copy_(torch.randn_like(xs))
        ys.fill_(float("nan"))
        graph.replay()
        e = rel_err(ys, xs.double() @ decode(lin.packed).double().t())
        check(bool(torch.isfinite(ys).all()) and e < 1e-2, f"SparseLinear N={n} compiled, graph-replayed (decode "
                                                           f"kernel in the op): rel err vs float64 {e:.2e}")

    # CUDA graphs vs eager: same greedy tokens
    from sparsekit.runtime.fusion import equalize_packed_sizes

    equalize_packed_sizes(packed)  # what a compiled decoder expects (one compiled layer for the stack)
    prompt = torch.randint(0, 8000, (4, 12), generator=gen).cuda()
    for label, m in (("packed", packed), ("dense", dense)):
        if label == "packed" and sparse_kernel() is None:
            print("note: no bundled kernel, the reference path cannot be captured: packed graph check skipped")
            continue
        toks = {}
        for use_graph in (False, True):
            dec = GreedyDecoder(m, 4, 12 + 24, use_graph=use_graph)
            toks[use_graph] = dec.generate(prompt, 24)
            toks[f"again{use_graph}"] = dec.generate(prompt, 24)  # reuse: cache reset, graph replayed
        same = torch.equal(toks[False], toks[True]) and torch.equal(toks[True], toks["againTrue"])
        check(same, f"{label}: CUDA-graph greedy tokens == eager tokens (24 new tokens, batch 4)")
        dec = GreedyDecoder(m, 4, 12 + 24, use_graph=True, compile=True)
        toks["compiled"] = dec.generate(prompt, 24)
        agree_c = float((toks["compiled"][:, 12:] == toks[False][:, 12:]).float().mean())
        results.setdefault("compiled_agreement", {})[label] = agree_c
        first4 = torch.equal(toks["compiled"][:, :16], toks[False][:, :16])
        check(dec.compile and not dec.notes and first4,
              f"{label}: compiled + graph decode ran compiled ({dec.notes or 'no notes'}), first 4 new tokens "
              f"== eager; agreement over 24: {agree_c:.3f} (fusion may change rounding later)")
        with torch.no_grad():
            hf = m.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        agree = float((hf[:, 12:] == toks[True][:, 12:]).float().mean())
        results.setdefault("hf_generate_agreement", {})[label] = agree
        print(f"{label}: agreement with HF generate (dynamic cache): {agree:.3f}", flush=True)


def check_measure_speed(results: dict, out_dir: Path | None) -> None:
    """The `sparsekit eval --speed` library path on a small packed model: report, table, plot."""
    from rich.console import Console

    from sparsekit.cli.render import plot_speed, speed_table
    from sparsekit.evaluation.speed import measure_speed
    from sparsekit.packed.encoding import encode as pack_dir

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny = tiny_llama(hidden=512, inter=1408, layers=4)
        tiny.save_pretrained(tmp / "pruned")
        save_stub_tokenizer(tmp / "pruned", tiny.config.vocab_size)
        pack_dir(tmp / "pruned", tmp / "packed")
        rep = measure_speed(tmp / "packed", batch_sizes=(1, 4), prompt_len=32, new_tokens=16, repeats=2)
        Console(width=220).print(speed_table(rep))
        png = plot_speed(rep, (out_dir or tmp) / "speed_smoke.png")
        ok = (len(rep["rows"]) == 2 and rep["sparse_layers"] > 0 and png.stat().st_size > 5000
              and all(r["ratio"].get("decode_tok_s", 0) > 0 for r in rep["rows"])
              and rep.get("measurement") == "interleaved"
              and all(rep["prefill_rounds"] <= len(r.get("paired", {}).get("prefill_x", [])) / rep["prefill_runs"]
                      <= rep["prefill_max_rounds"] for r in rep["rows"]))
        check(ok, f"measure_speed on a packed 4-layer model: rows, ratios, plot, paired rounds; "
                  f"compiled={rep.get('compiled')}, measurement={rep.get('measurement')}, notes={rep.get('notes')}")
        results["measure_speed_smoke"] = rep


def time_ms(fn) -> float:
    return cuda_time_ms(fn, repeats=20, warmup=1)


def measure_threshold(results: dict) -> None:
    kernel = sparse_kernel()
    if kernel is None:
        print("note: no bundled kernel: threshold not measured", flush=True)
        return
    from sparsekit.kernels.decode import tcabme_decode as dense_of   # what SparseLinear's prefill runs

    rows = []
    for (m, k) in ((4096, 4096), (11008, 4096), (4096, 11008)):
        copies = []
        for _ in range(4):
            w = torch.randn(m, k, device="cuda", dtype=torch.float16)
            prune_rows_(w, 0.5)
            copies.append(encode(w))
        it = {"i": 0}

        def nxt():
            it["i"] = (it["i"] + 1) % 4
            return copies[it["i"]]

        exact = all(torch.equal(dense_of(c).view(torch.int16), decode(c).view(torch.int16)) for c in copies[:2])
        check(exact, f"decode kernel == tcabme.decode, bit for bit, on {m}x{k}")
        t_dk = time_ms(lambda: dense_of(nxt()))
        t_dt = time_ms(lambda: decode(nxt()))
        t_dd = time_ms(lambda: decode_dense(nxt()))
        rows.append({"m": m, "k": k, "decode_kernel_ms": t_dk, "tcabme_decode_ms": t_dt, "decode_dense_ms": t_dd})
        print(f"{m}x{k}: decode kernel {t_dk:.3f} ms, tcabme.decode {t_dt:.3f} ms, decode_dense {t_dd:.3f} ms",
              flush=True)
        for n in (16, 32, 64, 96, 128, 256, 512, 1024, 2048):
            x = torch.randn(n, k, device="cuda", dtype=torch.float16)
            t_kernel = time_ms(lambda: kernel(x, nxt()))
            t_decode = time_ms(lambda: F.linear(x, dense_of(nxt())))
            rows.append({"m": m, "k": k, "n": n, "kernel_ms": t_kernel, "decode_cublas_ms": t_decode})
            print(f"{m}x{k} N={n:5d}: kernel {t_kernel:8.3f} ms   decode+cuBLAS {t_decode:8.3f} ms", flush=True)
    results["threshold_rows"] = rows
    # largest N up to which the kernel is faster on every shape
    best = 0
    for n in sorted({r["n"] for r in rows if "n" in r}):
        if all(r["kernel_ms"] <= r["decode_cublas_ms"] for r in rows if r.get("n") == n):
            best = n
        else:
            break
    results["dense_above"] = best
    print(f"kernel faster up to N = {best} on all shapes -> SparseLinear.dense_above", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-threshold", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cuda_or_exit("scripts.checks.gpu_runtime")
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    results: dict = {"gpu": torch.cuda.get_device_name()}
    try:
        check_correctness(results)
        check_measure_speed(results, args.json.parent if args.json else None)
        if not args.skip_threshold:
            measure_threshold(results)
    finally:
        results["failures"] = FAIL
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    print(f"{len(FAIL)} failure(s)" if FAIL else "all runtime checks passed", flush=True)
    return 1 if FAIL else 0


if __name__ == "__main__":
    raise SystemExit(main())
