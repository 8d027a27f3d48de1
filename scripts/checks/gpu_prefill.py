"""GPU check and timing of prefill on packed weights only (issue 21, item 2): each layer's weight decoded
in turn (the decode kernel, then cuBLAS) against cuBLAS on dense weights, and the decodes alone.

    python -m scripts.checks.gpu_prefill [--layers 2] [--ns 512,2048,4096] [--sparsity 0.5] [--out DIR]

The chain: ``--layers`` decoder layers of the 7B shapes (q, k, v, o 4096x4096; gate, up 11008x4096; down
4096x11008), random weights pruned at random positions, each linear fed a random ``[N, in]`` input (the
data flow between layers does not change the work). Eager calls, as prefill runs.

1. **Correctness**: three passes through the ``SparseLinear`` chain at every N; each output against
   cuBLAS on the decoded weight (relative error < 1e-3). Exits 1 on a failure, before timing.
2. **Timing** (median ms of a pass over the chain, CUDA events): dense cuBLAS, packed with the decode in
   turn (``SparseLinear``), and the decodes alone with their rate (packed bytes read plus dense bytes
   written, per second). ``x`` = dense / packed.

Session 12 (H100) measured a version that issued each decode one layer ahead on a side stream: it was
no faster than decoding in turn (0.29-0.76x against 0.32-0.78x dense at N = 512-4096), so it was
removed; the decode kernel's rate is what bounds this path (docs/kernels-notes.md "v15-prefill").
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from scripts.common import cuda_or_exit, ints_arg, random_pruned, save_results

SHAPES = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]


def build(layers: int, sparsity: float, gen):
    from torch import nn

    from sparsekit.runtime.sparse_linear import SparseLinear

    mods, dense = [], []
    for _ in range(layers):
        for m, k in SHAPES:
            lin = nn.Linear(k, m, bias=False, device="meta")
            lin.weight = nn.Parameter(random_pruned(m, k, sparsity, gen), requires_grad=False)
            mods.append(SparseLinear.from_linear(lin))
            dense.append(lin.weight.data)
    return mods, dense


def chain_ms(calls, reps: int = 5) -> float:
    times = []
    for r in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for c in calls:
            c()
        b.record()
        torch.cuda.synchronize()
        if r:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ns", default="512,2048,4096")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda_or_exit("gpu_prefill")
    from sparsekit.kernels.decode import padded_numel, tcabme_decode
    from sparsekit.runtime.sparse_linear import kernel

    if kernel() is None:
        print("the sparse kernels cannot run here", file=sys.stderr)
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    mods, dense = build(args.layers, args.sparsity, gen)
    decoded = [m.dense_weight(torch.float16) for m in mods]
    print(f"{torch.cuda.get_device_name()}: {len(mods)} linears, packed {sum(m.values.numel() * 2 + m.bitmaps.numel() * 8 for m in mods) / 2**30:.2f} GiB, "
          f"dense {sum(w.numel() * 2 for w in dense) / 2**30:.2f} GiB", flush=True)
    ns = ints_arg(args.ns)
    bad = 0
    for n in ns:
        xs = [torch.randn(n, m.in_features, device="cuda", generator=gen).half() for m in mods]
        refs = [F.linear(x, w) for x, w in zip(xs, decoded)]
        for p in range(3):
            outs = [m(x) for m, x in zip(mods, xs)]
            torch.cuda.synchronize()
            for i, (y, ref) in enumerate(zip(outs, refs)):
                err = float((y.float() - ref.float()).norm() / ref.float().norm())
                if not err < 1e-3:
                    bad += 1
                    print(f"FAIL N={n} pass {p} linear {i}: rel err {err:.3g}", flush=True)
        print(f"N={n}: checked 3 passes", flush=True)
    if bad:
        print(f"{bad} failures: no timing")
        return 1
    packs = [m.packed for m in mods]
    bufs = [torch.empty(padded_numel(p), dtype=torch.float16, device="cuda") for p in packs]
    t_dec = chain_ms([lambda p=p, b=b: tcabme_decode(p, out=b) for p, b in zip(packs, bufs)])
    moved = sum(m.values.numel() * 2 + m.bitmaps.numel() * 8 + w.numel() * 2 for m, w in zip(mods, dense))
    print(f"decodes alone: {t_dec:.3f} ms for the chain ({moved / t_dec / 1e9:.0f} GB/s read + written)", flush=True)
    rows = [{"decode_alone_ms": t_dec, "decode_gb_s": moved / t_dec / 1e9}]
    for n in ns:
        xs = [torch.randn(n, m.in_features, device="cuda", generator=gen).half() for m in mods]
        t_dense = chain_ms([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, dense)])
        t_seq = chain_ms([lambda x=x, m=m: m(x) for x, m in zip(xs, mods)])
        rows.append({"n": n, "dense_ms": t_dense, "decode_in_turn_ms": t_seq, "x_in_turn": t_dense / t_seq})
        print(f"N={n:5d}: dense {t_dense:7.3f} ms | decode in turn {t_seq:7.3f} ms ({t_dense / t_seq:.2f}x)",
              flush=True)
    if args.out:
        save_results(args.out, "gpu_prefill.json", rows, layers=args.layers, sparsity=args.sparsity)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
