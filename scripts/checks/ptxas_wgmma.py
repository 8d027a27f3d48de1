"""Without a GPU: build the warpgroup kernels (spmm_ws, sp24_ws, sp24_wg) for sm_90a, assemble them with
``ptxas`` and disassemble them with ``nvdisasm``, then check that no instruction writes a register an
in-flight ``wgmma`` still reads as its A operand before the ``WARPGROUP.DEPBAR`` that retires it.

ptxas does not protect those registers: a spmm_ws variant that decoded the next step's A before retiring
the previous step's products compiled without a word, put the new A values into the registers the
in-flight products were reading, and gave wrong results on an H100 (docs/kernels-notes.md "v20"). So
every kernel that issues ``wgmma`` with A from registers must retire its products before those registers
are written again, and this check reads the SASS to see that it does. Exits 1 on any hazard. It also says
where ptxas serialized a kernel's products (its "C75xx Potential Performance Loss" advisories: each product then
waits for the one before; docs/kernels-notes.md "v31").

Needs numba-cuda with NVVM, ``ptxas`` and ``nvdisasm`` (see ``scripts/checks/ptxas_sp24.py``)::

    LD_LIBRARY_PATH=DIR/nvidia/cu13/lib PYTHONPATH=DIR python -m scripts.checks.ptxas_wgmma \\
        [--nvdisasm DIR/nvidia/cu13/bin/nvdisasm] [--keep OUT]
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

_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INST = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_HGMMA_A = re.compile(r"^HGMMA\.\S+ R\d+, R(\d+),")
_DEST = re.compile(r"^(?:@!?U?P[T\d]\s+)?([A-Z][A-Z0-9._]*)\s+(R\d+)\b")
_BRANCH = re.compile(r"BRA(?:\.\S+)?\s+(?:\S+,\s*)?`\((\.L_x_\d+)\)")
_DEPBAR_LE = re.compile(r"DEPBAR\.LE gsb0, 0x([0-9a-f]+)")
_SERIALIZED = re.compile(r"\((C75\d\d)\) Potential Performance Loss: wgmma\.mma_async instructions are serialized due to "
                         r"([a-z -]+?)(?: (?:in|for) the function|$)", re.M)
_NO_DEST = ("ST", "BRA", "ISETP", "FSETP", "SYNCS", "WARPGROUP", "BSYNC", "BSSY", "HGMMA", "RED", "ATOM", "BAR")


def a_register_hazards(sass: str, window: int = 600) -> list[tuple[str, str]]:
    """``(hgmma, instruction)`` pairs: an instruction that writes one of the four A registers of an
    ``HGMMA`` (register form) after it and before the ``WARPGROUP.DEPBAR`` that retires its group, following
    the code in order and at most one backward branch (the step loop's). A group ends at the first ``HGMMA``
    marked ``gsb0`` from this one on; ``DEPBAR.LE gsb0, 0xN`` retires it once N or more groups were closed
    after it (a pipelined kernel keeps the newest N running)."""
    insts: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(insts)
            continue
        m = _INST.match(line)
        if m:
            insts.append(m.group(1))
    found = []
    for i, ins in enumerate(insts):
        m = _HGMMA_A.match(ins)
        if not m:
            continue
        regs = {f"R{int(m.group(1)) + k}" for k in range(4)}
        closed = "gsb0" in ins                    # its group ends here, or at a later HGMMA marked gsb0
        newer = 0                                 # groups closed after it
        j, hops, steps = i + 1, 0, 0
        while j < len(insts) and steps < window:
            t = insts[j]
            steps += 1
            if t.startswith("HGMMA") and "gsb0" in t:
                if closed:
                    newer += 1
                closed = True
            if t.startswith("WARPGROUP.DEPBAR"):
                keep = _DEPBAR_LE.search(t)
                if closed and newer >= (int(keep.group(1), 16) if keep else 0):
                    break
            d = _DEST.match(t)
            if d and not d.group(1).startswith(_NO_DEST) and d.group(2) in regs:
                found.append((ins, t))
            b = _BRANCH.search(t)
            if b and labels.get(b.group(1), len(insts)) <= j and hops == 0:
                j, hops = labels[b.group(1)], 1
                continue
            j += 1
    return found


def _variants():
    from numba import types

    from sparsekit.kernels import sp24_wg, sp24_ws, spmm_ws, spmm_ws_plan

    a16, a32, a64, af = (types.Array(t, 1, "C") for t in (types.int16, types.int32, types.int64, types.float32))
    i64 = types.int64
    for nt, st in [(8, 5), (16, 5), (32, 4), (64, 3), (128, 3)]:
        regs = spmm_ws_plan.max_registers(nt, 1)
        yield (f"spmm_ws nt={nt} stages={st} regs={regs}", spmm_ws.get_kernel(nt, st, 1, regs=regs),
               (a64, a64, a32, a64, a16, af, a32) + (i64,) * 6, regs)
    for nt, st in [(8, 4), (32, 6), (64, 4)]:                 # two warpgroups taking turns on a tile row
        regs = spmm_ws_plan.max_registers(nt, 2)
        yield (f"spmm_ws alt nt={nt} stages={st} regs={regs}", spmm_ws.get_kernel(nt, st, 2, regs=regs, alt=True),
               (a64, a64, a32, a64, a16, af, a32) + (i64,) * 6, regs)
    for nt, st, r, wg, hy in [(16, 6, 2, 2, False), (32, 6, 1, 2, False), (64, 3, 1, 2, False), (64, 3, 1, 2, True),
                              (128, 3, 2, 2, False), (256, 3, 1, 2, False)]:
        yield (f"sp24_ws nt={nt} stages={st} r={r} wg={wg} hybrid={hy}", sp24_ws.get_kernel(nt, st, r, wg, hy),
               (a64, a64, a32, a64, a16, af, a32) + (i64,) * 5, sp24_ws.max_registers(nt, r, wg))
    from sparsekit.kernels.sp24_ws_probe import built_as

    for nt, st in [(128, 3), (128, 4), (64, 4)]:                # the two tile rows taking turns (v31)
        with built_as("pipelined"):
            kern = sp24_ws.get_kernel(nt, st, 2, 2)
        yield (f"sp24_ws pipelined nt={nt} stages={st} r=2 wg=2", kern, (a64, a64, a32, a64, a16, af, a32) + (i64,) * 5,
               168)
    for nt, st, r, wg in [(8, 4, 1, 1), (16, 4, 2, 2), (64, 4, 1, 2)]:
        yield (f"sp24_wg nt={nt} stages={st} r={r} wg={wg}", sp24_wg.get_kernel(nt, st, r, wg),
               (a32, a32, a16, af, a32) + (i64,) * 6, 232 if r * nt >= 128 else 168)


def main() -> int:
    try:
        import _numba_cuda_redirector  # noqa: F401 - numba.cuda -> numba-cuda for --target installs
    except ImportError:
        pass
    from numba import cuda

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    ap.add_argument("--keep", help="directory to keep the .ptx / .cubin files in")
    args = ap.parse_args()
    if not args.nvdisasm or not shutil.which("ptxas"):
        print("error: ptxas and nvdisasm are needed (--nvdisasm PATH)", file=sys.stderr)
        return 2
    out = Path(args.keep or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    bad = 0
    print("| kernel | registers | spills | HGMMA | products serialized by ptxas | A-register hazards |")
    print("|---|---|---|---|---|---|")
    for k, (name, kern, sig, regs) in enumerate(_variants()):
        ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))
        ptx = re.sub(r"^\.target sm_90\b", ".target sm_90a", ptx, flags=re.M)
        p = out / f"k{k}.ptx"
        p.write_text(ptx)
        cmd = ["ptxas", "-arch=sm_90a", "-v", f"-maxrregcount={regs}", str(p), "-o", str(p.with_suffix(".cubin"))]
        res = subprocess.run(cmd, capture_output=True, text=True)
        have = re.search(r"Unsupported \.version [0-9.]+; current version is '([0-9.]+)'", res.stderr)
        if res.returncode and have:
            p.write_text(re.sub(r"^\.version [0-9.]+", f".version {have.group(1)}", ptx, flags=re.M))
            res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            print(f"error: ptxas failed on {name}: {res.stderr.strip()[:300]}", file=sys.stderr)
            return 1
        sass = subprocess.run([args.nvdisasm, str(p.with_suffix(".cubin"))], capture_output=True, text=True,
                              check=True).stdout
        used = re.search(r"Used (\d+) registers", res.stderr)
        spill = re.search(r"(\d+) bytes spill stores", res.stderr)
        hz = a_register_hazards(sass)
        bad += bool(hz)
        ser = _SERIALIZED.search(res.stderr)
        print(f"| {name} | {used.group(1) if used else '?'} | {spill.group(1) if spill else '?'} | "
              f"{sass.count('HGMMA')} | {ser.group(1) + ': ' + ser.group(2).strip() if ser else 'no'} | "
              f"{len(hz)}{' (first: ' + hz[0][1] + ')' if hz else ''} |", flush=True)
    print(f"files in {out}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
