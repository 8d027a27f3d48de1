"""The 2:4 product's contenders on one weight, each launched once between ``cudaProfilerStart`` and ``Stop``, for
Nsight Compute (issue 22, docs/kernels-notes.md "v32"): cuBLAS on the dense weight, torch's cuSPARSELt
(``to_sparse_semi_structured``) and sp24_ws with its own plan or forced ones, at each token count. GPU only::

    ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --metrics lts__t_bytes.sum,l1tex__m_xbar2l1tex_read_bytes.sum,dram__bytes_read.sum --csv --page details \\
        python -m scripts.bench.probe_prefill_ncu --shape 22016x4096 --ns 128,2048 [--plans "own;cluster=2"]

Without ncu, ``--names`` prints each launch's kernel name and time from torch's profiler (which names the library
kernels: cuBLAS's tile, cuSPARSELt's tile and cluster shape). Each contender runs twice before the profiled range,
so compiles and library heuristics stay out of it.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from scripts.common import cuda_or_exit, ints_arg, plan_arg, shapes_arg


def plans_arg(text: str) -> list[dict]:
    """``"own;cluster=2;tokens=256,stages=3"`` -> ``[{}, {"cluster": 2}, {"tokens": 256, "stages": 3}]``."""
    out = []
    for part in text.split(";"):
        part = part.strip()
        try:
            out.append({} if part in ("", "own") else plan_arg(part))
        except ValueError:
            print(f"--plans takes 'own' or KEY=INT[,...] separated by ';', got {part!r}", file=sys.stderr)
            raise SystemExit(2) from None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="22016x4096", help="the weight, MxK")
    ap.add_argument("--ns", default="128,2048", help="token counts")
    ap.add_argument("--plans", default="own", help="sp24_ws plans: 'own' or KEY=INT[,...], separated by ';'")
    ap.add_argument("--names", action="store_true", help="print kernel names and times (torch's profiler), not for ncu")
    args = ap.parse_args()
    try:
        (m, k), = shapes_arg(args.shape)
        ns = ints_arg(args.ns)
    except ValueError:
        ap.error(f"--shape takes one MxK and --ns integers, got {args.shape!r} and {args.ns!r}")
    plans = plans_arg(args.plans)
    cuda_or_exit("the prefill ncu probe")
    from torch.sparse import to_sparse_semi_structured

    from scripts.checks.gpu_sp24 import mosaic
    from sparsekit.kernels.sp24 import sp24_matmul
    from sparsekit.packed.sp24 import transcode

    gen = torch.Generator(device="cuda").manual_seed(1)
    w = mosaic(m, k, 1.0, gen)
    lay, semi = transcode(w), to_sparse_semi_structured(w)
    calls = []
    for n in ns:
        x = torch.randn(n, k, device="cuda", generator=gen).half()
        calls += [(f"cuBLAS N={n}", lambda x=x: F.linear(x, w)), (f"cuSPARSELt N={n}", lambda x=x: F.linear(x, semi))]
        calls += [(f"sp24_ws {p or 'own'} N={n}", lambda x=x, p=p: sp24_matmul(x, lay, kernel="ws", **p))
                  for p in plans]
    for _ in range(2):
        for _, c in calls:
            c()
    torch.cuda.synchronize()
    if args.names:
        from torch.profiler import ProfilerActivity, profile

        for label, c in calls:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                c()
                torch.cuda.synchronize()
            for e in prof.events():
                if e.device_type.name == "CUDA" and "Memset" not in e.name:
                    print(f"{label}: {e.device_time_total:.1f} us {e.name[:160]}")
        return 0
    torch.cuda.cudart().cudaProfilerStart()
    for _, c in calls:
        c()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled: " + ", ".join(label for label, _ in calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
