"""Where spmm_warp's time goes: the kernel against two crippled copies of itself.

- ``full``: the kernel as shipped (correct output);
- ``stream``: the same copies, waits and loop, no decode or multiply (what the memory traffic alone
  costs in this access pattern);
- ``l2hot``: every step re-copies and decodes the warp's first step (L2-hot: the decode, the
  multiply and the copy instructions without DRAM).

Timed like bench/kernels.py (CUDA-graph replays over >= 4 weight copies, median us per call), plus
a read-only bandwidth (``torch.sum`` over 1 GiB) for scale. Diagnostics only: the crippled kernels'
outputs are wrong by design.

    python -m scripts.bench.probe_kernels [--shapes 11008x4096,4096x4096] [--ns 1,16] [--plans default,r2w8s2g64]
"""
from __future__ import annotations

import argparse
import re
import sys

import torch

from scripts.common import ints_arg, random_pruned, shapes_arg, time_calls, weight_copies

from sparsekit.runtime.timing import time_ms


def read_bandwidth() -> float:
    """Read-only bandwidth in bytes/s (``torch.sum`` over 1 GiB), median of 10."""
    a = torch.ones(2**29, dtype=torch.float16, device="cuda")   # 1 GiB
    return a.numel() * 2 / (time_ms(a.sum, repeats=10, warmup=2) / 1e3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="11008x4096,4096x4096")
    ap.add_argument("--ns", default="1,16")
    ap.add_argument("--plans", default="default")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--rot", default="1", help="ROT values to compare (0: every block starts at step 0)")
    ap.add_argument("--modes", default="0,1,2", help="0 full, 1 stream, 2 l2hot")
    a = ap.parse_args()
    from sparsekit.kernels import spmm_warp, tcabme_matmul
    from sparsekit.packed.tcabme import encode

    print(f"{torch.cuda.get_device_name()}: read bandwidth {read_bandwidth() / 1e12:.2f} TB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, k in shapes_arg(a.shapes):
        p = encode(random_pruned(m, k, a.sparsity, gen))
        pcs = weight_copies(p)
        npk = len(pcs)
        for n in ints_arg(a.ns):
            x = torch.randn(n, k, device="cuda", generator=gen).half()
            ys = [torch.empty(n, m, device="cuda", dtype=torch.float16) for _ in range(npk)]
            for plan in a.plans.split(","):
                kw = {}
                mt = re.fullmatch(r"r(\d+)w(\d+)s(\d+)(?:g(\d+))?", plan)
                if mt:
                    kw = dict(strips=int(mt[1]), warps=int(mt[2]), stages=int(mt[3]),
                              regs=int(mt[4]) if mt[4] else None)
                for rot in ints_arg(a.rot):
                    spmm_warp.ROT = rot
                    out = []
                    for probe in ints_arg(a.modes):
                        spmm_warp.PROBE = probe
                        t = time_calls([lambda i=i: tcabme_matmul(x, pcs[i], out=ys[i], **kw) for i in range(npk)])[0]
                        out.append(f"{('full', 'stream', 'l2hot')[probe]} {t:.1f} us ({p.nbytes / t / 1e3:.0f} GB/s)")
                    print(f"{m}x{k} N={n} {plan} rot={rot}: " + " | ".join(out), flush=True)
                spmm_warp.PROBE = 0
                spmm_warp.ROT = 1
        del pcs
    return 0


if __name__ == "__main__":
    sys.exit(main())
