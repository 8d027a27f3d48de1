"""The register-sourced warpgroup MMA's product rate on its own (issue 22, docs/kernels-notes.md "v24";
``sparsekit.kernels.wgmma_rate``): sparse (two m64nNk32 ``.sp``) against dense (four m64nNk16) products of
sp24_ws's shape, issued back to back, waiting for every group after each call, for all but the newest, or only at
the end, with 1-3 warpgroups per block. GPU only (Hopper)::

    python -m scripts.bench.probe_wgmma_rate [--ns 64,128,256] [--groups 1,2,3] [--iters 2000]

Prints microseconds per launch and dense-equivalent TFLOP/s (2 x 64 x N x 64 per call and warpgroup), beside
cuBLAS on a [4096, 4096] x [4096, 4096] fp16 product for scale.
"""
from __future__ import annotations

import argparse
import sys

import numpy

if not hasattr(numpy, "row_stack"):      # numba-cuda 0.30.4 still calls it; numpy 2.5 removed it
    numpy.row_stack = numpy.vstack

import torch  # noqa: E402

from scripts.common import cuda_or_exit, ints_arg, time_calls  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ns", default="64,128", help="tokens per product (64, 128, 256)")
    ap.add_argument("--groups", default="1,2,3", help="warpgroups per block")
    ap.add_argument("--iters", type=int, default=2000, help="calls per warpgroup")
    args = ap.parse_args()
    ns, groups = ints_arg(args.ns), ints_arg(args.groups)
    if not set(ns) <= {64, 128, 256} or not set(groups) <= {1, 2, 3} or args.iters < 1:
        print("--ns takes 64, 128 and 256, --groups 1 to 3, --iters a positive count", file=sys.stderr)
        return 2
    cuda_or_exit("the warpgroup MMA rate probe")
    from sparsekit.kernels.wgmma_rate import WAITS, product_rate

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.half)
    tc, _ = time_calls([lambda: a @ a])
    print(f"cuBLAS 4096^3 fp16: {2 * 4096 ** 3 / (tc * 1e-6) / 1e12:.0f} TFLOP/s")
    print("| N | products | wait | warpgroups / block | us | TFLOP/s (dense-equivalent) |")
    print("|---:|---|---|---:|---:|---:|")
    for n in ns:
        for sparse in (True, False):
            for wait in WAITS:
                for g in groups:
                    r = product_rate(n, sparse, wait, g, args.iters)
                    print(f"| {n} | {'sparse' if sparse else 'dense'} | {wait} | {g} | {r['us']:.0f} | "
                          f"{r['tflops']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
