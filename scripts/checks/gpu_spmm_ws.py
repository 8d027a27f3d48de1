"""GPU check and benchmark of spmm_ws (issue 21, docs/kernels-notes.md "v19": TCA-BME decoded once per tile
into warpgroup A registers; Hopper only), one command:

    python -m scripts.checks.gpu_spmm_ws [--check-only | --bench-only] [--shapes 22016x4096] [--ns 1,16]

1. **Correctness**: random weights (50% and 70% sparse, 2:4, kept +0.0 from ``torch.where``), odd and
   full shapes, N from 1 to 300 including odd counts, default and forced plans (warpgroups, tokens, stages,
   splits; thread-block clusters of 2 and 4 sharing X, and two warpgroups taking turns on a tile row, on
   every shape), outputs poisoned with NaN, relative error against float64 < 1e-3; each case twice (split-K
   counters must be reset). Exits 1 on any failure, before timing.
2. **Timing** (us per call, CUDA-graph replays rotating over weight copies that together exceed the L2):
   cuBLAS on the dense weight, spmm_warp (``kernel="warp"``), spmm_ws, spmm_ws with each forced plan of
   ``--variants`` (a JSON list of ``tcabme_ws_matmul`` keywords; default: clusters of 2 and 4), and the
   default plan (which takes one of the first two); ``x`` = cuBLAS time / the kernel's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy

if not hasattr(numpy, "row_stack"):      # numba-cuda 0.30.4 still calls it; numpy 2.5 removed it
    numpy.row_stack = numpy.vstack

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from scripts.common import copies_for, cuda_or_exit, ints_arg, masked_weight, shapes_arg, time_calls  # noqa: E402

CHECK_SHAPES = [(64, 64), (200, 130), (1000, 333), (4096, 4096), (22016, 4096), (4096, 11008)]
CHECK_NS = [1, 9, 17, 64, 100, 128, 300]
FORCED = [dict(groups=1), dict(groups=2, tokens=8), dict(tokens=32, stages=3), dict(tokens=128, stages=2),
          dict(splits=3), dict(groups=1, splits=2, tokens=16)]
CLUSTERS = [dict(cluster=2), dict(cluster=4, tokens=64)]   # X multicast (kernels-notes "v22"), every shape
ALTS = [dict(alt=True), dict(alt=True, stages=6), dict(alt=True, splits=2, tokens=16)]   # turns ("v23")
VARIANTS = '[{"cluster": 2}, {"cluster": 4}]'
BENCH_SHAPES = [(22016, 4096), (28672, 8192), (8192, 28672), (4096, 11008), (12288, 4096)]
BENCH_NS = [1, 16, 32, 64, 128]


def rel_err(y, ref) -> float:
    if torch.isnan(y).any():
        return float("nan")
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def check(shapes, ns) -> int:
    from sparsekit.kernels.spmm_ws import tcabme_ws_matmul
    from sparsekit.packed.tcabme import encode

    gen = torch.Generator(device="cuda").manual_seed(0)
    bad = cases = 0
    worst = 0.0
    t0 = time.time()
    for m, k in shapes:
        for kind in (0.5, 0.7, "2:4"):
            w = masked_weight(m, k, kind, gen)
            p = encode(w)
            for n in ns:
                x = torch.randn(n, k, device="cuda", generator=gen).half()
                ref = x.double() @ w.double().t()
                forced = (FORCED if m * k <= 2**24 and n in (1, 17, 100) else [])
                for kw in [{}] + forced + (CLUSTERS + ALTS if n in (1, 17, 64, 100, 128) else []):
                    for _ in range(2):
                        out = torch.full((n, m), float("nan"), dtype=torch.float16, device="cuda")
                        try:
                            tcabme_ws_matmul(x, p, out=out, **kw)
                        except ValueError:
                            if kw:
                                break              # a forced plan the kernel refuses (shared memory)
                            raise
                        e = rel_err(out, ref)
                        cases += 1
                        worst = max(worst, e) if e == e else worst
                        if not e < 1e-3:
                            bad += 1
                            print(f"FAIL {m}x{k} {kind} N={n} {kw}: rel err {e}", flush=True)
    print(f"correctness: {cases} cases, {bad} failures, worst rel err {worst:.2e} ({time.time() - t0:.0f} s)")
    return bad


def forced_x(x, packed, tb: float, kw: dict) -> str:
    """x cuBLAS of spmm_ws with the forced plan ``kw``, or "-" where the plan refuses it."""
    from sparsekit.kernels.spmm_ws import tcabme_ws_matmul

    try:
        t, _ = time_calls([lambda p=p: tcabme_ws_matmul(x, p, **kw) for p in packed])
    except ValueError:
        return "-"
    return f"{tb / t:.2f}"


def bench(shapes, ns, kinds, variants: list[dict]) -> None:
    from sparsekit.kernels import tcabme_matmul
    from sparsekit.kernels.spmm_ws import tcabme_ws_matmul
    from sparsekit.packed.tcabme import encode

    gen = torch.Generator(device="cuda").manual_seed(1)
    names = "".join(" " + ",".join(f"{k} {v}" for k, v in kw.items()) + " x |" for kw in variants)
    print(f"\n| M x K | sparsity | N | cuBLAS us | spmm_warp us | x | spmm_ws us | x |{names} default x |")
    print("|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * (len(variants) + 1))
    for m, k in shapes:
        for kind in kinds:
            cop = copies_for(m * k * 2)
            dense = [masked_weight(m, k, kind, gen) for _ in range(cop)]
            packed = [encode(w) for w in dense]
            for n in ns:
                x = torch.randn(n, k, device="cuda", generator=gen).half()
                tb, _ = time_calls([lambda w=w: F.linear(x, w) for w in dense])
                td, _ = time_calls([lambda p=p: tcabme_matmul(x, p, kernel="warp") for p in packed])
                tw, _ = time_calls([lambda p=p: tcabme_ws_matmul(x, p) for p in packed])
                tc = "".join(f" {forced_x(x, packed, tb, kw)} |" for kw in variants)
                ta, _ = time_calls([lambda p=p: tcabme_matmul(x, p) for p in packed])
                print(f"| {m}x{k} | {kind} | {n} | {tb:.1f} | {td:.1f} | {tb / td:.2f} | {tw:.1f} | {tb / tw:.2f} "
                      f"|{tc} {tb / ta:.2f} |", flush=True)
            del dense, packed
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument("--shapes", help="benchmark shapes MxK, e.g. 22016x4096")
    ap.add_argument("--ns", help="benchmark token counts, e.g. 1,16")
    ap.add_argument("--sparsities", default="0.5,0.7", help="benchmark sparsities")
    ap.add_argument("--variants", default=VARIANTS, help="forced plans to time, a JSON list of keyword sets")
    args = ap.parse_args()
    cuda_or_exit("spmm_ws")
    if not args.bench_only and check(CHECK_SHAPES, CHECK_NS):
        return 1
    if not args.check_only:
        bench(shapes_arg(args.shapes) or BENCH_SHAPES, ints_arg(args.ns) or BENCH_NS,
              [float(v) for v in args.sparsities.split(",")], json.loads(args.variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
