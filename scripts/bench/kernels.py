"""Benchmark the TCA-BME kernels against cuBLAS, torch 2:4, cuSPARSE CSR and the byte floor.

Every timed call is captured in a CUDA graph (numba's eager launch costs 35-100 us, more than the
kernels run) that rotates over >= 4 copies of the weight (>= 200 MB in all, so the 50 MB L2 holds
none of it from one call to the next); the figure is the median over graph replays of the time per
call, from CUDA events. cuSPARSE CSR and 2:4 fall back to eager timing when they cannot be captured
(said in the table). The byte floor is the bytes a call must move (packed weight + x + y) over the
device-to-device copy bandwidth measured in the same run (bytes read + written / time).

    python -m scripts.bench.kernels [--quick] [--tune] [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F

from scripts.common import (copies_for, floats_arg, ints_arg, random_pruned, shapes_arg,
                             time_calls, weight_copies)

from sparsekit.runtime.timing import time_ms

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096),
          (576, 576), (192, 576), (1536, 576), (576, 1536)]
NS = [1, 8, 16, 32, 64]
SPARSITIES = [0.4, 0.5, 0.6, 0.7]


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of 20."""
    a = torch.empty(2**28, dtype=torch.uint8, device="cuda")   # 256 MiB
    b = torch.empty_like(a)
    return 2 * a.numel() / (time_ms(lambda: b.copy_(a), repeats=20, warmup=3) / 1e3)


def prune_24(w):
    """Keep the 2 largest of each 4 consecutive weights along K (for the 2:4 baseline)."""
    g = w.reshape(-1, 4)
    idx = g.abs().topk(2, dim=1).indices
    mask = torch.zeros_like(g, dtype=torch.bool).scatter_(1, idx, True)
    return (g * mask).reshape(w.shape)


def bench(shapes, ns, sparsities, tune: bool):
    from sparsekit.kernels import tcabme_matmul
    from sparsekit.packed.tcabme import encode

    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    rows = []
    for (m, k) in shapes:
        dense = random_pruned(m, k, 0.0, gen)
        nd = copies_for(dense.numel() * 2)
        dcopies = [dense.clone() for _ in range(nd)]
        semi = None
        try:
            from torch.sparse import to_sparse_semi_structured
            w24 = prune_24(dense)
            semi = [to_sparse_semi_structured(w24.clone()) for _ in range(nd)]
        except Exception as e:  # noqa: BLE001
            print(f"2:4 unavailable for {m}x{k}: {type(e).__name__}: {str(e)[:100]}")
        cublas = {}
        semi_t = {}
        for n in ns:
            x = torch.randn(n, k, device="cuda", generator=gen).half()
            ys = [torch.empty(n, m, device="cuda", dtype=torch.float16) for _ in range(nd)]
            calls = [lambda i=i: torch.matmul(x, dcopies[i].t(), out=ys[i]) for i in range(nd)]
            cublas[n] = time_calls(calls)[0]
            if semi is not None:
                try:
                    semi_t[n] = time_calls([lambda i=i: F.linear(x, semi[i]) for i in range(nd)])
                except Exception as e:  # noqa: BLE001
                    semi_t[n] = (float("nan"), f"fail:{type(e).__name__}")
        del dcopies, semi
        for sp in sparsities:
            w = random_pruned(m, k, sp, gen)
            p = encode(w)
            pcopies = weight_copies(p)
            npk = len(pcopies)
            csr = None
            try:
                csr = [w.to_sparse_csr() for _ in range(copies_for(int((w != 0).sum()) * 6))]
            except Exception as e:  # noqa: BLE001
                print(f"CSR unavailable: {e}")
            for n in ns:
                x = torch.randn(n, k, device="cuda", generator=gen).half()
                ys = [torch.empty(n, m, device="cuda", dtype=torch.float16) for _ in range(npk)]
                ours, _ = time_calls([lambda i=i: tcabme_matmul(x, pcopies[i], out=ys[i]) for i in range(npk)])
                extra = {}
                if tune:
                    extra["v4"] = time_calls(
                        [lambda i=i: tcabme_matmul(x, pcopies[i], out=ys[i], warp_kernel=False) for i in range(npk)])[0]
                    extra["warp"] = time_calls(
                        [lambda i=i: tcabme_matmul(x, pcopies[i], out=ys[i], warp_kernel=True) for i in range(npk)])[0]
                if tune and n <= 16:
                    for wb in (6, 8, 12, 16, 24):
                        for st in (2, 3):
                            try:
                                extra[f"w{wb}s{st}"] = time_calls(
                                    [lambda i=i: tcabme_matmul(x, pcopies[i], out=ys[i], warps=wb, stages=st)
                                     for i in range(npk)])[0]
                            except Exception as e:  # noqa: BLE001
                                print(f"w{wb}s{st}: {type(e).__name__}: {str(e)[:80]}")
                csr_t, csr_mode = float("nan"), "-"
                if csr is not None:
                    try:
                        xt = x.t().contiguous()
                        csr_t, csr_mode = time_calls([lambda i=i: torch.mm(csr[i], xt) for i in range(len(csr))], reps=5)
                    except Exception as e:  # noqa: BLE001
                        csr_mode = f"fail:{type(e).__name__}"
                moved = p.nbytes + x.numel() * 2 + n * m * 2
                floor = moved / bw * 1e6
                dense_floor = (m * k * 2 + x.numel() * 2 + n * m * 2) / bw * 1e6
                row = dict(m=m, k=k, sparsity=sp, n=n, ours_us=ours, cublas_us=cublas[n],
                           speedup=cublas[n] / ours, floor_us=floor, dense_floor_us=dense_floor,
                           pct_of_floor=floor / ours, semi24_us=semi_t.get(n, (float("nan"), "-"))[0],
                           semi24_mode=semi_t.get(n, (0, "-"))[1], csr_us=csr_t, csr_mode=csr_mode,
                           packed_bytes=p.nbytes, **extra)
                rows.append(row)
                ex = " ".join(f"{a}={b:.1f}" for a, b in extra.items())
                print(f"{m:>5}x{k:<5} sp={sp:.1f} N={n:<2} ours {ours:7.1f}us cuBLAS {cublas[n]:7.1f}us "
                      f"x{cublas[n] / ours:4.2f} floor {floor:6.1f}us ({floor / ours:4.0%}) "
                      f"2:4 {row['semi24_us']:7.1f} CSR {csr_t:8.1f}({csr_mode}) {ex}", flush=True)
            del pcopies, csr
    return bw, rows


def table(rows) -> str:
    lines = ["| M x K | sparsity | N | TCA-BME us | cuBLAS us | speedup | floor us | % of floor | 2:4 us | CSR us |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['m']}x{r['k']} | {r['sparsity']:.0%} | {r['n']} | {r['ours_us']:.1f} | "
                     f"{r['cublas_us']:.1f} | {r['speedup']:.2f}x | {r['floor_us']:.1f} | "
                     f"{r['pct_of_floor']:.0%} | {r['semi24_us']:.1f} | {r['csr_us']:.1f} |")
    return "\n".join(lines)


def compact_table(rows) -> str:
    """One line per (shape, sparsity): TCA-BME us and speedup over cuBLAS for each N, + baselines."""
    ns = sorted({r["n"] for r in rows})
    head = "| M x K | sparsity | " + " | ".join(f"N={n}: us (x cuBLAS)" for n in ns) + \
        " | cuBLAS us (N=1/16) | 2:4 us (N=1/16) | CSR us (N=1/16) | floor us (N=1) |"
    lines = [head, "|" + "---|" * (len(ns) + 6)]
    keys = []
    for r in rows:
        if (r["m"], r["k"], r["sparsity"]) not in keys:
            keys.append((r["m"], r["k"], r["sparsity"]))
    for m, k, sp in keys:
        by_n = {r["n"]: r for r in rows if (r["m"], r["k"], r["sparsity"]) == (m, k, sp)}
        cells = [f"{by_n[n]['ours_us']:.1f} ({by_n[n]['speedup']:.2f}x)" if n in by_n else "-" for n in ns]

        def pair(key):
            return "/".join(f"{by_n[n][key]:.1f}" if n in by_n else "-" for n in (1, 16))
        floor = f"{by_n[1]['floor_us']:.1f}" if 1 in by_n else "-"
        lines.append(f"| {m}x{k} | {sp:.0%} | " + " | ".join(cells) +
                     f" | {pair('cublas_us')} | {pair('semi24_us')} | {pair('csr_us')} | {floor} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4096x4096 and the demo shapes only")
    ap.add_argument("--tune", action="store_true", help="also time spmm.py (v4), spmm_warp forced, and warp x stage counts")
    ap.add_argument("--shapes", default=None, help="e.g. 4096x4096,576x576")
    ap.add_argument("--ns", default=None, help="e.g. 1,16")
    ap.add_argument("--sparsities", default=None, help="e.g. 0.5,0.7")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--render", default=None, help="print the compact markdown table of a saved JSON and exit")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            print(compact_table(json.load(f)["rows"]))
        return 0
    shapes = shapes_arg(args.shapes) or ([SHAPES[0], SHAPES[4], SHAPES[6]] if args.quick else SHAPES)
    ns = ints_arg(args.ns) or NS
    sps = floats_arg(args.sparsities) or SPARSITIES
    bw, rows = bench(shapes, ns, sps, args.tune)
    meta = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                torch=torch.__version__, copy_bw_TBps=bw / 1e12, command=" ".join(sys.argv))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(json.dumps(meta))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
