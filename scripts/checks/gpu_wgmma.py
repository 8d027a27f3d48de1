"""Pin down the operand contract of Hopper's sparse warpgroup MMA on the device (issue 21/22 groundwork,
docs/kernels-notes.md "v16"): ``wgmma.mma_async.sp`` m64n8k32 and m64n16k32, fp16, A (2:4, compressed)
from registers, B (32 x N) from shared memory through a matrix descriptor, fp32 accumulators.

For random 2:4 A [64, 32], B [32, N] and C [64, N] it tries each candidate of what the PTX manual leaves
to interpretation, runs ``kernels/wgmma_probe.py`` once per candidate, and compares D with
``A @ B + C`` in float64 (outputs start as NaN):

- metadata: ``mma.sp``'s per-warp arrangement (/work/shared/notes/mma-sp-facts.md: thread t = 0 holds
  groups 0-3 of rows g and g + 8, t = 1 groups 4-7), the same with t = 2, 3 repeating t = 0, 1, and one
  row per thread;
- the B tile in shared memory: 8 x 8 core matrices (8 token rows of 16 bytes each), placed every 128
  or 256 bytes along K and (N = 16) every 128-1024 bytes along N, never overlapping;
- the descriptor: the K step as the leading byte offset and the N step as the stride one, or the
  other way round.

A (per warp, rows 16w .. 16w + 15) and D are taken in ``mma.sp``'s fragment layouts. Exits 0 when
some candidate matches on every seed (and says which), 1 otherwise.

    python -m scripts.checks.gpu_wgmma [--seeds 3]
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

from scripts.common import cuda_or_exit

TOL = 1e-5


def _pack(lo, hi) -> int:
    b = torch.tensor([float(lo), float(hi)], dtype=torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    v = int(b[0] | (b[1] << 16))
    return v - (1 << 32) if v >= 1 << 31 else v


def _i32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def operands(seed: int, n: int = 8):
    """Random 2:4 A [64, 32] with its compressed values [64, 16] and kept indices, B [32, n], C [64, n]."""
    from sparsekit.kernels.sp24_probe import random_2to4

    g = torch.Generator().manual_seed(seed)
    a, comp, idx = random_2to4(64, g)
    b = torch.randn(32, n, generator=g).half()
    c = torch.randn(64, n, generator=g)
    return a, comp, idx, b, c


def a_regs(comp) -> torch.Tensor:
    out = []
    for th in range(128):
        w, ln = th >> 5, th & 31
        gg, t = 16 * w + (ln >> 2), ln & 3
        out.append([_pack(comp[gg + 8 * (i & 1), 2 * t + 8 * (i >> 1)], comp[gg + 8 * (i & 1), 2 * t + 8 * (i >> 1) + 1])
                    for i in range(4)])
    return torch.tensor(out, dtype=torch.int32)


def _code(idx, r, j) -> int:
    i0, i1 = idx[r, j].tolist()
    return i0 | i1 << 2


def meta_regs(idx, kind: str) -> torch.Tensor:
    out = []
    for th in range(128):
        w, ln = th >> 5, th & 31
        gg, t = 16 * w + (ln >> 2), ln & 3
        word = 0
        if kind in ("mma.sp", "mma.sp, t=2,3 repeat"):
            tt = t if kind == "mma.sp" else t & 1
            if tt < 2:
                for rh in range(2):
                    for jj in range(4):
                        word |= _code(idx, gg + 8 * rh, 4 * tt + jj) << (16 * rh + 4 * jj)
            else:
                word = 0x5A5A5A5A   # not read with selector 0 (if it is, the result is wrong)
        else:   # "row per thread": t = 0 row g, t = 1 row g + 8, all 8 groups of the row
            if t < 2:
                for jj in range(8):
                    word |= _code(idx, gg + 8 * t, jj) << (4 * jj)
            else:
                word = 0x5A5A5A5A
        out.append(_i32(word))
    return torch.tensor(out, dtype=torch.int32)


def b_image(b, kstep: int, nstep: int = 0) -> torch.Tensor:
    """B [32 k, n] as 8 x 8 core matrices (row n: its 8 k values, 16 bytes), one every ``kstep`` bytes
    along K and every ``nstep`` along N."""
    n_all = b.shape[1]
    at = [((k // 8) * kstep + (n // 8) * nstep + (n % 8) * 16 + (k % 8) * 2) // 2
          for k in range(32) for n in range(n_all)]
    img = torch.zeros(-(-(max(at) + 1) // 8) * 8, dtype=torch.float16)
    for (k, n), i in zip(((k, n) for k in range(32) for n in range(n_all)), at):
        img[i] = b[k, n]
    return img.view(torch.int32)


def _fragment(th: int, i: int) -> tuple[int, int]:
    """(row, column) of accumulator ``i`` of thread ``th``: mma's C layout per warp and 8-token block."""
    w, ln = th >> 5, th & 31
    j, q = i >> 2, i & 3
    return 16 * w + (ln >> 2) + 8 * (q >> 1), 8 * j + 2 * (ln & 3) + (q & 1)


def d_matrix(d) -> torch.Tensor:
    out = torch.full((64, 2 * d.shape[1]), float("nan"), dtype=torch.float64)
    for th in range(128):
        for i in range(d.shape[1]):
            out[_fragment(th, i)] = float(d[th, i])
    return out


def c_regs(c) -> torch.Tensor:
    return torch.tensor([[float(c[_fragment(th, i)]) for i in range(c.shape[1] // 2)] for th in range(128)],
                        dtype=torch.float32)


def _disjoint(kstep: int, nstep: int, n: int) -> bool:
    spans = [(kc * kstep + nc * nstep, kc * kstep + nc * nstep + 128) for kc in range(4) for nc in range(n // 8)]
    return all(a1 <= b0 or b1 <= a0 for i, (a0, a1) in enumerate(spans) for b0, b1 in spans[i + 1:])


def candidates(n: int):
    """(metadata, K step, N step, LBO, SBO) to try for ``n`` tokens."""
    for meta, kstep in itertools.product(("mma.sp", "mma.sp, t=2,3 repeat", "row per thread"), (128, 256)):
        if n == 8:
            for other in (128, 256, 1024):
                yield meta, kstep, 0, kstep, other
                yield meta, kstep, 0, other, kstep
        else:
            for nstep in (128, 256, 512, 1024):
                if _disjoint(kstep, nstep, n):
                    yield meta, kstep, nstep, kstep, nstep
                    yield meta, kstep, nstep, nstep, kstep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    cuda_or_exit("gpu_wgmma")
    from sparsekit.kernels.wgmma import descriptor
    from sparsekit.kernels.wgmma_probe import NS, wgmma_sp_once

    results: dict = {}
    for n in NS:
        for seed in range(args.seeds):
            a, comp, idx, b, c = operands(seed, n)
            ref = a.double() @ b.double() + c.double()
            ar, cr = a_regs(comp).cuda(), c_regs(c).cuda()
            for meta, kstep, nstep, lbo, sbo in candidates(n):
                key = (n, meta, kstep, nstep, lbo, sbo)
                try:
                    d = wgmma_sp_once(ar, meta_regs(idx, meta).cuda(), b_image(b, kstep, nstep).cuda(),
                                      descriptor(lbo, sbo), cr)
                    torch.cuda.synchronize()
                    got = d_matrix(d.cpu())
                    err = float((got - ref).norm() / ref.norm()) if not torch.isnan(got).any() else float("nan")
                except Exception as e:  # noqa: BLE001 - a candidate that faults is a wrong candidate; say why
                    err = f"{type(e).__name__}: {str(e)[:120]}"
                    print(f"seed {seed} {key}: {err}", flush=True)
                    if "illegal" in str(e).lower():   # the context is gone: nothing after this can run
                        return 1
                results.setdefault(key, []).append(err)
    ok = [k for k, errs in results.items() if all(isinstance(e, float) and e < TOL for e in errs)]
    for k, errs in results.items():
        shown = ", ".join(f"{e:.2e}" if isinstance(e, float) else e for e in errs)
        print(f"{'MATCH' if k in ok else '     '} N={k[0]} meta={k[1]!r} core matrices every {k[2]} B along K, "
              f"{k[3]} B along N; LBO {k[4]}, SBO {k[5]}: {shown}")
    print(f"wgmma.sp probe: {len(ok)} of {len(results)} candidates match on every seed")
    return 0 if any(k[0] == 8 for k in ok) and any(k[0] == 16 for k in ok) else 1


if __name__ == "__main__":
    sys.exit(main())
