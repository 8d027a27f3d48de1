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

    python scripts/bench_cats.py --mlp [--shapes 7b,8b] [--batch-sizes 1,2,4,8] [--json out.json]
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


def parts(ps, x, t, wsp):
    """ms of the CATS path's three launches alone (gate, up, down)."""
    from sparsekit.kernels import tcabme_matmul
    from sparsekit.kernels.cats import cats_down, cats_up

    out = {}
    copies = [c for c in _copies]
    g = [tcabme_matmul(x, c["pg"]) if wsp else F.linear(x, c["wg"]) for c in copies]
    h = [cats_up(gi, x, c["ru"] if wsp else c["wu"], t) for gi, c in zip(g, copies)]
    out["gate_ms"] = graph_ms_rotating([lambda c=c: tcabme_matmul(x, c["pg"]) if wsp else F.linear(x, c["wg"])
                                        for c in copies])
    out["up_ms"] = graph_ms_rotating([lambda gi=gi, c=c: cats_up(gi, x, c["ru"] if wsp else c["wu"], t)
                                      for gi, c in zip(g, copies)])
    out["down_ms"] = graph_ms_rotating([lambda hi=hi, c=c: cats_down(hi, c["rd"] if wsp else c["wdt"])
                                        for hi, c in zip(h, copies)])
    return out


_copies: list = []


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
            _copies[:] = copies
            for asp in (0.0, 0.5, 0.7):
                t = threshold_for(copies[0]["wg"], asp)
                for n in [int(v) for v in args.batch_sizes.split(",")]:
                    x = torch.randn(n, hidden, device="cuda", dtype=torch.float16)
                    ref, active = reference(x, copies[0]["wg"], copies[0]["wu"], copies[0]["wd"], t)
                    row = {"shape": shape, "weights": wsp, "act": asp, "n": n, "union_active": round(active, 3)}
                    ps = [paths(c, wsp) for c in copies]
                    for name in ps[0]:
                        if name != "cats":
                            continue
                        torch.cuda.synchronize()
                        y = ps[0][name](x, t)
                        row["err"] = rel_err(y, ref)
                    for name in ps[0]:
                        if name != "cats" and asp > 0:
                            row[name + "_ms"] = rows_cache[(shape, wsp, n, name)]
                            continue
                        ms = graph_ms_rotating([lambda p=p: p[name](x, t) for p in ps])
                        rows_cache[(shape, wsp, n, name)] = ms
                        row[name + "_ms"] = ms
                    row.update(parts(ps, x, t, wsp))
                    row["cats_vs_dense"] = row["dense_ms"] / row["cats_ms"]
                    if wsp:
                        row["cats_vs_sparse"] = row["sparse_ms"] / row["cats_ms"]
                    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
                          flush=True)
                    rows.append(row)
            del copies
            _copies.clear()
            torch.cuda.empty_cache()
    return rows


rows_cache: dict = {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mlp", action="store_true", help="the gated MLP alone")
    ap.add_argument("--shapes", default="7b,8b")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cats needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "argv": sys.argv}
    if args.mlp:
        result["mlp"] = bench_mlp(args)
    result["seconds"] = time.time() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
