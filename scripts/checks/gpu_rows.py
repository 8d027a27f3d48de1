"""GPU check and benchmark of spmm_rows (issue 21, runtime v3; ``tcabme_matmul(kernel="rows")``), one
command, about 6-9 minutes on an H100 / H200 (most of it numba compiling the variants):

    python -m scripts.checks.gpu_rows [--quick] [--check-only | --bench-only] [--sweep]

1. **Correctness**: random weights (50% and 70% sparse, 2:4, 16-row strips of mixed kinds including
   all-zero and dense ones, kept -0.0 values), shapes 4096x4096, 22016x4096, 4096x11008, 8192x28672 and
   odd ones (100x72, 1000x333, 130x4160), N from 1 to 128 including odd counts; outputs poisoned with
   NaN; relative error against a float64 reference < 1e-3 (fp16 output rounding is ~2e-4); forced plans
   (splits 1, 3, 8; tokens; stages), each run twice (split-K counters must be reset); CUDA graphs
   replayed on new inputs, with one weight first seen inside the capture. Registers and local memory of
   every compiled variant. Exits 1 on any failure, before timing.
2. **Timing** (us per call, median of CUDA-graph replays rotating over weight copies that together
   exceed the L2): cuBLAS on the dense weight, the default TCA-BME kernel (spmm_warp) and spmm_rows, at
   50% and 70%, N in 1, 8, 16, 32, 64, 128; ``x`` = cuBLAS time / ours.
3. ``--sweep``: forced spmm_rows plans (splits 1-8, tokens, stages) at 50% on SWEEP_SHAPES x SWEEP_NS,
   the best four per case.

Writes gpu_rows.json under ``--out`` (default ``$OUT``). Under ``NUMBA_ENABLE_CUDASIM=1`` the
correctness part runs on CPU tensors through the simulator (tiny shapes only: ``--check-shapes 100x72``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy

if not hasattr(numpy, "row_stack"):      # numba-cuda 0.30.4 still calls it; numpy 2.5 removed it
    numpy.row_stack = numpy.vstack

import torch  # noqa: E402

from scripts.common import (copies_for, ints_arg, kind_arg, masked_weight, save_results, shapes_arg,  # noqa: E402
                            time_calls, weight_copies)

DEV = "cpu" if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else "cuda"
CHECK_SHAPES = [(4096, 4096), (22016, 4096), (4096, 11008), (8192, 28672), (100, 72), (1000, 333), (130, 4160)]
CHECK_NS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128]
KINDS = [0.5, 0.7, "2:4", "strips"]
WIDE = {(22016, 4096), (4096, 11008), (8192, 28672)}      # 50% and 70% only (time)
FORCED = [dict(splits=1), dict(splits=3), dict(splits=8), dict(tokens=8), dict(tokens=16, stages=2),
          dict(tokens=32, stages=2), dict(tokens=64), dict(stages=2), dict(stages=3)]
BENCH_SHAPES = [(4096, 4096), (22016, 4096), (4096, 11008), (8192, 28672)]
BENCH_NS = [1, 8, 16, 32, 64, 128]
SWEEP = ([dict(splits=s) for s in (1, 2, 3, 4, 6, 8)] + [dict(tokens=t) for t in (8, 16, 32, 64)]
         + [dict(stages=s) for s in (2, 3, 4)] + [dict(tokens=16, splits=2), dict(tokens=32, splits=2)])
SWEEP_SHAPES = [(22016, 4096), (4096, 11008), (8192, 28672)]
SWEEP_NS = (1, 16, 64, 128)
TOL = 1e-3


def weight(m: int, k: int, kind, gen: torch.Generator, negzeros: int = 0) -> torch.Tensor:
    """fp16 [m, k]: ``masked_weight``'s kinds, or "strips" (16-row strips of all-zero, dense, 50%, 2:4 and
    70%-sparse weights in turn); ``negzeros`` kept weights set to -0.0 (stored as values)."""
    if kind == "strips":
        kinds = (1.0, 0.0, 0.5, "2:4", 0.7)
        parts = [masked_weight(16, k, kinds[(s + s // 4) % 5], gen, DEV) for s in range(-(-m // 16))]
        w = torch.cat(parts, 0)[:m].contiguous()
    else:
        w = masked_weight(m, k, kind, gen, DEV)
    if negzeros:
        idx = (w != 0).reshape(-1).nonzero().squeeze(1)
        pick = idx[torch.randperm(idx.numel(), device=DEV, generator=gen)[:negzeros]]
        w.view(-1)[pick] = -0.0
    return w


def rel_err(y, ref) -> float:
    if torch.isnan(y).any():
        return float("nan")
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def check(shapes, ns, kinds) -> int:
    from sparsekit.kernels import spmm_rows, tcabme_matmul
    from sparsekit.packed.tcabme import encode

    gen = torch.Generator(device=DEV).manual_seed(21)
    bad, cases, worst, t0 = 0, 0, 0.0, time.time()
    refused: set[str] = set()     # forced plans refused for shared memory (not failures)

    def run(tag, x, p, ref, m, **kw):
        nonlocal bad, cases, worst
        for rep in range(2 if kw.get("splits", 0) > 1 else 1):     # twice: the split-K counters reset
            out = torch.full((x.shape[0], m), float("nan"), device=DEV, dtype=torch.float16)
            cases += 1
            try:
                tcabme_matmul(x, p, out=out, kernel="rows", **kw)
                e = rel_err(out, ref)
            except ValueError as exc:
                if kw and "shared memory" in str(exc):   # a forced plan the planner refuses, as it must
                    cases -= 1
                    refused.add(str(kw))
                    return
                e = f"{type(exc).__name__}: {str(exc)[:100]}"
            except Exception as exc:  # noqa: BLE001 - report the case, keep checking
                e = f"{type(exc).__name__}: {str(exc)[:100]}"
            if isinstance(e, float) and e < TOL:
                worst = max(worst, e)
            else:
                bad += 1
                print(f"FAIL {tag} {kw} (call {rep + 1}): {e}", flush=True)

    for si, (m, k) in enumerate(shapes):
        for kind in kinds:
            if (m, k) in WIDE and kind not in (0.5, 0.7) and len(shapes) > 1:
                continue
            w = weight(m, k, kind, gen, negzeros=1000 if kind == 0.5 else 0)
            p = encode(w)
            wd = w.double()
            for n in ns:
                x = torch.randn(n, k, device=DEV, generator=gen).half()
                ref = x.double() @ wd.t()
                tag = f"{m}x{k} {kind} N={n}"
                run(tag, x, p, ref, m)
                if si < 2 and kind in (0.5, "strips") and n in (1, 17, 64, 128):
                    for kw in FORCED:
                        run(tag, x, p, ref, m, **kw)
            del p, wd, w
        print(f"  {m}x{k}: {cases} cases so far, {bad} failures, worst rel err {worst:.2e}, "
              f"{time.time() - t0:.0f}s", flush=True)
    if DEV == "cuda":
        bad, cases = graph_check(gen, bad, cases)
        for key, kern in sorted(spmm_rows.compiled_kernels().items()):
            try:
                print(f"rows kernel (nt, stages, cmax, regcap)={key}: regs {kern.get_regs_per_thread()}, "
                      f"local {kern.get_local_mem_per_thread()} B")
            except Exception as e:  # noqa: BLE001
                print(f"rows kernel {key}: resource query failed: {e}")
    if refused:
        print(f"forced plans refused for shared memory (the planner says so, as it must): {sorted(refused)}")
    print(f"gpu_rows check: {cases} cases, {bad} failures, worst rel err {worst:.2e}, {time.time() - t0:.0f}s")
    return bad


def graph_check(gen, bad: int, cases: int) -> tuple[int, int]:
    """Several launches captured in one CUDA graph (split-K on 4096x4096), replayed on new inputs; at
    N = 1 the second weight is first seen inside the capture (dense value copies)."""
    from sparsekit.kernels import tcabme_matmul
    from sparsekit.packed.tcabme import encode

    m, k = 4096, 4096
    ws = [weight(m, k, kind, gen) for kind in (0.5, 0.7)]
    ps = [encode(w) for w in ws]
    for n in (1, 16, 77):
        x = torch.randn(n, k, device=DEV, generator=gen).half()
        outs = [torch.empty(n, m, device=DEV, dtype=torch.float16) for _ in ps]
        for i, p in enumerate(ps):
            if n != 1 or i == 0:
                tcabme_matmul(x, p, out=outs[i], kernel="rows")     # warm-up: compiles the variant
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                for p, o in zip(ps, outs):
                    tcabme_matmul(x, p, out=o, kernel="rows")
        except Exception as exc:  # noqa: BLE001
            bad += 1
            print(f"FAIL graph capture n={n}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            continue
        for _ in range(3):
            x.copy_(torch.randn(n, k, device=DEV, generator=gen).half())
            for o in outs:
                o.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            for o, w in zip(outs, ws):
                e = rel_err(o, x.double() @ w.double().t())
                cases += 1
                if not e < TOL:
                    bad += 1
                    print(f"FAIL graph n={n}: rel err {e}", flush=True)
    return bad, cases


def bench(shapes, ns, kinds, sweep: bool) -> list:
    from sparsekit.kernels import tcabme_matmul
    from sparsekit.packed.tcabme import encode

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m, k in shapes:
        dense = torch.randn(m, k, device="cuda", generator=gen).half()
        nd = copies_for(dense.numel() * 2)
        dcopies = [dense.clone() for _ in range(nd)]
        cublas = {}
        for n in ns:
            x = torch.randn(n, k, device="cuda", generator=gen).half()
            ys = [torch.empty(n, m, device="cuda", dtype=torch.float16) for _ in range(nd)]
            cublas[n] = time_calls([lambda i=i: torch.matmul(x, dcopies[i].t(), out=ys[i]) for i in range(nd)])[0]
        del dcopies, dense
        for kind in kinds:
            p = encode(masked_weight(m, k, kind, gen))
            pc = weight_copies(p)
            for n in ns:
                x = torch.randn(n, k, device="cuda", generator=gen).half()
                ys = [torch.empty(n, m, device="cuda", dtype=torch.float16) for _ in pc]

                def timed(**kw):
                    try:
                        return time_calls([lambda i=i: tcabme_matmul(x, pc[i], out=ys[i], **kw)
                                           for i in range(len(pc))])[0]
                    except Exception as e:  # noqa: BLE001 - a forced plan may not fit: say so, go on
                        print(f"    {kw}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                        return float("nan")

                base = timed(kernel="default")
                ours = timed(kernel="rows")
                row = dict(m=m, k=k, kind=str(kind), n=n, cublas_us=cublas[n], default_us=base, rows_us=ours,
                           x_default=cublas[n] / base, x_rows=cublas[n] / ours, packed_bytes=p.nbytes)
                if sweep and (m, k) in SWEEP_SHAPES and kind == 0.5 and n in SWEEP_NS:
                    forced = {json.dumps(kw): timed(kernel="rows", **kw) for kw in SWEEP}
                    best = sorted((t, s) for s, t in forced.items() if t == t)[:4] or [(float("nan"), "-")]
                    row.update(sweep=forced, best=best[0][1], x_best=cublas[n] / best[0][0])
                    print("    sweep best: " + ", ".join(f"{s} {t:.1f}us (x{cublas[n] / t:.2f})" for t, s in best))
                rows.append(row)
                print(f"{m:>5}x{k:<5} {kind!s:>4} N={n:<3} cuBLAS {cublas[n]:7.1f}us default {base:7.1f}us "
                      f"(x{cublas[n] / base:4.2f}) rows {ours:7.1f}us (x{cublas[n] / ours:4.2f})", flush=True)
            del pc, p
    return rows


def table(rows) -> str:
    ns = sorted({r["n"] for r in rows})
    lines = ["| weight | mask | " + " | ".join(f"N={n}" for n in ns) + " |", "|---|---|" + "---|" * len(ns)]
    for m, k, kind in dict.fromkeys((r["m"], r["k"], r["kind"]) for r in rows):
        by_n = {r["n"]: r for r in rows if (r["m"], r["k"], r["kind"]) == (m, k, kind)}
        cells = [f"{by_n[n]['x_rows']:.2f} ({by_n[n]['x_default']:.2f})" if n in by_n else "-" for n in ns]
        lines.append(f"| {m}x{k} | {kind} | " + " | ".join(cells) + " |")
    return "x cuBLAS: rows (default kernel)\n" + "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="correctness on 4096x4096, 22016x4096 and 100x72 only")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time forced spmm_rows plans")
    ap.add_argument("--check-shapes", default=None, help="correctness shapes MxK, e.g. 100x72")
    ap.add_argument("--check-ns", default=None, help="correctness token counts, e.g. 1,9")
    ap.add_argument("--kinds", default=None, help="correctness masks, e.g. 0.5,2:4 (strips: mixed strips)")
    ap.add_argument("--shapes", default=None, help="benchmark shapes MxK, e.g. 22016x4096")
    ap.add_argument("--ns", default=None, help="benchmark token counts, e.g. 1,64")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name() if DEV == 'cuda' else 'CUDA simulator'}, torch {torch.__version__}")
    if not args.bench_only:
        shapes = shapes_arg(args.check_shapes) or ([CHECK_SHAPES[0], CHECK_SHAPES[1], CHECK_SHAPES[4]] if args.quick
                                                   else CHECK_SHAPES)
        kinds = [v if v == "strips" else kind_arg(v)[0] for v in args.kinds.split(",")] if args.kinds else KINDS
        if check(shapes, ints_arg(args.check_ns) or CHECK_NS, kinds):
            print("failures: no timing")
            return 1
    if not args.check_only and DEV == "cuda":
        rows = bench(shapes_arg(args.shapes) or BENCH_SHAPES, ints_arg(args.ns) or BENCH_NS, [0.5, 0.7], args.sweep)
        print(json.dumps(save_results(args.out, "gpu_rows.json", rows)))
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
