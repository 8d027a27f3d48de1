"""The TCA-BME -> dense decode kernel (``sparsekit.kernels.decode``, the prefill path of packed weights; issue 21):
bit-exact checks, then its time per weight and rate, beside the torch decode (``decode_dense``) and, with
``--against FILE``, another version of the kernel's module (a copy of ``kernels/decode.py`` from an older commit,
its relative imports made absolute); then decode + cuBLAS against cuBLAS on the dense weight at prefill sizes.
GPU only::

    python -m scripts.bench.decode_kernel [--shapes 22016x4096,4096x11008] [--sparsity 0.5,0.7] \
        [--ns 512,2048,4096] [--against old_decode.py] [--out DIR]

Checks first (exits 1 on a failure, before timing): fp16 and bf16, 0-100% sparsity, M and K not multiples of
64, a poisoned output buffer, values at an odd offset of a larger storage. Timing: each call on one of four
rotated copies (so L2 cannot hold them), median of 7 loops of 10 eager calls (small weights are bound by the
host's launches). Rate: bitmaps and values read plus the padded dense weight written, per second.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys

import torch
import torch.nn.functional as F

from scripts.common import cuda_or_exit, floats_arg, ints_arg, save_results

CHECKS = [(4096, 4096, .5, torch.float16), (22016, 4096, .5, torch.float16), (4096, 11008, .7, torch.float16),
          (130, 200, .5, torch.bfloat16), (100, 72, 0., torch.float16), (4160, 4200, .5, torch.bfloat16),
          (64, 64, 1.0, torch.float16), (300, 520, .9, torch.float16)]


def masked(m: int, k: int, sparsity: float, dtype=torch.float16) -> torch.Tensor:
    """A random weight with ``sparsity`` of it zero at random places and one stored -0.0 (``torch.where``: the
    codec keeps -0.0 as a value)."""
    w = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.where(torch.rand(m, k, device="cuda") >= sparsity, w, torch.zeros_like(w))
    w[1, 3] = -0.0
    return w


def loop_ms(fn, iters: int = 10, repeats: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


def check(decode_fn) -> int:
    from sparsekit.packed.tcabme import encode

    fails = 0
    for m, k, sp, dt in CHECKS:
        w = masked(m, k, sp, dt)
        p = encode(w)
        ok = [torch.equal(decode_fn(p).view(torch.int16), w.view(torch.int16))]
        buf = torch.full((p.grid[0] * p.grid[1] * 4096 + 64,), float("nan"), dtype=dt, device="cuda")
        ok.append(torch.equal(decode_fn(p, out=buf).view(torch.int16), w.view(torch.int16)))
        n = p.values.numel()
        store = torch.full((n + 9,), float("nan"), dtype=dt, device="cuda")
        store[3:3 + n] = p.values
        p.values = store[3:3 + n]
        ok.append(torch.equal(decode_fn(p).view(torch.int16), w.view(torch.int16)))
        fails += not all(ok)
        print(f"check {m}x{k} {sp:.0%} {str(dt)[6:]}: {'OK' if all(ok) else 'FAIL'} (fresh, into a buffer, at an "
              f"odd offset: {ok})", flush=True)
    return fails


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4096x4096,12288x4096,22016x4096,4096x11008")
    ap.add_argument("--sparsity", default="0.5,0.7")
    ap.add_argument("--ns", default="512,1024,2048,4096", help="prefill token counts for decode + cuBLAS")
    ap.add_argument("--against", default=None, metavar="FILE", help="another version of kernels/decode.py")
    ap.add_argument("--out", default=None, help="write decode_kernel.json here")
    args = ap.parse_args()
    cuda_or_exit("scripts.bench.decode_kernel")
    from sparsekit.kernels.decode import tcabme_decode
    from sparsekit.packed.tcabme import decode_dense, encode

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    other = None
    if args.against:
        spec = importlib.util.spec_from_file_location("decode_against", args.against)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if check(tcabme_decode):
        print("decode kernel: checks FAILED", file=sys.stderr)
        return 1
    rows = []
    for sp in floats_arg(args.sparsity):
        for m, k in shapes:
            packs = [encode(masked(m, k, sp)) for _ in range(4)]
            it = iter(range(10**9))

            def nxt():
                return packs[next(it) % 4]
            nbytes = packs[0].bitmaps.numel() * 8 + packs[0].values.numel() * 2 + packs[0].grid[0] * packs[0].grid[1] * 8192
            row = {"m": m, "k": k, "sparsity": sp, "kernel_us": loop_ms(lambda: tcabme_decode(nxt())) * 1e3,
                   "decode_dense_us": loop_ms(lambda: decode_dense(nxt()), 3, 3) * 1e3}
            if other is not None:
                row["against_us"] = loop_ms(lambda: other.tcabme_decode(nxt())) * 1e3
            row["kernel_TBs"] = nbytes / row["kernel_us"] / 1e6
            rows.append(row)
            print(f"decode {m}x{k} {sp:.0%}: kernel {row['kernel_us']:7.1f} us ({row['kernel_TBs']:.2f} TB/s)"
                  + (f", against {row['against_us']:7.1f} us" if other else "")
                  + f", decode_dense {row['decode_dense_us']:7.1f} us", flush=True)
    for m, k in shapes:
        ws = [masked(m, k, 0.5) for _ in range(3)]
        packs = [encode(w) for w in ws]
        it = iter(range(10**9))

        def nxt():
            return next(it) % 3
        for n in ints_arg(args.ns):
            x = torch.randn(n, k, device="cuda", dtype=torch.float16)
            row = {"m": m, "k": k, "n": n, "cublas_us": loop_ms(lambda: F.linear(x, ws[nxt()])) * 1e3,
                   "decode_cublas_us": loop_ms(lambda: F.linear(x, tcabme_decode(packs[nxt()]))) * 1e3}
            if other is not None:
                row["against_cublas_us"] = loop_ms(lambda: F.linear(x, other.tcabme_decode(packs[nxt()]))) * 1e3
            rows.append(row)
            print(f"prefill {m}x{k} N={n:5d}: cuBLAS {row['cublas_us']:8.1f} us, decode + cuBLAS "
                  f"{row['decode_cublas_us']:8.1f} ({row['cublas_us'] / row['decode_cublas_us']:.2f}x)"
                  + (f", against {row['against_cublas_us']:8.1f} ({row['cublas_us'] / row['against_cublas_us']:.2f}x)"
                     if other else ""), flush=True)
    if args.out:
        save_results(args.out, "decode_kernel.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
