"""Compile the 2:4 tile-mosaic kernel to PTX for sm_90 without a GPU, assemble it with ``ptxas -v``
and count its tensor-core instructions: registers, spills, and the number of ``mma.sp`` / ``mma.sync``
(PTX) and ``HMMA`` (SASS, when ``nvdisasm`` is found) per kernel variant.

Needs numba-cuda and NVVM (``pip install --target DIR "numba-cuda[cu13]"``) and ``ptxas`` on PATH
(``nvdisasm`` optional: ``pip install --target DIR2 nvidia-cuda-nvdisasm``)::

    LD_LIBRARY_PATH=DIR/nvidia/cu13/lib PYTHONPATH=DIR python -m scripts.checks.ptxas_sp24 \
        [--nvdisasm DIR2/nvidia/cu13/bin/nvdisasm] [--keep OUT]

(``DIR`` holds numba-cuda's import redirector, which this script imports, since ``--target``
installs do not run ``.pth`` files.)
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
try:
    import _numba_cuda_redirector  # noqa: F401 - numba.cuda -> numba-cuda for --target installs
except ImportError:
    pass

from numba import cuda, types  # noqa: E402

from sparsekit.kernels import sp24_kernel, sp24_rows  # noqa: E402

VARIANTS = [(8, 4), (8, 2), (8, 1), (16, 2), (16, 1), (32, 1), (64, 1)]   # (tokens per block, strip rows per block)
ROWS_VARIANTS = [(8, 4), (16, 4), (32, 3), (64, 2)]             # sp24_rows: (tokens per block, stages)


def ptx_of(nt: int, r: int, maxreg: int, kernel: str = "warps") -> str:
    arr32 = types.Array(types.int32, 1, "C")
    arr16 = types.Array(types.int16, 1, "C")
    if kernel == "rows":
        kern = sp24_rows.get_kernel(nt, r, maxreg=maxreg)
        sig = (arr32, arr32, arr32, arr32, arr16, types.Array(types.float32, 1, "C"), arr32) + (types.int64,) * 6
    else:
        kern = sp24_kernel.get_kernel(nt, r, maxreg)
        sig = (arr32, arr32, arr32, arr32, arr16) + (types.int64,) * 5
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))
    return ptx


def assemble(p: Path, cubin: Path, maxreg: int) -> str:
    """``ptxas -v`` output. NVVM may write a newer ``.version`` than this ptxas reads (NVVM 13.5 writes
    9.5, ptxas 13.0 reads 9.0): the line is lowered to what ptxas names, once (the kernel uses no
    newer PTX feature: mma.sp::ordered_metadata needs 8.5)."""
    cmd = ["ptxas", "-arch=sm_90", "-v", f"-maxrregcount={maxreg}", str(p), "-o", str(cubin)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    have = re.search(r"Unsupported \.version [0-9.]+; current version is '([0-9.]+)'", res.stderr)
    if res.returncode and have:
        p.write_text(re.sub(r"^\.version [0-9.]+", f".version {have.group(1)}", p.read_text(), flags=re.M))
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"ptxas failed on {p}: {res.stderr.strip()}")
    return res.stderr


def main_loop(sass: str) -> tuple[int, int]:
    """(instructions, HMMA) of the step loop: of the backward branch spans with 16-byte loads, the one
    holding the most HMMA, the shortest of those."""
    insts: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(insts)
            continue
        m = re.match(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            insts.append(m.group(1))
    best = (0, 0, 0)
    for i, ins in enumerate(insts):
        m = re.search(r"BRA\s+(?:\S+,\s*)?`\((\.L_x_\d+)\)", ins)
        if m and labels.get(m.group(1), i) < i:
            span = insts[labels[m.group(1)]:i + 1]
            loads = sum("LDG.E.128" in s or "LDGSTS" in s for s in span)
            key = (sum("HMMA" in s for s in span), -len(span), loads)
            if loads:
                best = max(best, key)
    return -best[1], best[0]


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text, flags=re.M))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    ap.add_argument("--maxreg", type=int, default=128)
    ap.add_argument("--keep", help="directory to keep the .ptx / .cubin / .sass files in")
    ap.add_argument("--kernel", choices=("warps", "rows"), default="warps",
                    help="sp24_kernel (warps split K; R = strip rows) or sp24_rows (R = stages)")
    args = ap.parse_args()
    out = Path(args.keep or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    print("| NT | R | registers | spill stores/loads | local bytes | PTX mma.sp | PTX mma.sync | SASS HMMA.SP | SASS HMMA | SASS total | step loop (SASS, HMMA) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for nt, r in (ROWS_VARIANTS if args.kernel == "rows" else VARIANTS):
        ptx = ptx_of(nt, r, args.maxreg, args.kernel)
        p = out / f"sp24_{args.kernel}_n{nt}_r{r}.ptx"
        p.write_text(ptx)
        cubin = p.with_suffix(".cubin")
        info = assemble(p, cubin, args.maxreg)
        regs = re.search(r"Used (\d+) registers", info)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
        stack = re.search(r"(\d+) bytes stack frame", info)
        n_sp = count(r"^\s*mma\.sp", ptx)
        n_mma = count(r"^\s*mma\.sync", ptx)
        sass = loop = "-"
        hsp = hd = "-"
        if args.nvdisasm:
            text = subprocess.run([args.nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
            cubin.with_suffix(".sass").write_text(text)
            hsp = str(count(r"HMMA\.SP", text))
            hd = str(count(r"HMMA\.(?!SP)", text))
            sass = str(count(r"^\s+/\*[0-9a-f]{4,}\*/", text))
            loop = "%d, %d" % main_loop(text)
        print(f"| {nt} | {r} | {regs.group(1) if regs else '?'} | "
              f"{spill.group(1) + '/' + spill.group(2) if spill else '?'} | {stack.group(1) if stack else '?'} | "
              f"{n_sp} | {n_mma} | {hsp} | {hd} | {sass} | {loop} |")
    print(f"files in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
