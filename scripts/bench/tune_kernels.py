"""Sweep spmm_warp's launch plan (strips per warp-step x warps per block x stages) against the default.

For each shape, token count and sparsity: the default plan (``kernels.plan.warp_plan``), then
every configuration of the grid, each timed like bench/kernels.py (CUDA-graph replays over >= 4
rotated weight copies, median microseconds per call), and the best one. Correctness is
checks/gpu_kernels.py's job; run it on any plan this sweep leads to.

    python -m scripts.bench.tune_kernels --shapes 11008x4096 --ns 1,16 [--strips 1,2] [--warps 2,4,8]
        [--stages 2,3] [--regs 0,64,80] [--sparsity 0.5] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from scripts.common import ints_arg, random_pruned, shapes_arg, time_calls, weight_copies


def plan_of(m: int, k: int, n: int, p, strips=None, warps=None, stages=None) -> tuple[int, int, int]:
    """(strips, warps, stages) the launcher would use (after its register and shared-memory caps)."""
    from sparsekit.kernels import launch, plan

    gm, gk = p.grid
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    r = strips or plan.warp_strips(m, gk, n, sms)
    vch = plan.strip_chunks(p, r)
    w, s, _ = plan.warp_plan(m, gk, n, vch, warps, stages, r, sms, launch.smem_limit())
    return r, w, s


def name(plan) -> str:
    """r<strips>w<warps>s<stages>, then g<register cap> when one was forced."""
    return "r{}w{}s{}".format(*plan[:3]) + (f"g{plan[3]}" if len(plan) > 3 and plan[3] else "")


def sweep(shapes, ns, sparsity, strips, warps, stages, regs):
    from sparsekit.kernels import tcabme_matmul
    from sparsekit.packed.tcabme import encode

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for (m, k) in shapes:
        p = encode(random_pruned(m, k, sparsity, gen))
        pcopies = weight_copies(p)
        npk = len(pcopies)
        for n in ns:
            x = torch.randn(n, k, device="cuda", generator=gen).half()
            ys = [torch.empty(n, m, device="cuda", dtype=torch.float16) for _ in range(npk)]
            default = plan_of(m, k, n, p)
            t_def = time_calls([lambda i=i: tcabme_matmul(x, pcopies[i], out=ys[i]) for i in range(npk)])[0]
            times = {}
            for r in strips:
                for w in warps:
                    for s in stages:
                        for rg in regs:
                            eff = plan_of(m, k, n, p, r, w, s) + (rg,)
                            if eff in times:
                                continue
                            try:
                                times[eff] = time_calls([lambda i=i: tcabme_matmul(
                                    x, pcopies[i], out=ys[i], strips=r, warps=w, stages=s, regs=rg or None)
                                    for i in range(npk)])[0]
                            except Exception as e:  # noqa: BLE001 - a plan that cannot launch is reported
                                print(f"  {m}x{k} N={n} {name(eff)}: {type(e).__name__}: {str(e)[:80]}")
            best = min(times, key=times.get) if times else default
            tb = times.get(best, t_def)
            rows.append(dict(m=m, k=k, n=n, sparsity=sparsity, default=list(default), default_us=t_def,
                             best=list(best), best_us=tb, all={name(pl): t for pl, t in times.items()}))
            top = sorted(times.items(), key=lambda kv: kv[1])[:6]
            print(f"{m:>5}x{k:<5} N={n:<2} default {name(default)} {t_def:6.1f}us | best {name(best)} {tb:6.1f}us "
                  f"({t_def / tb:4.2f}x) | " + " ".join(f"{name(pl)}={t:.1f}" for pl, t in top), flush=True)
        del pcopies
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4096x4096,11008x4096,4096x11008,14336x4096")
    ap.add_argument("--ns", default="1,8,16,32")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--strips", default="1,2")
    ap.add_argument("--warps", default="2,3,4,6,8,12,16")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--regs", default="0", help="register caps per thread to force (0: the kernel's own)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("tune_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = sweep(shapes_arg(a.shapes), ints_arg(a.ns), a.sparsity, ints_arg(a.strips), ints_arg(a.warps),
                 ints_arg(a.stages), ints_arg(a.regs))
    path = os.path.join(a.out, f"tune_{int(a.sparsity * 100)}.json")
    with open(path, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
