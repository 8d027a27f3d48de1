"""The host's time per eager call of one packed layer (issues 21, 22; docs/kernels-notes.md "v35"): a prefill that
runs layer by layer in Python (``generate``'s, ``eval --speed``'s, ``bench_e2e``'s at batch 1) is bound by it
where the GPU work is short. GPU only::

    python -m scripts.bench.probe_eager [--shapes 22016x4096,4096x11008] [--ns 1,16,128,512] \
        [--form sp24|tcabme] [--kind 2:4] [--profile 128]

For each shape: a ``SparseLinear`` of a random weight pruned by ``--kind`` (its TCA-BME form, or with ``--form
sp24`` only its 2:4 layout, as ``prefer="memory"`` keeps it), and at each token count ``--calls`` eager calls
issued without waiting (the host's time a call), then one wait (host and GPU), beside ``F.linear`` on the same
weight; the relative error against it, at the first call and again after the timed ones on new values (an eager call
at a count that ran before goes through its kept launch, ``kernels.launch.replay``). ``--profile N``: a cProfile of
the calls at N tokens (the largest costs by own time), where the host's time goes.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import numpy
import torch
import torch.nn.functional as F
from torch import nn

from scripts.common import cuda_or_exit, ints_arg, kind_arg, masked_weight, shapes_arg

if not hasattr(numpy, "row_stack"):      # numba-cuda 0.30.4 still calls it; numpy 2.5 removed it
    numpy.row_stack = numpy.vstack


def host_and_total(call, calls: int) -> tuple[float, float]:
    """Microseconds a call: issued without waiting, and until the GPU is done too."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        call()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * host / calls, 1e6 * (time.perf_counter() - t) / calls


def layer_of(w: torch.Tensor, form: str) -> nn.Module:
    from sparsekit.runtime.sp24 import enable_sp24, keep_only_sp24
    from sparsekit.runtime.sparse_linear import SparseLinear

    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    lin.weight.data = w
    layer = SparseLinear.from_linear(lin)
    if form == "sp24":
        why = enable_sp24(nn.Sequential(layer))["0"]
        if why != "sp24":
            raise SystemExit(f"the 2:4 layout does not take this weight: {why}")
        keep_only_sp24(layer)
    return layer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="12288x4096,22016x4096,4096x11008")
    ap.add_argument("--ns", default="1,16,128,512,2048")
    ap.add_argument("--form", choices=("sp24", "tcabme"), default="sp24")
    ap.add_argument("--kind", default="2:4", help="the mask: 2:4, hybrid or a sparsity (0.5)")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--profile", type=int, default=0, help="a cProfile of the calls at this many tokens")
    args = ap.parse_args()
    try:
        shapes, ns, kinds = shapes_arg(args.shapes), ints_arg(args.ns), kind_arg(args.kind)
    except ValueError as e:
        ap.error(f"bad list: {e}")
    if len(kinds) != 1 or args.calls < 1 or min(ns) < 1:
        ap.error("--kind takes one mask, --calls and --ns positive numbers")
    if args.form == "sp24" and kinds[0] not in ("2:4", "hybrid"):
        ap.error(f"--form sp24 takes a 2:4 or hybrid mask, not {args.kind}")
    cuda_or_exit("probe_eager")
    print(f"GPU {torch.cuda.get_device_name()}; torch {torch.__version__}; form {args.form}, mask {args.kind}")
    print("\n| M x K | N | layer host us | layer host + GPU us | F.linear host us | F.linear host + GPU us | rel err | "
          "rel err, again |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for m, k in shapes:
            w = masked_weight(m, k, kinds[0], gen)
            layer = layer_of(w, args.form)
            for n in ns:
                x = torch.randn(n, k, device="cuda", generator=gen).half()
                ref = F.linear(x, w).float()
                err = float((layer(x).float() - ref).norm() / ref.norm())
                hs, ts = host_and_total(lambda: layer(x), args.calls)
                hd, td = host_and_total(lambda: F.linear(x, w), args.calls)
                # the same count again on new values: the kept launch (``kernels.sp24.sp24_planned``) must write them
                x2 = torch.randn(n, k, device="cuda", generator=gen).half()
                ref2 = F.linear(x2, w).float()
                err2 = float((layer(x2).float() - ref2).norm() / ref2.norm())
                print(f"| {m}x{k} | {n} | {hs:.1f} | {ts:.1f} | {hd:.1f} | {td:.1f} | {err:.2e} | {err2:.2e} |")
                if n == args.profile:
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(args.calls):
                        layer(x)
                    prof.disable()
                    torch.cuda.synchronize()
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
                    print(f"\ncProfile, {m}x{k} at {n} tokens, {args.calls} calls:\n{out.getvalue()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
