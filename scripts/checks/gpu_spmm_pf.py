"""GPU check and benchmark of spmm_pf (issue 21 item 2, docs/kernels-notes.md "v29": TCA-BME prefill in one kernel,
each GroupTile decoded once per block into a dense A tile in shared memory and multiplied with the warpgroup MMA
from shared memory; Hopper only, not yet a runtime path), one command:

    python -m scripts.checks.gpu_spmm_pf [--check-only | --bench-only] [--shapes 22016x4096] [--ns 512,2048]

1. **Correctness**: random weights (50%, 70%, 2:4; kept +0.0 from ``torch.where``) with an all-zero GroupTile row,
   odd and full shapes, N from 1 to 1000 including odd counts, the plans of ``CHECK_PLANS`` (a cluster of 2 too),
   outputs poisoned with NaN, relative error against float64 < 1e-3; each case twice. Exits 1 on any failure,
   before timing.
2. **Ablations** (``--ablations``): the kernel built with one part of every step left out
   (``spmm_pf.ABLATIONS``), timed beside the whole kernel at 2048 tokens.
3. **Timing** (us per call, CUDA-graph replays over weight copies that together exceed the L2): cuBLAS on the
   dense weight, decode + cuBLAS (the prefill path the runtime takes), and spmm_pf's plans ``--plans``;
   x = cuBLAS time / the other's.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy

if not hasattr(numpy, "row_stack"):      # numba-cuda 0.30.4 still calls it; numpy 2.5 removed it
    numpy.row_stack = numpy.vstack

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from scripts.checks.gpu_spmm_ws import rel_err  # noqa: E402
from scripts.common import copies_for, cuda_or_exit, ints_arg, masked_weight, shapes_arg, time_calls  # noqa: E402

CHECK_SHAPES = [(200, 130), (1000, 333), (130, 4160), (4096, 4096), (22016, 4096), (4096, 11008)]
CHECK_NS = [1, 65, 300, 1000]
CHECK_PLANS = [dict(tokens=256, stages=4), dict(tokens=192, stages=4), dict(tokens=128, stages=5),
               dict(tokens=64, stages=3), dict(tokens=256, stages=3, cluster=2)]
PLANS = '[{"tokens": 256, "stages": 4}, {"tokens": 256, "stages": 3}, {"tokens": 192, "stages": 4}]'
BENCH_SHAPES = [(22016, 4096), (4096, 11008), (28672, 8192), (8192, 28672), (12288, 4096)]
BENCH_NS = [512, 2048, 4096]


def check() -> int:
    from sparsekit.kernels.spmm_pf import tcabme_pf_matmul
    from sparsekit.packed.tcabme import encode

    gen = torch.Generator(device="cuda").manual_seed(0)
    bad = cases = 0
    worst = 0.0
    for m, k in CHECK_SHAPES:
        for kind in (0.5, 0.7, "2:4"):
            w = masked_weight(m, k, kind, gen)
            if m >= 192:
                w[64:128] = 0.0                                  # a GroupTile row with no values
            p = encode(w)
            for n in CHECK_NS:
                if m * k > 2**24 and n < 300:
                    continue
                x = torch.randn(n, k, device="cuda", generator=gen).half()
                ref = x.double() @ w.double().t()
                for kw in CHECK_PLANS:
                    for _ in range(2):
                        out = torch.full((n, m), float("nan"), dtype=torch.float16, device="cuda")
                        tcabme_pf_matmul(x, p, out=out, **kw)
                        e = rel_err(out, ref)
                        cases += 1
                        worst = max(worst, e) if e == e else worst
                        if not e < 1e-3:
                            bad += 1
                            print(f"FAIL {m}x{k} {kind} N={n} {kw}: rel err {e}", flush=True)
    print(f"correctness: {cases} cases, {bad} failures, worst rel err {worst:.2e}")
    return bad


def _weights(m: int, k: int, gen):
    from sparsekit.packed.tcabme import encode

    dense = [masked_weight(m, k, 0.5, gen) for _ in range(copies_for(m * k * 2))]
    return dense, [encode(w) for w in dense]


def ablations(shapes) -> None:
    from sparsekit.kernels import spmm_pf

    gen = torch.Generator(device="cuda").manual_seed(1)
    print("\n| M x K | N | cuBLAS us | " + " | ".join(("whole",) + spmm_pf.ABLATIONS) + " |")
    for m, k in shapes:
        dense, packed = _weights(m, k, gen)
        x = torch.randn(2048, k, device="cuda", generator=gen).half()
        tb, _ = time_calls([lambda w=w: F.linear(x, w) for w in dense], reps=7)
        row = f"| {m}x{k} | 2048 | {tb:.1f} |"
        for ab in (None,) + spmm_pf.ABLATIONS:
            spmm_pf.probe_build[0] = ab
            t, _ = time_calls([lambda p=p: spmm_pf.tcabme_pf_matmul(x, p, tokens=256, stages=4) for p in packed],
                              reps=7)
            row += f" {t:.1f} |"
        spmm_pf.probe_build[0] = None
        print(row, flush=True)
        del dense, packed
        torch.cuda.empty_cache()


def bench(shapes, ns, plans: list[dict]) -> None:
    from sparsekit.kernels.decode import tcabme_decode
    from sparsekit.kernels.spmm_pf import tcabme_pf_matmul

    gen = torch.Generator(device="cuda").manual_seed(1)
    names = "".join(f" {json.dumps(kw)} us (x) |" for kw in plans)
    print(f"\n| M x K | N | cuBLAS us | decode + cuBLAS x |{names}")
    print("|---|---:|---:|---:|" + "---:|" * len(plans))
    for m, k in shapes:
        dense, packed = _weights(m, k, gen)
        scratch = torch.empty(m, k, dtype=torch.float16, device="cuda")
        for n in ns:
            x = torch.randn(n, k, device="cuda", generator=gen).half()
            tb, _ = time_calls([lambda w=w: F.linear(x, w) for w in dense], reps=7)
            td, _ = time_calls([lambda p=p: F.linear(x, tcabme_decode(p, out=scratch)) for p in packed], reps=7)
            row = f"| {m}x{k} | {n} | {tb:.1f} | {tb / td:.2f} |"
            for kw in plans:
                t, _ = time_calls([lambda p=p: tcabme_pf_matmul(x, p, **kw) for p in packed], reps=7)
                row += f" {t:.1f} ({tb / t:.2f}) |"
            print(row, flush=True)
        del dense, packed
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument("--ablations", action="store_true", help="also time the ablated builds (22016x4096, 8192x28672)")
    ap.add_argument("--shapes", help="benchmark shapes MxK, e.g. 22016x4096")
    ap.add_argument("--ns", help="benchmark token counts, e.g. 512,2048")
    ap.add_argument("--plans", default=PLANS, help="spmm_pf plans to time, a JSON list of keyword sets")
    args = ap.parse_args()
    cuda_or_exit("spmm_pf")
    if not args.bench_only and check():
        return 1
    if args.check_only:
        return 0
    if args.ablations:
        ablations([(22016, 4096), (8192, 28672)])
    bench(shapes_arg(args.shapes) or BENCH_SHAPES, ints_arg(args.ns) or BENCH_NS, json.loads(args.plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
