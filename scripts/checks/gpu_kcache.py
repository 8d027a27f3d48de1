"""The kernel cache (kernels/kcache.py) on a GPU: two fresh processes on one empty cache folder.

The first compiles its kernels through numba and stores them; the second must launch every one of
them from the cache, compiling nothing. Both check each product against a float64 reference, with
outputs poisoned (NaN) first: the TCA-BME kernel (default and row kernels, N = 1, 16, 64, 100), the
2:4 kernel, and the decode kernel (bit-exact); then the default plan on the 7B shapes (spmm_ws on Hopper
from 32 tokens on the large ones) at 16, 200, 1, 64 and 32 tokens, twice each and interleaved, which is
how a kernel from the cache once met a launch past 47 KB of shared memory that only numba's copy had been
opted in for (CUDA_ERROR_INVALID_VALUE in the second process). Prints the first-launch seconds of each
process.

    python -m scripts.checks.gpu_kcache [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

TOL = 2e-3


def child() -> dict:
    import torch

    from scripts.common import masked_weight
    from sparsekit.kernels import decode, sp24_rows, spmm_rows, spmm_warp, spmm_ws, tcabme_matmul
    from sparsekit.kernels.sp24 import sp24_matmul
    from sparsekit.packed.sp24 import transcode
    from sparsekit.packed.tcabme import encode

    gen = torch.Generator(device="cuda").manual_seed(5)
    w = masked_weight(4096, 4096, 0.5, gen)
    w24 = masked_weight(4096, 4096, "2:4", gen)
    p, p24 = encode(w), encode(w24)
    lay = transcode(p24)
    torch.cuda.synchronize()
    errs, t0 = {}, time.time()
    for n in (1, 16, 64, 100):
        x = torch.randn(n, 4096, device="cuda", generator=gen).half()
        ref = x.double() @ w.double().t()
        for tag, kw in (("default", {}), ("rows", {"kernel": "rows"})):
            out = torch.full((n, 4096), float("nan"), device="cuda", dtype=torch.float16)
            tcabme_matmul(x, p, out=out, **kw)
            errs[f"tcabme {tag} N={n}"] = float((out.double() - ref).norm() / ref.norm())
        out = torch.full((n, 4096), float("nan"), device="cuda", dtype=torch.float16)
        sp24_matmul(x, lay, out=out, kernel="rows")
        ref24 = x.double() @ w24.double().t()
        errs[f"sp24 rows N={n}"] = float((out.double() - ref24).norm() / ref24.norm())
    big = [(wb, encode(wb)) for wb in (masked_weight(m, k, 0.5, gen)
                                       for m, k in ((4096, 4096), (12288, 4096), (4096, 11008), (22016, 4096)))]
    for n in (16, 200, 1, 64, 32):
        for rep in range(2):
            for wb, pb in big:
                x = torch.randn(n, wb.shape[1], device="cuda", generator=gen).half()
                ref = x.double() @ wb.double().t()
                out = torch.full((n, wb.shape[0]), float("nan"), device="cuda", dtype=torch.float16)
                tcabme_matmul(x, pb, out=out)
                key = f"tcabme default {wb.shape[0]}x{wb.shape[1]} N={n} #{rep + 1}"
                errs[key] = float((out.double() - ref).norm() / ref.norm())
    dense = torch.full_like(w, float("nan"))
    decode.tcabme_decode(p, out=dense)
    torch.cuda.synchronize()
    first_s = time.time() - t0
    same = bool(torch.equal(dense.view(torch.int16), w.view(torch.int16)))
    kernels = [*spmm_warp.compiled_kernels().values(), *spmm_rows.compiled_kernels().values(),
               *sp24_rows.compiled_kernels().values(), *spmm_ws.compiled_kernels().values(), decode.get_kernel()]
    compiled = sum(len(k.overloads) for k in kernels)
    return {"first_launch_s": first_s, "errors": errs, "decode_bit_exact": same, "kernels": len(kernels),
            "numba_compiles": compiled}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write both runs' results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child()), flush=True)
        return 0
    runs = []
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, SPARSEKIT_CACHE=d, SPARSEKIT_STRICT="1")
        env.pop("SPARSEKIT_KERNEL_CACHE", None)
        for i in range(2):
            t = time.time()
            r = subprocess.run([sys.executable, "-m", "scripts.checks.gpu_kcache", "--child"], env=env,
                               capture_output=True, text=True)
            line = next((s for s in r.stdout.splitlines() if s.startswith("RESULT ")), None)
            if r.returncode or line is None:
                print(f"run {i + 1} failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
                return 1
            for s in dict.fromkeys(s for s in r.stderr.splitlines() if "kernel cache" in s or "Error" in s):
                print(f"  run {i + 1} said: {s.strip()[:300]}")
            res = json.loads(line[7:])
            res["process_s"] = time.time() - t
            res["files"] = len([f for f in os.listdir(os.path.join(d, "kernels")) if f.endswith(".cubin")]) \
                if os.path.isdir(os.path.join(d, "kernels")) else 0
            runs.append(res)
            worst = max(res["errors"].values())
            print(f"run {i + 1}: first launches {res['first_launch_s']:.1f} s, process {res['process_s']:.1f} s, "
                  f"numba compiled {res['numba_compiles']} of {res['kernels']} kernels, {res['files']} cubins on disk, "
                  f"worst rel err {worst:.2e}, decode bit-exact {res['decode_bit_exact']}")
    bad = [f"run {i + 1} {k}: {e:.2e}" for i, r in enumerate(runs) for k, e in r["errors"].items()
           if not e < TOL]
    bad += [f"run {i + 1}: decode not bit-exact" for i, r in enumerate(runs) if not r["decode_bit_exact"]]
    if runs[0]["files"] == 0:
        bad.append("the first run stored no kernel")
    if runs[1]["numba_compiles"]:
        bad.append(f"the second run compiled {runs[1]['numba_compiles']} kernels (expected 0: all from the cache)")
    for b in bad:
        print("FAIL", b)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "failures": bad}, f, indent=1)
    print("kernel cache check:", "ok" if not bad else f"{len(bad)} failures")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
