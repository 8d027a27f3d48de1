"""Registers, spills and SASS instruction counts of the TCA-BME kernels, on a machine WITHOUT a GPU.

numba's own CUDA target wants a driver to compile device functions; numba-cuda (the separate
package, as on the GPU image) compiles PTX without one. Install it once beside the project:

    pip install --target /tmp/nc "numba-cuda[cu13]==0.30.4" nvidia-cuda-nvdisasm
    PYTHONPATH=/tmp/nc LD_LIBRARY_PATH=/tmp/nc/nvidia/cu13/lib python -m scripts.bench.ptxas_kernels --numba-cuda /tmp/nc

Then ``ptxas -arch=sm_90 -v`` (the system's; if it is older than the PTX numba-cuda writes, the
``.version`` line is lowered to what it accepts, which is safe for these kernels: they use no newer
PTX) and nvdisasm count, per kernel variant: registers, spill bytes, stack frame, and the SASS
instructions of the main loop's one step (a 16x64 strip per warp): HMMA, LDSM, POPC, LDS, PRMT,
SHFL, and all of them. Every count is per kernel, and the kernels' main loops are not unrolled,
so per-step counts are these (the prologue and epilogue hold none of the HMMA/LDSM/POPC).
Kernels: spmm_rows (``rows``, 8-64 tokens per block), spmm_warp; ``--only rows`` picks by label
prefix, ``--keep DIR`` keeps each variant's .ptx, .cubin and .sass (to read the step loop).
"""
from __future__ import annotations

import argparse
import os
import re
import site
import subprocess
import tempfile
from pathlib import Path

OPS = ("HMMA", "LDSM", "POPC", "LDS", "PRMT", "SHFL")


def _ptxas(ptx: str, regs: int, work: Path, name: str) -> tuple[dict, str]:
    src = work / f"{name}.ptx"
    cub = work / f"{name}.cubin"
    src.write_text(ptx)
    cmd = ["ptxas", "-arch=sm_90", "-v", f"-maxrregcount={regs}", str(src), "-o", str(cub)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    old = re.search(r"current version is '([0-9.]+)'", run.stderr)
    if run.returncode and old:
        src.write_text(re.sub(r"^\.version [0-9.]+", f".version {old.group(1)}", ptx, count=1, flags=re.M))
        run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stderr)
    info = run.stderr
    out = {"regs": int(re.search(r"Used (\d+) registers", info).group(1)),
           "stack": int(re.search(r"(\d+) bytes stack frame", info).group(1)),
           "spill": int(re.search(r"(\d+) bytes spill stores", info).group(1))}
    return out, str(cub)


def _sass_counts(cubin: str, nvdisasm: str) -> tuple[dict, dict]:
    """(counts over the whole kernel, counts over its main loop): the main loop is the smallest
    region from a label to a backward branch to it that holds every HMMA."""
    text = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    ops, labels, back = [], {}, []
    for ln in text.splitlines():
        lab = re.match(r"^(\.L_x_\d+):", ln)
        if lab:
            labels[lab.group(1)] = len(ops)
            continue
        if not re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", ln):
            continue
        op = re.sub(r"^.*?/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", ln).split()[0]
        tgt = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", ln)
        if tgt:
            back.append((tgt.group(1), len(ops)))
        ops.append(op)
    hmma = [i for i, o in enumerate(ops) if o.startswith("HMMA")]
    loops = [(labels[t], i) for t, i in back if t in labels and labels[t] <= hmma[0] and i >= hmma[-1]]
    lo, hi = min(loops, key=lambda r: r[1] - r[0]) if loops else (0, len(ops) - 1)

    def count(seq):
        c = {op: sum(1 for o in seq if o.split(".")[0] == op) for op in OPS}
        c["all"] = len(seq)
        c["other"] = len(seq) - c["HMMA"] - c["LDSM"]
        return c

    return count(ops), count(ops[lo:hi + 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numba-cuda", default=os.environ.get("NUMBA_CUDA_TARGET_DIR", "/tmp/nc"),
                    help="directory numba-cuda was pip-installed into with --target")
    ap.add_argument("--nvdisasm", default=None)
    ap.add_argument("--only", default=None, help="kernels whose label starts with this (e.g. rows)")
    ap.add_argument("--keep", default=None, help="directory to keep each kernel's .ptx, .cubin and .sass in")
    args = ap.parse_args()
    site.addsitedir(args.numba_cuda)  # runs numba-cuda's import redirector (.pth); PYTHONPATH puts it first
    nvdisasm = args.nvdisasm or str(Path(args.numba_cuda) / "nvidia" / "cu13" / "bin" / "nvdisasm")

    from numba import cuda
    from numba.cuda import types

    from sparsekit.kernels import plan, spmm_rows, spmm_warp

    arr = lambda dt: types.Array(dt, 1, "C")  # noqa: E731
    arrays = (arr(types.int64), arr(types.int64), arr(types.int32), arr(types.int32), arr(types.int64),
              arr(types.int16))
    # spmm_rows: bitmaps, values, offsets, x, y, the split-K workspace and counters
    rows_arrays = (arr(types.int64), arr(types.int64), arr(types.int32), arr(types.int32), arr(types.int64),
                   arr(types.int16), arr(types.float32), arr(types.int32))
    rows = []
    # (label, kernel, scalar count, register cap[, signature])
    for nt in (8, 16, 32, 64):
        regs = plan.rows_max_registers(nt)
        st = plan.rows_stages(nt)
        rows.append((f"rows NT={nt:3d} stages={st}", spmm_rows.get_kernel(nt, st, 3, regs), 6, regs, rows_arrays))
    rows.append(("rows NT= 64 stages=2 regs=168", spmm_rows.get_kernel(64, 2, 3, 168), 6, 168, rows_arrays))
    for n in (1, 8, 16, 32, 64):
        regs = spmm_warp.max_registers(n, 1)
        rows.append((f"spmm_warp N={n:3d} R=1", spmm_warp.get_kernel(n, 2, 3, 1, regs), 5, regs))
    print("main loop (one step: a 16x64 strip per warp); 'other' = every loop instruction but HMMA and LDSM")
    print(f"{'kernel':28s} regs spill stack " + " ".join(f"{o:>5s}" for o in OPS) + " other   all  kernel")
    if args.only:
        rows = [r for r in rows if r[0].startswith(args.only)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for label, kern, nscal, regs, *sig in rows:
            ptx, _ = cuda.compile_ptx(kern.py_func, (sig[0] if sig else arrays) + (types.int64,) * nscal, cc=(9, 0))
            name = re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")
            res, cub = _ptxas(ptx, regs, work, name)
            whole, c = _sass_counts(cub, nvdisasm)
            if args.keep:
                sass = subprocess.run([nvdisasm, "-c", cub], capture_output=True, text=True, check=True).stdout
                Path(cub).with_suffix(".sass").write_text(sass)
            print(f"{label:28s} {res['regs']:4d} {res['spill']:5d} {res['stack']:5d} "
                  + " ".join(f"{c[o]:5d}" for o in OPS) + f" {c['other']:5d} {c['all']:5d} {whole['all']:7d}")


if __name__ == "__main__":
    main()
