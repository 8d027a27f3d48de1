"""CATS speed on a GPU: the gated MLP alone (``--mlp``) and end to end (``--e2e``), against dense.

MLP alone, per shape (Llama-2-7B: hidden 4096, MLP 11008; Llama-3-8B / Mistral-7B: 4096, 14336),
random fp16 weights (std 0.02) and tokens; thresholds set from 4096 random tokens so that each
token's activation sparsity is the target (the union over a batch is reported: independent random
tokens share few inactive neurons, real text shares more). Paths, each in a CUDA graph over
several weight copies (the copies outsize the L2):

* ``dense``       cuBLAS: fused gate/up matmul, SiLU * up, down (what the runtime runs dense);
* ``sparse``      the same with the weights 50% pruned and TCA-BME kernels (weight sparsity alone);
* ``cats``        gate (cuBLAS, or the TCA-BME kernel for pruned weights), then ``cats_up`` and
                  ``cats_down`` (dense rows, or row-packed rows for pruned weights).

Every path is first checked against a float64 reference on poisoned outputs. End to end: a
Llama-shaped model with random weights and thresholds, decoded by ``sparsekit.evaluation.speed``'s
harness, dense vs CATS (and weight-sparse vs weight-sparse + CATS).

    python -m scripts.bench.cats --mlp [--shapes 7b,8b] [--batch-sizes 1,2,4,8] [--json out.json]
    python -m scripts.bench.cats --e2e [--e2e-shape 7b] [--batch-sizes 1,2,4,8] [--max-tokens 1]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {"7b": (4096, 11008), "8b": (4096, 14336), "demo": (576, 1536)}


def rel_err(y, ref) -> float:
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def reference(x, wg, wu, wd, t):
    a = F.silu(F.linear(x, wg).double()).half()   # the gate in fp16, as every path computes it
    a = a.masked_fill(a.abs() < t.half(), 0)
    h = (a.double() * (x.double() @ wu.double().t()).half().double()).half()
    return h.double() @ wd.double().t(), (a != 0).any(0).float().mean().item()


def threshold_for(wg, sparsity, n=4096):
    if sparsity <= 0:
        return torch.zeros(1, device=wg.device)
    x = torch.randn(n, wg.shape[1], device=wg.device, dtype=torch.float16)
    a = F.silu(F.linear(x, wg)).float().abs().flatten()
    idx = torch.randint(a.numel(), (1 << 22,), device=a.device)
    return torch.quantile(a[idx], sparsity).reshape(1)


def prune(w, sparsity, gen):
    keep = torch.rand(w.shape, device=w.device, generator=gen) >= sparsity
    return torch.where(keep, w, torch.zeros_like(w))


def build(hidden, inter, wsp, copies, seed=0):
    from sparsekit.kernels.cats import tile_down
    from sparsekit.packed.rowpack import rowpack
    from sparsekit.packed.tcabme import encode

    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(copies):
        ws = [torch.empty(s, device="cuda", dtype=torch.float16).normal_(0, 0.02, generator=gen)
              for s in ((inter, hidden), (inter, hidden), (hidden, inter))]
        if wsp:
            ws = [prune(w, wsp, gen) for w in ws]
        wg, wu, wd = ws
        c = {"wg": wg, "wu": wu, "wd": wd, "wgu": torch.cat([wg, wu]), "wdt": tile_down(wd.t().contiguous())}
        if wsp:
            c.update(pg=encode(wg), pgu=encode(c["wgu"]), pd=encode(wd), ru=rowpack(wu), rd=rowpack(wd.t().contiguous()))
        out.append(c)
    return out


def paths(c, wsp):
    from sparsekit.kernels import tcabme_matmul
    from sparsekit.kernels.cats import cats_down, cats_up

    inter = c["wg"].shape[0]

    def dense(x, t):
        gu = F.linear(x, c["wgu"])
        return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], c["wd"])

    def sparse(x, t):
        gu = tcabme_matmul(x, c["pgu"])
        return tcabme_matmul((F.silu(gu[:, :inter]) * gu[:, inter:]).contiguous(), c["pd"])

    def cats(x, t):
        g = tcabme_matmul(x, c["pg"]) if wsp else F.linear(x, c["wg"])
        h = cats_up(g, x, c["ru"] if wsp else c["wu"], t)
        return cats_down(h, c["rd"] if wsp else c["wdt"])

    out = {"dense": dense, "cats": cats}
    if wsp:
        out["sparse"] = sparse
    return out


def rows_ok(wsp: float, n: int) -> bool:
    """The row-packed kernels take 1 or 2 tokens."""
    from sparsekit.kernels.cats import token_bucket

    try:
        token_bucket(n, rows=bool(wsp))
        return True
    except ValueError:
        return False


def parts(copies, x, t, wsp):
    """ms of the CATS path's three launches alone (gate, up, down)."""
    from sparsekit.kernels import tcabme_matmul
    from sparsekit.kernels.cats import cats_down, cats_up

    out = {}
    g = [tcabme_matmul(x, c["pg"]) if wsp else F.linear(x, c["wg"]) for c in copies]
    h = [cats_up(gi, x, c["ru"] if wsp else c["wu"], t) for gi, c in zip(g, copies)]
    out["gate_ms"] = graph_ms_rotating([lambda c=c: tcabme_matmul(x, c["pg"]) if wsp else F.linear(x, c["wg"])
                                        for c in copies])
    out["up_ms"] = graph_ms_rotating([lambda gi=gi, c=c: cats_up(gi, x, c["ru"] if wsp else c["wu"], t)
                                      for gi, c in zip(g, copies)])
    out["down_ms"] = graph_ms_rotating([lambda hi=hi, c=c: cats_down(hi, c["rd"] if wsp else c["wdt"])
                                        for hi, c in zip(h, copies)])
    return out


def graph_ms_rotating(fns, repeats=30):
    """ms of one call, from a CUDA graph calling each of ``fns`` once (different weight copies)."""
    from sparsekit.runtime.timing import graph_ms

    return graph_ms(lambda: [f() for f in fns], repeats=repeats) / len(fns)


def bench_mlp(args) -> list[dict]:
    rows = []
    for shape in args.shapes.split(","):
        hidden, inter = SHAPES[shape]
        for wsp in (0.0, 0.5):
            copies = build(hidden, inter, wsp, args.copies)
            for asp in (0.0, 0.5, 0.7):
                t = threshold_for(copies[0]["wg"], asp)
                for n in [int(v) for v in args.batch_sizes.split(",") if rows_ok(wsp, int(v))]:
                    x = torch.randn(n, hidden, device="cuda", dtype=torch.float16)
                    ref, active = reference(x, copies[0]["wg"], copies[0]["wu"], copies[0]["wd"], t)
                    row = {"shape": shape, "weights": wsp, "act": asp, "n": n, "union_active": round(active, 3)}
                    ps = [paths(c, wsp) for c in copies]
                    row["err"] = rel_err(ps[0]["cats"](x, t), ref)   # checked before any timing
                    for name in ps[0]:
                        if name != "cats" and asp > 0:
                            row[name + "_ms"] = rows_cache[(shape, wsp, n, name)]
                            continue
                        ms = graph_ms_rotating([lambda p=p: p[name](x, t) for p in ps])
                        rows_cache[(shape, wsp, n, name)] = ms
                        row[name + "_ms"] = ms
                    row.update(parts(copies, x, t, wsp))
                    row["cats_vs_dense"] = row["dense_ms"] / row["cats_ms"]
                    if wsp:
                        row["cats_vs_sparse"] = row["sparse_ms"] / row["cats_ms"]
                    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
                          flush=True)
                    rows.append(row)
            del copies
            torch.cuda.empty_cache()
    return rows


rows_cache: dict = {}


def calibrate(model, sparsity: float, tokens: int = 512) -> dict[str, float]:
    """Per gated MLP: the ``sparsity``-quantile of |act(gate(x))| on random tokens."""
    from sparsekit.hf.modules import find_gated_mlps

    samples, hooks = {}, []
    for name, mlp in find_gated_mlps(model).items():
        hooks.append(mlp.act_fn.register_forward_hook(
            lambda m, i, o, name=name: samples.__setitem__(name, o.detach().abs().float().flatten())))
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device="cuda")
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return {n: float(torch.quantile(v[torch.randint(v.numel(), (1 << 20,), device=v.device)], sparsity))
            for n, v in samples.items()}


def bench_e2e(args) -> list[dict]:
    """Dense, CATS on dense weights, weight-sparse, and weight-sparse + CATS, each on a fresh model."""
    from scripts.bench.e2e import build_model, prune_

    from sparsekit.evaluation.speed import measure_model
    from sparsekit.runtime.cats import install_thresholds
    from sparsekit.runtime.cats_mlp import CatsMLP
    from sparsekit.runtime.dispatch import TOKEN_COUNTS, plan_dispatch
    from sparsekit.runtime.fusion import prepare_for_decode
    from sparsekit.runtime.swap import sparsify
    from sparsekit.runtime.timing import model_bytes

    hidden, inter = SHAPES[args.e2e_shape]
    batches = [int(v) for v in args.batch_sizes.split(",")]
    kw = dict(prompt_len=128, new_tokens=64, repeats=3, cuda_graphs=True, compile=not args.no_compile)
    configs = [(c.split(":")[0], float(c.split(":")[1]), float(c.split(":")[2])) for c in args.configs.split(",")]
    out = []
    for label, wsp, asp in configs:
        t0 = time.time()
        torch.manual_seed(0)
        model = build_model(args.layers, hidden, inter, 32, 32000)
        if wsp:
            prune_(model, wsp)
        if asp:
            install_thresholds(model, calibrate(model, asp))
        if wsp:
            sparsify(model, min_sparsity=0.3)
        done = prepare_for_decode(model, equalize=not args.no_compile)
        if wsp:
            plan_dispatch(model, prefer="speed", token_counts=sorted(set(TOKEN_COUNTS) | set(batches)))
        check = None
        if asp:   # the kernel path against the module's own path, one decode-sized forward
            ids = torch.randint(0, 32000, (1, 1), device="cuda")
            with torch.no_grad():
                CatsMLP.max_tokens = 0
                ref = model(ids).logits.float()
                CatsMLP.max_tokens = args.max_tokens
                got = model(ids).logits.float()
            check = float((got - ref).norm() / ref.norm())
        row = {"config": label, "weights": wsp, "act": asp, "cats_mlps": done.get("cats_mlps"),
               "weights_gib": round(model_bytes(model) / 2**30, 2), "logits_rel_err": check, "batches": {}}
        for b in batches if label != "cats70" else batches[:1]:
            r = measure_model(model, b, **kw)
            row["batches"][b] = {k: r.get(k) for k in ("decode_tok_s", "ms_per_token", "prefill_tok_s")}
        row["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)
        out.append(row)
        del model
        torch.cuda.empty_cache()
    base = {r["config"]: r for r in out}
    print("| config | " + " | ".join(f"b={b} tok/s (x dense)" for b in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    for r in out:
        cells = []
        for b in batches:
            d = base.get("dense", {}).get("batches", {}).get(b, {}).get("decode_tok_s")
            v = r["batches"].get(b, {}).get("decode_tok_s")
            cells.append(f"{v:.0f} ({v / d:.2f}x)" if v and d else "-")
        print(f"| {r['config']} | " + " | ".join(cells) + " |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mlp", action="store_true", help="the gated MLP alone")
    ap.add_argument("--shapes", default="7b,8b")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--e2e", action="store_true", help="end to end: a Llama-shaped model, decode speed")
    ap.add_argument("--e2e-shape", default="7b")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--configs", default="dense:0:0,cats50:0:0.5,cats70:0:0.7,sparse50:0.5:0,sparse50-cats50:0.5:0.5",
                    help="label:weight sparsity:activation sparsity, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=1, help="CatsMLP.max_tokens for the CATS configs")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cats needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "argv": sys.argv}
    if args.mlp:
        result["mlp"] = bench_mlp(args)
    if args.e2e:
        from sparsekit.runtime.cats_mlp import CatsMLP

        CatsMLP.max_tokens = args.max_tokens
        result["e2e"] = bench_e2e(args)
    result["seconds"] = time.time() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
