"""Where sp24_ws's time goes, by leaving one part of its step out, and what candidate variants of it give (issue
22, docs/kernels-notes.md "v24"; ``sparsekit.kernels.sp24_ws_probe``): per shape and token count, cuBLAS, the
default build, the ablations (without its products, its copies and every wait on them, X's copy, the weights'
copies, its step loop) and the variants (``early_release``, ``late_release``, ``two_blocks``). GPU only (Hopper)::

    python -m scripts.bench.probe_sp24_ablate [--shapes 22016x4096,8192x28672] [--ns 1,16,64,128] \
        [--plans '[{}, {"tokens": 128, "groups": 2, "strips": 1, "stages": 6}]'] [--builds no_products,two_blocks]

``--plans``: a JSON list of ``sp24_matmul(kernel="ws")`` keyword sets (``{}``: its default plan). Microseconds per
call (CUDA-graph replays over weight copies that together exceed the L2); ``x``: cuBLAS time / the launch's. A
part's cost is the default build's time less the launch without it. Each variant is checked first (NaN-poisoned
output against float64, relative error < 1e-3); a wrong one is reported and not timed (exit status 1).
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

from scripts.common import copies_for, cuda_or_exit, ints_arg, masked_weight, shapes_arg, time_calls  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="22016x4096,8192x28672", help="weights MxK")
    ap.add_argument("--ns", default="1,16,64,128", help="token counts")
    ap.add_argument("--plans", default="[{}]", help="JSON list of sp24_matmul(kernel='ws') keyword sets")
    ap.add_argument("--builds", default=None, help="ablations and variants to time (default: all)")
    args = ap.parse_args()
    cuda_or_exit("the sp24_ws ablation probe")
    from sparsekit.kernels.sp24 import sp24_matmul
    from sparsekit.kernels.sp24_ws_probe import ABLATIONS, VARIANTS, built_as
    from sparsekit.packed.sp24 import transcode

    try:
        plans = json.loads(args.plans)
        assert isinstance(plans, list) and all(isinstance(p, dict) for p in plans)
    except (ValueError, AssertionError):
        print(f"--plans: a JSON list of keyword sets, got {args.plans!r}", file=sys.stderr)
        return 2
    builds = tuple(args.builds.split(",")) if args.builds else ABLATIONS + VARIANTS
    unknown = [b for b in builds if b not in ABLATIONS + VARIANTS]
    if unknown:
        print(f"--builds: unknown {', '.join(unknown)} (known: {', '.join(ABLATIONS + VARIANTS)})", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(1)
    modes = (None,) + builds
    wrong = 0
    print(f"| weight | N | plan | cuBLAS us | {' | '.join(m or 'default' for m in modes)} |")
    print("|---|---:|---|---:|" + "---|" * len(modes))
    for m, k in shapes_arg(args.shapes):
        dense = [masked_weight(m, k, "2:4", gen) for _ in range(copies_for(m * k * 2))]
        lays = [transcode(w) for w in dense]
        for n in ints_arg(args.ns):
            x = torch.randn(n, k, device="cuda", generator=gen).half()
            tc, _ = time_calls([lambda w=w: F.linear(x, w) for w in dense])
            ref = x.double() @ dense[0].double().T
            for kw in plans:
                cells = []
                for mode in modes:
                    with built_as(mode):
                        if mode is None or mode in VARIANTS:
                            y = torch.full((n, m), float("nan"), dtype=torch.half, device="cuda")
                            sp24_matmul(x, lays[0], y, kernel="ws", **kw)
                            err = ((y.double() - ref).norm() / ref.norm()).item()
                            if not err < 1e-3:
                                wrong += 1
                                cells.append(f"WRONG (rel err {err:.1e})")
                                continue
                        t, _ = time_calls([lambda lay=lay: sp24_matmul(x, lay, kernel="ws", **kw) for lay in lays])
                    cells.append(f"{t:.1f} (x{tc / t:.2f})")
                print(f"| {m}x{k} | {n} | {json.dumps(kw)} | {tc:.1f} | {' | '.join(cells)} |", flush=True)
        del dense, lays
        torch.cuda.empty_cache()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
