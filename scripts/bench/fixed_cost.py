"""A decode kernel's time split into a fixed cost and a rate (issue 22, docs/kernels-notes.md "v41"): per kernel and
token count, the time at several K for one M, fitted as ``t = t0 + bytes / rate`` (least squares over the weight's
bytes as stored: fp16 for cuBLAS, the 2:4 layout's buffers for ours). At one token on an H200 the 2:4 kernels
stream near the memory's rate but pay ~10 us a call against cuBLAS's ~6 (two-shape estimate, session 36); this
measures it on one GPU, in one run. GPU only::

    python -m scripts.bench.fixed_cost [--ms 4096,12288] [--ks 1024,2048,4096,8192,16384] [--ns 1,16,64] \
        [--kernels cublas,auto,rows,ws] [--share 1.0]

``--share``: the share of 64x64 tiles that are 2:4 (1.0: all; 0.7: a 35% hybrid). Every product is checked against
float64 first (a wrong one is named and left out of the fit; exit status 1). "floor": a tiny kernel, FLOOR_CALLS a graph
(as the largest weights' timings), per call: what a launch costs with no work, the graph's own launch
shared as in the timings (session 37 printed one call a graph, 10.3 us: the graph's launch, not the kernel's).
"""
from __future__ import annotations

import argparse
import sys

import numpy

if not hasattr(numpy, "row_stack"):      # numba-cuda 0.30.4 still calls it; numpy 2.5 removed it
    numpy.row_stack = numpy.vstack

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from scripts.common import copies_for, cuda_or_exit, ints_arg, time_calls  # noqa: E402

KERNELS = ("cublas", "auto", "rows", "warps", "wg", "ws")
FLOOR_CALLS = 4      # calls a graph for "floor": what the largest weights' timings replay (copies_for's least)


def fit(nbytes, times_us) -> tuple[float, float, float]:
    """``(t0 us, rate GB/s, worst residual as a share of its time)`` of the least-squares line
    ``t = t0 + bytes / rate`` through the points; the rate is inf where the time does not grow with the bytes."""
    xs = numpy.asarray(nbytes, dtype=float)
    ys = numpy.asarray(times_us, dtype=float)
    if len(xs) < 2 or numpy.ptp(xs) == 0:
        raise ValueError("a fit needs two or more distinct byte counts")
    slope, t0 = numpy.polyfit(xs, ys, 1)
    worst = float(numpy.max(numpy.abs(t0 + slope * xs - ys) / ys))
    rate = float("inf") if slope <= 0 else 1e-3 / slope      # bytes per us -> GB/s
    return float(t0), rate, worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", type=ints_arg, default="4096,12288", help="output rows (one fit each)")
    ap.add_argument("--ks", type=ints_arg, default="1024,2048,4096,8192,16384", help="input columns: a fit's points")
    ap.add_argument("--ns", type=ints_arg, default="1,16,64", help="token counts")
    ap.add_argument("--kernels", default="cublas,auto,rows,ws", help=f"of {', '.join(KERNELS)}")
    ap.add_argument("--share", type=float, default=1.0, help="share of tiles that are 2:4 (1.0: all)")
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    if not 0.0 <= args.share <= 1.0:
        ap.error(f"--share takes 0 to 1, got {args.share}")
    if len(set(args.ks)) < 2 or any(v <= 0 for v in args.ms + args.ks + args.ns):
        ap.error("--ks takes two or more distinct sizes; sizes and counts are positive")
    if not kernels or any(kn not in KERNELS for kn in kernels):
        ap.error(f"--kernels takes some of {', '.join(KERNELS)}, got {args.kernels!r}")
    cuda_or_exit("the fixed-cost probe")
    from scripts.checks.gpu_sp24 import mosaic, rel_err
    from sparsekit.kernels.sp24 import sp24_matmul
    from sparsekit.packed.sp24 import transcode

    gen = torch.Generator(device="cuda").manual_seed(1)
    tiny = torch.zeros(32, device="cuda")
    floor, _ = time_calls([lambda: tiny.add_(1.0)] * FLOOR_CALLS, reps=50)
    print(f"floor (a tiny kernel, {FLOOR_CALLS} a graph): {floor:.2f} us a call\n")
    print("| M | N | kernel | t0 us | rate GB/s | worst residual | times us at each K |")
    print("|---:|---:|---|---:|---:|---:|---|")
    wrong = 0
    for m in args.ms:
        points = {}   # (n, kernel) -> [(bytes, us)]
        for k in args.ks:
            dense = [mosaic(m, k, args.share, gen) for _ in range(copies_for(m * k * 2))]
            lays = [transcode(w) for w in dense]
            lay_bytes = sum(t.numel() * t.element_size() for t in (lays[0].sp, lays[0].dense, lays[0].tiles))
            for n in args.ns:
                x = torch.randn(n, k, device="cuda", generator=gen).half()
                ref = x.double() @ dense[0].double().T
                for kn in kernels:
                    if kn == "cublas":
                        t, _ = time_calls([lambda w=w: F.linear(x, w) for w in dense])
                        points.setdefault((n, kn), []).append((m * k * 2, t))
                        continue
                    try:
                        y = sp24_matmul(x, lays[0], kernel=kn)
                    except ValueError as e:   # a kernel that does not take this weight (wg: dense tiles)
                        print(f"    {kn} {m}x{k} N={n}: {e}")
                        continue
                    err = rel_err(y, ref)
                    if not err < 1e-3:
                        wrong += 1
                        print(f"    WRONG {kn} {m}x{k} N={n}: rel err {err:.2e}")
                        continue
                    t, _ = time_calls([lambda lay=lay: sp24_matmul(x, lay, kernel=kn) for lay in lays])
                    points.setdefault((n, kn), []).append((lay_bytes, t))
            del dense, lays
            torch.cuda.empty_cache()
        for (n, kn), pts in sorted(points.items(), key=lambda kv: (kv[0][0], kernels.index(kv[0][1]))):
            if len(pts) < 2:
                continue
            t0, rate, worst = fit(*zip(*pts))
            times = " / ".join(f"{t:.1f}" for _, t in pts)
            print(f"| {m} | {n} | {kn} | {t0:.1f} | {rate:.0f} | {worst:.1%} | {times} |", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
