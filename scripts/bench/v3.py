"""Time spmm_v3 (issue 21) against cuBLAS and today's default TCA-BME kernel, same run.

Every timed call is captured in a CUDA graph that rotates over weight copies (>= 200 MB in all,
so L2 holds none of them between calls; scripts/common.py); the figure is the median
time per call over graph replays. x = cuBLAS time / ours. The issue's shapes and N in
{1, 8, 16, 32, 64, 128} at 50% and 70%; ``--sweep`` also times forced plans (strip rows per
block, K groups, tokens per block, stages: the knobs v3_plan has not been tuned on yet) on
SWEEP_SHAPES at 50% and N in SWEEP_NS, and prints the best per case. Writes bench_v3.json under --out ($OUT). About 4-7 minutes on an H100
with --sweep (numba compiles each variant once).

    python -m scripts.bench.v3 [--sweep] [--shapes 4096x4096] [--ns 1,64] [--kinds 0.5,0.7]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from scripts.common import (copies_for, ints_arg, kind_arg, masked_weight, save_results,
                             shapes_arg, time_calls, weight_copies)

SHAPES = [(4096, 4096), (22016, 4096), (4096, 11008), (28672, 8192), (8192, 28672)]
NS = [1, 8, 16, 32, 64, 128]
KINDS = [0.5, 0.7]
SWEEP = [dict(wr=1), dict(wr=2), dict(wr=4), dict(wr=8), dict(wr=4, ks=2), dict(wr=2, ks=16), dict(nt=128),
         dict(stages=3)]
# the sweep (numba compiles each forced plan once per token block count: ~2-3 s each) runs where it
# fits the 8-minute budget: these shapes, 50%, these token counts
SWEEP_SHAPES = [(4096, 4096), (22016, 4096)]
SWEEP_NS = (1, 16, 64, 128)


def bench(shapes, ns, kinds, sweep: bool):
    from sparsekit.kernels import tcabme_matmul
    from sparsekit.packed.tcabme import encode

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for (m, k) in shapes:
        dense = torch.randn(m, k, device="cuda", generator=gen).half()
        nd = copies_for(dense.numel() * 2)
        dcopies = [dense.clone() for _ in range(nd)]
        cublas = {}
        for n in ns:
            x = torch.randn(n, k, device="cuda", generator=gen).half()
            ys = [torch.empty(n, m, device="cuda", dtype=torch.float16) for _ in range(nd)]
            cublas[n] = time_calls([lambda i=i: torch.matmul(x, dcopies[i].t(), out=ys[i]) for i in range(nd)])[0]
        del dcopies, dense
        for kind in kinds:
            p = encode(masked_weight(m, k, kind, gen))
            pc = weight_copies(p)
            for n in ns:
                x = torch.randn(n, k, device="cuda", generator=gen).half()
                ys = [torch.empty(n, m, device="cuda", dtype=torch.float16) for _ in pc]

                def timed(**kw):
                    try:
                        return time_calls([lambda i=i: tcabme_matmul(x, pc[i], out=ys[i], **kw)
                                           for i in range(len(pc))])[0]
                    except Exception as e:  # noqa: BLE001 - a forced plan may not fit: say so, go on
                        print(f"    {kw}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                        return float("nan")

                base = timed()
                v3 = timed(kernel="v3")
                row = dict(m=m, k=k, kind=str(kind), n=n, cublas_us=cublas[n], default_us=base, v3_us=v3,
                           x_default=cublas[n] / base, x_v3=cublas[n] / v3, packed_bytes=p.nbytes)
                if sweep and (m, k) in SWEEP_SHAPES and kind == 0.5 and n in SWEEP_NS:
                    forced = {json.dumps(kw): timed(kernel="v3", **kw) for kw in SWEEP}
                    best = min(forced, key=lambda s: forced[s] if forced[s] == forced[s] else 1e30)
                    row.update(sweep=forced, best=best, x_best=cublas[n] / forced[best])
                rows.append(row)
                extra = f" best {row['best']} x{row['x_best']:.2f}" if "best" in row else ""
                print(f"{m:>5}x{k:<5} {kind!s:>4} N={n:<3} cuBLAS {cublas[n]:7.1f}us default {base:7.1f}us "
                      f"(x{cublas[n] / base:4.2f}) v3 {v3:7.1f}us (x{cublas[n] / v3:4.2f}){extra}", flush=True)
            del pc, p
    return rows


def table(rows) -> str:
    ns = sorted({r["n"] for r in rows})
    lines = ["| weight | mask | " + " | ".join(f"N={n}" for n in ns) + " |", "|---|---|" + "---|" * len(ns)]
    keys = list(dict.fromkeys((r["m"], r["k"], r["kind"]) for r in rows))
    for m, k, kind in keys:
        by_n = {r["n"]: r for r in rows if (r["m"], r["k"], r["kind"]) == (m, k, kind)}
        cells = [f"{by_n[n]['x_v3']:.2f} ({by_n[n]['x_default']:.2f})" if n in by_n else "-" for n in ns]
        lines.append(f"| {m}x{k} | {kind} | " + " | ".join(cells) + " |")
    return "x cuBLAS: v3 (default kernel)\n" + "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time forced v3 plans")
    ap.add_argument("--shapes", default=None, help="e.g. 4096x4096,22016x4096")
    ap.add_argument("--ns", default=None, help="e.g. 1,64")
    ap.add_argument("--kinds", default=None, help="masks, e.g. 0.5,0.7,2:4,hybrid")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows = bench(shapes_arg(args.shapes) or SHAPES, ints_arg(args.ns) or NS, kind_arg(args.kinds) or KINDS, args.sweep)
    print(json.dumps(save_results(args.out, "bench_v3.json", rows)))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
