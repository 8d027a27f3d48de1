"""GPU correctness check of the TCA-BME kernels (run on the device after every kernel change).

Random data (never zeros), outputs poisoned with NaN before every run, relative error against a
float64 reference (||y - ref|| / ||ref|| < 1e-2, and no NaN left), over all benchmark shapes, odd
shapes that need padding, N in {1, 2, 8, 16, 17, 32, 64, ...}, several sparsities, both kernel
variants, forced split-K counts, and a CUDA-graph capture/replay. Exits 1 on any failure.

    python -m scripts.checks.gpu_kernels [--quick] [--probe]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from scripts.common import floats_arg, ints_arg, random_pruned, shapes_arg

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096),
          (576, 576), (192, 576), (1536, 576), (576, 1536),
          (100, 72), (200, 130), (1000, 333), (64, 4160)]
NS = [1, 2, 8, 16, 17, 32, 64, 65, 100]
SPARSITIES = [0.4, 0.5, 0.7]


def rel_err(y, ref):
    if torch.isnan(y).any():
        return float("nan")
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def probe():
    """Environment facts for docs/kernels-notes.md."""
    import numba
    info = {"torch": torch.__version__, "numba": numba.__version__, "gpu": torch.cuda.get_device_name()}
    try:
        from importlib.metadata import version
        info["numba-cuda"] = version("numba-cuda")
        import numpy
        info["numpy"] = numpy.__version__
    except Exception as e:  # noqa: BLE001
        info["numba-cuda"] = repr(e)
    props = torch.cuda.get_device_properties(0)
    info["sms"] = props.multi_processor_count
    info["l2_mb"] = getattr(props, "L2_cache_size", 0) / 2**20
    try:
        info["smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total",
                                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except Exception as e:  # noqa: BLE001
        info["smi"] = repr(e)
    print(json.dumps(info))
    return info


def check(quick: bool, shapes=None, ns=None, sparsities=None) -> int:
    from sparsekit.kernels import kernels_available, tcabme_matmul
    from sparsekit.packed.tcabme import encode

    assert kernels_available(), "kernels_available() is False on a GPU machine"
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1234)
    shapes = shapes or (SHAPES[4:] if quick else SHAPES)
    failures, worst, cases = [], 0.0, 0
    t0 = time.time()
    for (m, k) in shapes:
        for sp in (sparsities or SPARSITIES):
            w = random_pruned(m, k, sp, gen, dev)
            p = encode(w)
            for n in (ns or NS):
                x = torch.randn(n, k, device=dev, generator=gen).half()
                ref = x.double() @ w.double().t()
                variants = [{}]
                if n <= 16:   # spmm_warp by default; spmm.py (v4) too, and forced warp/stage/strip counts
                    variants += [{"warp_kernel": False, "cuda_core_max_n": 0}, {"warps": 1, "stages": 2},
                                 {"warps": 3, "stages": 4}, {"warps": 32, "stages": 3},
                                 {"strips": 1}, {"strips": 2}, {"strips": 2, "warps": 3, "stages": 3},
                                 {"strips": 4}, {"strips": 4, "warps": 3, "stages": 3}]
                elif n <= 64:
                    variants += [{"warps": 3}, {"strips": 1}, {"strips": 2}, {"strips": 4}]
                if n <= 8:
                    variants += [{"warp_kernel": False, "cuda_core_max_n": 8}]
                if (m, k) in ((576, 576), (4096, 4096), (100, 72)) and n in (1, 17):
                    variants += [{"splits": s, "warp_kernel": False} for s in (1, 3, 64)]
                for kw in variants:
                    out = torch.full((n, m), float("nan"), device=dev, dtype=torch.float16)
                    try:
                        tcabme_matmul(x, p, out=out, **kw)
                        torch.cuda.synchronize()
                    except Exception as exc:  # noqa: BLE001 - report the case, keep checking
                        print(f"FAIL m={m} k={k} sp={sp} n={n} {kw}: {type(exc).__name__}: {str(exc)[:80]}",
                              flush=True)
                        failures.append((m, k, sp, n, kw, repr(exc)[:80]))
                        cases += 1
                        continue
                    e = rel_err(out, ref)
                    cases += 1
                    if not (e < 1e-2):
                        failures.append((m, k, sp, n, kw, e))
                        print(f"FAIL m={m} k={k} sp={sp} n={n} {kw}: rel err {e}", flush=True)
                    else:
                        worst = max(worst, e)
        print(f"  {m}x{k}: {cases} cases so far, {len(failures)} failures, worst rel err {worst:.2e}, "
              f"{time.time() - t0:.0f}s", flush=True)
    # CUDA graph capture of several launches, replayed on fresh inputs.
    w = random_pruned(1536, 576, 0.5, gen, dev)
    p = encode(w)
    for n in (1, 16, 40):
        x = torch.randn(n, 576, device=dev, generator=gen).half()
        out = torch.empty(n, 1536, device=dev, dtype=torch.float16)
        tcabme_matmul(x, p, out=out)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            tcabme_matmul(x, p, out=out)
        for _ in range(3):
            x.copy_(torch.randn(n, 576, device=dev, generator=gen).half())
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            e = rel_err(out, x.double() @ w.double().t())
            cases += 1
            if not (e < 1e-2):
                failures.append(("graph", n, e))
                print(f"FAIL graph n={n}: rel err {e}", flush=True)
    from sparsekit.kernels import spmm, spmm_warp
    for key, kern in sorted(spmm.compiled_kernels().items()) + sorted(spmm_warp.compiled_kernels().items()):
        try:
            print(f"kernel nt={key[0]} mma={key[1]}: regs {kern.get_regs_per_thread()}, "
                  f"smem {kern.get_shared_mem_per_block()} B, local {kern.get_local_mem_per_thread()} B")
        except Exception as e:  # noqa: BLE001
            print(f"kernel {key}: resource query failed: {e}")
    print(f"gpu_check_kernels: {cases} cases, {len(failures)} failures, worst rel err {worst:.2e}, "
          f"{time.time() - t0:.0f}s")
    return 1 if failures else 0


def profile_case(m: int, k: int, n: int, sparsity: float, calls: int = 20) -> int:
    """Run one case ``calls`` times (for ncu: --launch-skip/--launch-count pick one)."""
    from sparsekit.kernels import tcabme_matmul
    from sparsekit.packed.tcabme import encode

    gen = torch.Generator(device="cuda").manual_seed(0)
    p = encode(random_pruned(m, k, sparsity, gen, "cuda"))
    x = torch.randn(n, k, device="cuda", generator=gen).half()
    for _ in range(calls):
        tcabme_matmul(x, p)
    torch.cuda.synchronize()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None, help="M,K,N,sparsity: just run that case (for ncu)")
    ap.add_argument("--quick", action="store_true", help="small shapes only")
    ap.add_argument("--probe", action="store_true", help="print environment facts first")
    ap.add_argument("--shapes", default=None, help="e.g. 4096x4096,576x576 (default: all, or the small ones)")
    ap.add_argument("--ns", default=None, help="token counts, e.g. 1,16")
    ap.add_argument("--sparsities", default=None, help="e.g. 0.5,0.7 (default 0.4,0.5,0.7)")
    args = ap.parse_args()
    if args.profile:
        m, k, n, sp = args.profile.split(",")
        return profile_case(int(m), int(k), int(n), float(sp))
    if args.probe:
        probe()
    return check(args.quick, shapes_arg(args.shapes), ints_arg(args.ns), floats_arg(args.sparsities))


if __name__ == "__main__":
    sys.exit(main())
