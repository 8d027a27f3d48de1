"""GPU check and benchmark of the 2:4 tile-mosaic kernel (issue 22), one command, about 5 minutes on
an H100:

    SPARSEKIT_STRICT=1 python -m scripts.checks.gpu_sp24 [--quick] [--hybrid 0.25,0.35,0.45]

1. **mma.sp on the device**: one ``mma.sp`` m16n8k32 with every register built from the documented
   layouts (``sparsekit.kernels.sp24_probe``) against float64, and the same with the metadata row
   halves swapped, which must fail.
2. **Correctness**: all-2:4, all-dense and mixed mosaics (random tiles), shapes with M and K not
   multiples of 64, N from 1 to 4096 (odd ones included); outputs poisoned with NaN; relative error
   against a float64 reference < 1e-3 (fp16 output rounding is ~2e-4); a CUDA-graph capture replayed
   with new inputs. Exits 1 on any failure, before timing.
3. **Timing** (microseconds per call, median of CUDA-graph replays over rotated weight copies that
   together exceed the L2): cuBLAS on the dense weight, torch's cuSPARSELt
   (``to_sparse_semi_structured``) on the same 2:4 weight, this kernel on it, and on hybrid mosaics.
   ``x`` columns are speedups over cuBLAS.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from scripts.common import copies_for, floats_arg, ints_arg, plan_arg, shapes_arg, time_calls
from sparsekit.kernels.sp24 import sp24_matmul
from sparsekit.kernels.sp24_probe import c_fragment, mma_sp_once, random_operands, swap_halves
from sparsekit.packed.sp24 import transcode
from sparsekit.pruning.patterns import nm_mask
from sparsekit.runtime.sp24 import sp24_cslt_mm_eager, sp24_dense_mm_eager

CHECK_SHAPES = [(4096, 4096), (22016, 4096), (4096, 11008), (100, 72), (200, 130), (1000, 333), (64, 4160),
                (130, 1000)]
CHECK_NS = [1, 2, 7, 8, 9, 16, 17, 31, 32, 33, 63, 64, 100, 127, 128, 512, 4096]
BENCH_SHAPES = [(22016, 4096), (4096, 11008), (8192, 28672)]
BENCH_NS = [1, 16, 32, 64, 128, 512]
# forced sp24_rows plans: checked for correctness at a few N; --sweep times SWEEP_ROWS
FORCED_ROWS = [dict(splits=1), dict(splits=3), dict(tokens=8), dict(tokens=64, stages=2), dict(stages=2),
               dict(strips=2), dict(strips=1), dict(strips=2, splits=3)]
# forced sp24_wg plans (Hopper: all-2:4 weights), checked at a few N
FORCED_WG = [dict(tokens=t, groups=g, strips=r) for t in (8, 32, 128) for g in (1, 2) for r in (1, 2)] + \
    [dict(splits=3), dict(stages=3), dict(kstep=2, splits=3), dict(tokens=64, groups=2, strips=2, stages=4, splits=1)]
# sp24_ws in thread-block clusters sharing X by multicast (docs/kernels-notes.md "v22"), every shape, a few N
FORCED_CLUSTER = [dict(cluster=2), dict(cluster=4, tokens=64), dict(cluster=2, groups=1, strips=1),
                  dict(cluster=4, tokens=256, strips=1, groups=2, stages=3)]   # (the 128x256 prefill tile)
SWEEP_ROWS = [dict(splits=s) for s in (1, 2, 3, 4, 6, 8)] + [dict(strips=2, splits=s) for s in (1, 2, 4)] + \
    [dict(tokens=t) for t in (8, 16, 32)] + [dict(stages=s) for s in (2, 3, 4, 6)]
# ... and at up to 16 tokens sp24_kernel's warps a block and strip rows (its plan keeps ~8 steps a warp, each step's
# loads waited on before the next are issued: docs/kernels-notes.md "v42", the fixed cost at one token)
SWEEP_WARPS = [dict(warps=w) for w in (2, 4, 8, 12, 16)] + [dict(strips=r) for r in (1, 2, 4)] + \
    [dict(warps=16, strips=r) for r in (1, 2)]
# --sweep on Hopper: forced sp24_ws plans (ring depth, K split, tile rows, warpgroups), on all-2:4 and hybrid layouts
SWEEP_WS = [dict(stages=s) for s in (3, 4, 6, 8)] + [dict(splits=s) for s in (1, 2, 4, 8)] + \
    [dict(strips=r, groups=g) for r in (1, 2) for g in (1, 2)] + [dict(stages=8, splits=s) for s in (2, 4)]
# ... and from 32 tokens, tile widths x K splits (x one warpgroup): where the H200's plans of "v41" came from
SWEEP_WS_WIDE = [dict(tokens=t, splits=s) for t in (16, 32, 64) for s in (1, 2, 4, 8)] + \
    [dict(tokens=t, splits=s, groups=1) for t in (32, 64) for s in (4, 8)]
WS_PLAN: dict = {}   # --ws-plan: the ws column's forced plan
# NUMBA_ENABLE_CUDASIM=1 (a dry run of the checks on CPU tensors, tiny shapes only: --check-shapes)
DEV = "cpu" if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else "cuda"


def mosaic(m: int, k: int, sp_frac: float, gen: torch.Generator) -> torch.Tensor:
    """fp16 [m, k]: each 64x64 tile (edge tiles cut) 2:4 with probability ``sp_frac``, else dense."""
    w = torch.randn(m, k, device=DEV, generator=gen).half()
    if sp_frac <= 0:
        return w
    k4 = -(-k // 4) * 4                        # 2:4 groups from column 0; the last one may be cut
    keep = nm_mask(torch.rand(m, k4, device=DEV, generator=gen), 2, 4)[:, :k]
    gm, gk = -(-m // 64), -(-k // 64)
    tiles = torch.rand(gm, gk, device=DEV, generator=gen) < sp_frac
    if sp_frac >= 1:
        tiles[:] = True
    sp = tiles.repeat_interleave(64, 0).repeat_interleave(64, 1)[:m, :k]
    return torch.where(sp, w * keep, w)


def matmul(x: torch.Tensor, lay, out: torch.Tensor | None = None, kernel: str = "auto", **plan) -> torch.Tensor:
    """``sp24_matmul``, or with ``kernel="decode"`` the prefill path of a layer that keeps only its 2:4 layout: the
    layout decoded (``kernels.sp24_decode``), then cuBLAS (``runtime.sp24.sp24_dense_mm_eager``); ``"cslt"``: that of an
    all-2:4 one, the layout rewritten for cuSPARSELt, then its product (``runtime.sp24.sp24_cslt_mm_eager``)."""
    if kernel not in ("decode", "cslt"):
        return sp24_matmul(x, lay, out=out, kernel=kernel, **plan)
    fn = sp24_dense_mm_eager if kernel == "decode" else sp24_cslt_mm_eager
    y = fn(x, lay.dense, lay.sp, lay.tiles, lay.shape[0])
    return y if out is None else out.copy_(y)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(y).any():
        return float("nan")
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def check_mma_sp() -> int:
    bad = 0
    for seed in range(4):
        a, b, c, (ar, br, meta, cr) = random_operands(seed)
        ref = c_fragment(a.double() @ b.double() + c.double())
        d = mma_sp_once(ar.to(DEV), br.to(DEV), meta.to(DEV), cr.to(DEV)).cpu().double()
        err = float((d - ref).abs().max() / ref.abs().max())
        swapped = mma_sp_once(ar.to(DEV), br.to(DEV), swap_halves(meta).to(DEV), cr.to(DEV)).cpu().double()
        caught = float((swapped - ref).abs().max() / ref.abs().max()) > 0.1
        ok = err < 1e-5 and caught
        bad += not ok
        print(f"mma.sp probe seed {seed}: max rel err {err:.2e}, swapped halves caught: {caught} -> {'ok' if ok else 'FAIL'}")
    return bad


def check_cslt(shapes) -> int:
    """cuSPARSELt's buffer of a 2:4 weight three ways, byte for byte: ``torch._cslt_compress``, the reference
    ``packed.cslt.compress`` and the transcode kernel on the weight's layout (shapes of multiples of 64). No kept
    value is zero: in a group with fewer than two nonzeros cuSPARSELt may keep other slots (other bytes, the same
    product)."""
    from sparsekit.kernels.sp24_cslt import sp24_to_cslt
    from sparsekit.packed.cslt import compress
    from sparsekit.torch_compat import cslt_compress

    gen = torch.Generator(device=DEV).manual_seed(2)
    bad = 0
    for m, k in [(m, k) for m, k in shapes if m % 64 == 0 and k % 64 == 0]:
        v = torch.randn(m, k, device=DEV, generator=gen).half()
        keep = nm_mask(torch.rand(m, k, device=DEV, generator=gen), 2, 4)
        w = torch.where(keep, torch.where(v.abs() < 1e-2, torch.ones_like(v), v), torch.zeros_like(v))
        theirs = cslt_compress(w).view(torch.int16)
        for name, ours in (("reference", compress(w)), ("kernel", sp24_to_cslt(transcode(w)))):
            if not torch.equal(ours.view(torch.int16), theirs):
                bad += 1
                print(f"FAIL cuSPARSELt layout {m}x{k}: {name} differs from torch._cslt_compress")
    print(f"cuSPARSELt layout: {bad} failures")
    return bad


def check(shapes, ns, quick: bool, kernels=("auto", "rows", "warps")) -> int:
    gen = torch.Generator(device=DEV).manual_seed(0)
    bad = cases = refused = 0
    worst = 0.0
    t0 = time.time()
    for m, k in shapes:
        for name, frac in (("2:4", 1.0), ("dense", 0.0), ("mixed", 0.5)):
            if quick and name != "mixed" and m * k > 2**24:
                continue
            w = mosaic(m, k, frac, gen)
            lay = transcode(w)
            for n in ns:
                if n > 512 and m * k > 2**24 and name != "2:4":
                    continue
                x = torch.randn(n, k, device=DEV, generator=gen).half()
                ref = x.double() @ w.double().t()
                # sp24_wg takes all-2:4 weights only (sp24_ws dense tiles too)
                variants = [dict(kernel=kn) for kn in kernels if kn not in ("wg", "cslt") or name == "2:4"
                            and (kn == "wg" or DEV == "cuda" and m % 64 == 0 and k % 64 == 0)]
                if "rows" in kernels and n in (1, 17, 64) and m * k <= 2**24:
                    variants += [dict(kernel="rows", **kw) for kw in FORCED_ROWS]
                for kn in ("wg", "ws"):
                    if kn in kernels and (name == "2:4" or kn == "ws") and n in (1, 17, 64, 129) and m * k <= 2**24:
                        variants += [dict(kernel=kn, **kw) for kw in FORCED_WG if kn == "wg" or "kstep" not in kw]
                if "ws" in kernels and DEV == "cuda" and n in (1, 17, 64, 128):
                    variants += [dict(kernel="ws", **kw) for kw in FORCED_CLUSTER]
                for kw in variants:
                    out = torch.full((n, m), float("nan"), dtype=torch.float16, device=DEV)
                    try:
                        matmul(x, lay, out=out, **kw)
                    except ValueError:
                        if len(kw) == 1:            # a kernel's own plan must always run
                            raise
                        refused += 1                # a forced plan its kernel refuses (one clear error)
                        continue
                    err = rel_err(out, ref)
                    cases += 1
                    worst = max(worst, err) if err == err else worst
                    if not err < 1e-3:
                        bad += 1
                        print(f"FAIL {name} {m}x{k} N={n} {kw}: rel err {err}")
            del w, lay
    if DEV == "cpu":
        print(f"correctness: {cases} cases, {bad} failures, worst rel err {worst:.2e}, {refused} forced plans "
              "refused (simulator: no graph check)")
        return bad
    # CUDA graph: capture once, replay with new inputs (split-K counters must reset between replays)
    # (cslt is not captured: a plan's first call times cuSPARSELt's algorithms, and prefill runs eagerly)
    for kn, (m, k) in [(kn, mk) for kn in kernels if kn != "cslt" for mk in ((1000, 333), (4096, 4096))]:
        w = mosaic(m, k, 1.0 if kn in ("wg", "ws") else 0.5, gen)
        lay = transcode(w)
        x = torch.randn(9, k, device=DEV, generator=gen).half()
        y = matmul(x, lay, kernel=kn)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = matmul(x, lay, kernel=kn)
        for _ in range(3):
            x.copy_(torch.randn(9, k, device=DEV, generator=gen).half())
            y.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            err = rel_err(y, x.double() @ w.double().t())
            cases += 1
            if not err < 1e-3:
                bad += 1
                print(f"FAIL graph replay {kn} {m}x{k}: rel err {err}")
    print(f"correctness: {cases} cases, {bad} failures, worst rel err {worst:.2e}, {refused} forced plans refused "
          f"({time.time() - t0:.0f} s)")
    return bad


def bench(shapes, ns, hybrids, kernels=("auto", "rows", "warps"), sweep: bool = False, hkernels=None) -> None:
    hkernels = hkernels or tuple(kn for kn in kernels if kn != "cslt")[:1] or ("auto",)   # cslt: all-2:4 only
    gen = torch.Generator(device=DEV).manual_seed(1)
    try:
        from torch.sparse import to_sparse_semi_structured
    except ImportError as e:  # pragma: no cover - old torch
        to_sparse_semi_structured = None
        print(f"cuSPARSELt column: n/a ({e})")
    hcols = "".join(f" | hybrid {h:.0%} {kn} us | x" for h in hybrids for kn in hkernels)
    kcols = "".join(f" | {kn} 2:4 us | x" for kn in kernels)
    print(f"\n| M x K | N | cuBLAS us | cuSPARSELt us | x{kcols}{hcols} |")
    print("|---|---|---|---|---" + "|---|---" * (len(kernels) + len(hybrids) * len(hkernels)) + "|")
    for m, k in shapes:
        copies = copies_for(m * k * 2)
        dense = [mosaic(m, k, 1.0, gen) for _ in range(copies)]
        lays = [transcode(w) for w in dense]
        semi = None
        if to_sparse_semi_structured is not None:
            try:
                semi = [to_sparse_semi_structured(w) for w in dense]
            except Exception as e:  # noqa: BLE001 - reported in the table
                print(f"cuSPARSELt on {m}x{k}: n/a ({type(e).__name__}: {e})")
        hyb = []
        for h in hybrids:
            ws = [mosaic(m, k, h / 0.5, gen) for _ in range(copies)]
            hyb.append([transcode(w) for w in ws])
            del ws
        for n in ns:
            x = torch.randn(n, k, device=DEV, generator=gen).half()
            t_cublas, _ = time_calls([lambda w=w: F.linear(x, w) for w in dense])
            t_semi = float("nan")
            if semi is not None:
                try:
                    t_semi, _ = time_calls([lambda w=w: F.linear(x, w) for w in semi])
                except Exception as e:  # noqa: BLE001 - reported in the table
                    print(f"cuSPARSELt {m}x{k} N={n}: n/a ({type(e).__name__}: {str(e)[:120]})")
            row = f"| {m}x{k} | {n} | {t_cublas:.1f} | {t_semi:.1f} | {t_cublas / t_semi:.2f}"
            for kn in kernels:
                if kn == "cslt" and (m % 64 or k % 64):
                    row += " | n/a | n/a"             # cuSPARSELt's layout is written down for multiples of 64
                    continue
                plan = WS_PLAN if kn == "ws" else {}
                t_sp, _ = time_calls([lambda lay=lay: matmul(x, lay, kernel=kn, **plan) for lay in lays])
                row += f" | {t_sp:.1f} | {t_cublas / t_sp:.2f}"
            for lays_h in hyb:
                for kn in hkernels:
                    t_h, _ = time_calls([lambda lay=lay: matmul(x, lay, kernel=kn) for lay in lays_h])
                    row += f" | {t_h:.1f} | {t_cublas / t_h:.2f}"
            print(row + " |", flush=True)
            if sweep:
                sweep_plans(x, "rows", SWEEP_ROWS, lays, dense[0], t_cublas, "2:4")
                for h, lays_h in zip(hybrids, hyb):
                    if n <= 16:     # where kernel_for may take rows on hybrids
                        sweep_plans(x, "rows", SWEEP_ROWS, lays_h, None, t_cublas, f"hybrid {h:.0%}")
                if n <= 16:         # where kernel_for takes sp24_kernel on small weights
                    sweep_plans(x, "warps", SWEEP_WARPS, lays, dense[0], t_cublas, "2:4")
                if DEV == "cuda" and torch.cuda.get_device_capability() == (9, 0):
                    plans = SWEEP_WS + (SWEEP_WS_WIDE if n >= 32 else [])
                    sweep_plans(x, "ws", plans, lays, dense[0], t_cublas, "2:4")
                    for h, lays_h in zip(hybrids, hyb):
                        sweep_plans(x, "ws", [kw for kw in plans if kw.get("strips", 1) == 1], lays_h, None,
                                    t_cublas, f"hybrid {h:.0%}")
        del dense, lays, semi, hyb
        torch.cuda.empty_cache()


def sweep_plans(x, kernel: str, plans, lays, w, t_cublas: float, label: str) -> None:
    """Time ``kernel`` under each forced plan of ``plans`` on the layouts ``lays`` and print them fastest first, x
    cuBLAS; each plan's product is checked first against float64 (the weight ``w``, or decoded from the layout where
    None) and a plan that is off or refused is named, not timed."""
    from sparsekit.packed.sp24 import to_dense

    ref = x.double() @ (w if w is not None else to_dense(lays[0])).double().t()
    times = {}
    for kw in plans:
        try:
            err = rel_err(sp24_matmul(x, lays[0], kernel=kernel, **kw), ref)
            if not err < 1e-2:
                print(f"    FAIL {kernel} {kw} ({label}): rel err {err:.3g}")
                continue
            times[str(kw)] = time_calls([lambda lay=lay: sp24_matmul(x, lay, kernel=kernel, **kw) for lay in lays])[0]
        except Exception as e:  # noqa: BLE001 - a forced plan may not fit: say so, go on
            print(f"    {kernel} {kw} ({label}): {type(e).__name__}: {str(e)[:80]}")
    ranked = sorted(times.items(), key=lambda kv: kv[1])
    print(f"    sweep ({kernel}, {label}), fastest first: " + ", ".join(
        f"{kw.strip('{}')} {t:.1f} us (x{t_cublas / t:.2f})" for kw, t in ranked), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the largest correctness cases")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument("--shapes", default=None, help="benchmark shapes MxK, e.g. 22016x4096")
    ap.add_argument("--ns", default=None, help="benchmark token counts, e.g. 1,16")
    ap.add_argument("--check-ns", default=None, help="correctness token counts")
    ap.add_argument("--check-shapes", default=None, help="correctness shapes MxK")
    ap.add_argument("--hybrid", default="0.35", help="hybrid sparsities to time (share of 2:4 tiles = s / 0.5)")
    ap.add_argument("--kernels", default="auto,rows,warps", help="2:4 kernels to check and time: auto, rows, warps, "
                    "wg and ws (Hopper only), decode (the layout decoded, then cuBLAS: the prefill path) and cslt "
                    "(the layout rewritten for cuSPARSELt: all-2:4 prefill; checked byte for byte first)")
    ap.add_argument("--hybrid-kernels", default=None, help="kernels for the hybrid columns, e.g. rows,ws,decode "
                    "(default: the first of --kernels)")
    ap.add_argument("--sweep", action="store_true", help="also time forced sp24_rows plans (splits, tokens, stages), "
                    "sp24_kernel's (warps, strips) up to 16 tokens and, on Hopper, forced sp24_ws plans (stages, "
                    "splits, strips, groups) on 2:4 and hybrid layouts, "
                    "each checked against float64 first")
    ap.add_argument("--build", default=None, help="sp24_ws built another way for every check and timing "
                    "(sparsekit.kernels.sp24_ws_probe.VARIANTS, e.g. pipelined; plans it does not apply to run the "
                    "default build)")
    ap.add_argument("--ws-plan", default=None, help="the ws kernel's plan for the timings, e.g. "
                    "tokens=128,strips=2,groups=2,stages=3 (default: its own)")
    args = ap.parse_args()
    if args.build or args.ws_plan:
        from sparsekit.kernels.sp24_ws_probe import VARIANTS, built_as

        if args.build and args.build not in VARIANTS:
            ap.error(f"--build takes one of {', '.join(VARIANTS)}, got {args.build!r}")
        try:
            WS_PLAN.update(plan_arg(args.ws_plan) if args.ws_plan else {})
        except ValueError:
            ap.error(f"--ws-plan takes KEY=INT[,...], got {args.ws_plan!r}")
        if args.build:
            with built_as(args.build):
                print(f"sp24_ws built as {args.build!r}")
                return _run(args)
    return _run(args)


def _run(args) -> int:
    print(f"{torch.cuda.get_device_name() if DEV == 'cuda' else 'CUDA simulator'}, torch {torch.__version__}")
    kernels = tuple(args.kernels.split(","))
    hkernels = tuple(args.hybrid_kernels.split(",")) if args.hybrid_kernels else None
    if not args.bench_only:
        bad = check_mma_sp()
        if "cslt" in kernels and DEV == "cuda":
            bad += check_cslt(shapes_arg(args.check_shapes) or CHECK_SHAPES)
        bad += check(shapes_arg(args.check_shapes) or CHECK_SHAPES, ints_arg(args.check_ns) or CHECK_NS, args.quick,
                     tuple(dict.fromkeys(kernels + (hkernels or ()))))     # every kernel that is timed
        if bad:
            print(f"{bad} failures: no timing")
            return 1
    if not args.check_only:
        bench(shapes_arg(args.shapes) or BENCH_SHAPES, ints_arg(args.ns) or BENCH_NS, floats_arg(args.hybrid) or [],
              kernels, args.sweep, hkernels)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
