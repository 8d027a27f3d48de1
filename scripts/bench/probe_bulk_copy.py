"""Bandwidth of spmm_ws's copy skeleton by bulk-copy size (issue 21, docs/kernels-notes.md "v23"): one lane's
bulk copies into a ring per block, nothing else (``sparsekit.kernels.copy_probe``), over ``--mbytes`` of memory
(beyond the L2), for each step size, copies per step, ring depth and blocks per SM. GPU only::

    python -m scripts.bench.probe_bulk_copy [--steps 1024,4096,16384] [--pieces 1,3] [--stages 4] [--per-sm 2,3,5] \
        [--holds 0,1000,2000] [--mbytes 16 --laps 16] [--shared 32768 --share 1,2 --cluster 1,2,4 [--split]] \
        [--tma-box 128 [--tma-map global,const]]

``--holds``: SM cycles the reader keeps each stage after it lands (a consumer's decode and products). ``--laps``:
each block reads its share that many times, so with ``--mbytes`` below the L2's size the copies after the first
lap are L2 hits (the rate of an X slab that every row block reads). ``--shared``: bytes of each step common to a
group of ``--share`` blocks (an X slab beside a block's own weight bytes), each block copying them itself, or with
``--cluster`` 2 or 4 multicast by the cluster's first block into all of them (the group is then the cluster;
``--split``: each block multicasts a slice, the readers freeing a stage in every block at once). ``--tma-box``:
the tensor form of the copy (``kernels/tma_probe.py``), boxes of that many 128-byte rows, the tensor map in global
memory or baked into the kernel's constant memory (``--tma-map``).

Prints TB/s per configuration (CUDA-graph replays; "eager" in the last column where a configuration could not be
captured, so the host's time per call may be in it): bytes landed in the rings, and bytes read from memory (a
multicast part counts once a cluster), and where the checking launch put its blocks (SMs used, the most blocks on
one SM), beside a device-to-device copy of the same bytes by torch.
"""
from __future__ import annotations

import argparse
import sys

import torch

from scripts.common import cuda_or_exit, ints_arg, time_calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbytes", type=int, default=256)
    ap.add_argument("--steps", default="1024,2048,4096,6144,8192,16384,32768", help="bytes a step")
    ap.add_argument("--pieces", default="1,3", help="bulk copies a step")
    ap.add_argument("--stages", default="4")
    ap.add_argument("--per-sm", default="2,3,5", help="blocks per SM")
    ap.add_argument("--holds", default="0", help="SM cycles the reader holds each stage")
    ap.add_argument("--laps", type=int, default=1, help="times each block reads its share (L2 hits past the first)")
    ap.add_argument("--shared", type=int, default=0, help="bytes of each step common to a group of blocks")
    ap.add_argument("--share", default="1", help="blocks per group reading the shared bytes themselves")
    ap.add_argument("--cluster", default="1", help="cluster sizes (2, 4: the shared bytes multicast)")
    ap.add_argument("--split", action="store_true", help="clusters: each block multicasts a slice, freed in one hop")
    ap.add_argument("--tma-box", type=int, default=0,
                    help="tensor copies of this many 128-byte rows (cp.async.bulk.tensor)")
    ap.add_argument("--tma-swizzle", action="store_true", help="tensor copies: the 128-byte swizzle")
    ap.add_argument("--tma-map", default="global",
                    help="tensor copies: where the map lives, global and/or const (the kernel's constant memory)")
    args = ap.parse_args()
    cuda_or_exit("the bulk-copy probe")
    from sparsekit.kernels.copy_probe import bulk_stream, stream_sums

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    src = torch.randint(0, 1 << 20, (args.mbytes << 17,), dtype=torch.int64, device="cuda")
    dst = torch.empty_like(src)
    tc, _ = time_calls([lambda: dst.copy_(src)])
    print(f"torch copy of {args.mbytes} MB: {2 * src.numel() * 8 / tc / 1e6:.2f} TB/s (read + write)")
    maps = args.tma_map.split(",") if args.tma_box else ["-"]
    if not set(maps) <= {"global", "const", "-"}:
        print(f"error: --tma-map takes global and/or const, got {args.tma_map!r}", file=sys.stderr)
        return 2
    print("| step bytes | shared | share / cluster | copies | stages | blocks / SM | hold cycles | tensor map "
          "| TB/s landed | TB/s read | SMs used, most blocks on one | timed |")
    print("|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---|---|")
    groups = [(g, 1) for g in ints_arg(args.share)] + [(c, c) for c in ints_arg(args.cluster) if c > 1]
    if not args.shared:
        groups = [(1, 1)]
    for step in ints_arg(args.steps):
        for pieces in ints_arg(args.pieces):
            for stages in ints_arg(args.stages):
                for per in ints_arg(args.per_sm):
                    for share, cl in groups:
                        blocks = per * sms - per * sms % cl
                        nstep = src.numel() * 8 // (blocks * step)
                        own = step - args.shared
                        if (nstep < stages or stages * step > 200 * 1024 or own < 0 or own % (16 * pieces)
                                or args.shared % 16):
                            continue
                        used = src[: blocks * nstep * step // 8]
                        kw = dict(laps=args.laps, shared_bytes=args.shared, share=share)
                        want = stream_sums(used, blocks, step, **kw)
                        for hold, where_map in ((h, m) for h in ints_arg(args.holds) for m in maps):
                            tk = dict(tma_box=args.tma_box, tma_swizzle=args.tma_swizzle,
                                      tma_const=where_map == "const")
                            where = torch.zeros(blocks, dtype=torch.int64, device="cuda")
                            sink = bulk_stream(used, blocks, step, stages, pieces, hold, cluster=cl, sms=where,
                                               split=args.split, **tk, **kw)
                            on_sm = torch.bincount(where, minlength=sms)
                            if not torch.equal(sink, want):
                                print(f"FAIL step {step} pieces {pieces} share {share} cluster {cl}: a step did not "
                                      "land", file=sys.stderr)
                                return 1
                            t, mode = time_calls([lambda: bulk_stream(used, blocks, step, stages, pieces, hold,
                                                                      cluster=cl, split=args.split, **tk, **kw)])
                            landed = blocks * nstep * step * args.laps
                            read = blocks * nstep * args.laps * (own + args.shared / cl)
                            print(f"| {step} | {args.shared} | {share} / {cl} | {pieces} | {stages} | {per} | {hold} | "
                                  f"{where_map} | {landed / t / 1e6:.2f} | {read / t / 1e6:.2f} | "
                                  f"{int((on_sm > 0).sum())}, {int(on_sm.max())} | {mode} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
