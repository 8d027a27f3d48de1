"""Tuning sweep for the CATS kernels on a GPU: up (neurons per warp, words in flight, warps per block)
and down (threads per block, chunks), on one MLP shape, for a few token counts and activation sparsities.

    python -m scripts.bench.tune_cats [--hidden 4096] [--inter 11008] [--ns 1,4]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=11008)
    ap.add_argument("--ns", default="1,4")
    ap.add_argument("--copies", type=int, default=3)
    args = ap.parse_args()
    from scripts.bench.cats import graph_ms_rotating, threshold_for
    from sparsekit.kernels.cats import cats_down, cats_up

    hid, inter = args.hidden, args.inter
    from sparsekit.kernels.cats import tile_down

    ws = [(torch.randn(inter, hid, device="cuda").half() * 0.02, torch.randn(inter, hid, device="cuda").half() * 0.02,
           torch.randn(inter, hid, device="cuda").half() * 0.02) for _ in range(args.copies)]
    tiles = {v: [tile_down(wd, 128 * v) for _, _, wd in ws] for v in (1, 2, 4)}
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ms = graph_ms_rotating([lambda: big.clone()])
    print(json.dumps({"copy_256MB_ms": ms, "GBps": 2 * 256 * 1.048576 / ms}), flush=True)
    for n, asp in itertools.product([int(v) for v in args.ns.split(",")], (0.0, 0.5)):
        t = threshold_for(ws[0][0], asp)
        x = torch.randn(n, hid, device="cuda").half()
        gs = [F.linear(x, wg) for wg, _, _ in ws]
        hs = [cats_up(g, x, wu, t) for g, (_, wu, _) in zip(gs, ws)]
        ref = hs[0].double() @ ws[0][2].double()
        for v in (1, 2, 4):
            y = cats_down(hs[0], tiles[v][0], torch.full((n, hid), float('nan'), device='cuda').half())
            print(json.dumps({'check_v': v, 'err': float((y.double() - ref).norm() / ref.norm())}), flush=True)
        for r, u, warps in [(1, 8, 4)]:
            ms = graph_ms_rotating([lambda g=g, wu=wu: cats_up(g, x, wu, t, warps=warps, rows_per_warp=r, unroll=u)
                                    for g, (_, wu, _) in zip(gs, ws)])
            print(json.dumps({"n": n, "act": asp, "kernel": "up", "r": r, "u": u, "warps": warps, "ms": round(ms, 4),
                              "GBps_dense_equiv": round(inter * hid * 2 / ms / 1e6, 1)}), flush=True)
        for threads, split_mult, du, regs, v in [(t, m, 0, 0, v) for t in (128, 256) for m in (0.5, 1) for v in (1, 2)]:
            from sparsekit.kernels.cats import down_plan
            from sparsekit.kernels.launch import sm_count
            _, s0 = down_plan(inter, hid // (128 * v), sm_count(x.device), nt=n)
            splits = max(1, int(s0 * split_mult))
            ms = graph_ms_rotating([lambda h=h, wd=wd: cats_down(h, wd, splits=splits, threads=threads, unroll=du, regs=regs)
                                    for h, wd in zip(hs, tiles[v])])
            print(json.dumps({"n": n, "act": asp, "kernel": "down", "v": v, "threads": threads, "splits": splits,
                              "ms": round(ms, 4), "GBps_dense_equiv": round(inter * hid * 2 / ms / 1e6, 1)}), flush=True)
        ms = graph_ms_rotating([lambda wg=wg: F.linear(x, wg) for wg, _, _ in ws])
        print(json.dumps({"n": n, "kernel": "cublas_gate", "ms": round(ms, 4),
                          "GBps": round(inter * hid * 2 / ms / 1e6, 1)}), flush=True)


if __name__ == "__main__":
    main()
