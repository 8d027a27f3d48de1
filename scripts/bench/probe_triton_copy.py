"""The rate at which Triton's own loads move tiles from the L2 or DRAM into a block's registers (issue 21,
docs/kernels-notes.md "v31"): the reference that ``probe_bulk_copy.py``'s copies are read against. Each program
sums tiles of an fp16 matrix, taking every ``programs``-th tile, through a tensor descriptor (the tensor copy,
``cp.async.bulk.tensor``, its map a kernel parameter) or through pointer loads (``cp.async``), Triton pipelining
``--stages`` tiles; ``--laps`` passes over a source that fits the L2 measure the L2. GPU and Triton only::

    python -m scripts.bench.probe_triton_copy [--mbytes 32 --laps 16] [--tiles 128x64,256x64] [--per-sm 1,2] \
        [--stages 3,4,6]

Prints TB/s of tiles loaded per configuration (CUDA-graph replays), each form's sums checked against the other's.
"""
from __future__ import annotations

import argparse
import sys

import torch

from scripts.common import cuda_or_exit, ints_arg, time_calls


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def desc_sum(desc, out, n_tiles, total, BR: tl.constexpr, BC: tl.constexpr, NPROG: tl.constexpr,
                 STAGES: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros((BR, BC), tl.float32)
        for t in tl.range(pid, total, NPROG, num_stages=STAGES):
            acc += desc.load([(t % n_tiles) * BR, 0]).to(tl.float32)
        tl.store(out + pid, tl.sum(acc))

    @triton.jit
    def ptr_sum(src, out, n_tiles, total, BR: tl.constexpr, BC: tl.constexpr, NPROG: tl.constexpr,
                STAGES: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros((BR, BC), tl.float32)
        r = tl.arange(0, BR)[:, None]
        c = tl.arange(0, BC)[None, :]
        for t in tl.range(pid, total, NPROG, num_stages=STAGES):
            acc += tl.load(src + ((t % n_tiles) * BR + r) * BC + c).to(tl.float32)
        tl.store(out + pid, tl.sum(acc))

    return desc_sum, ptr_sum


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbytes", type=int, default=32)
    ap.add_argument("--laps", type=int, default=16, help="passes over the source (L2 hits past the first)")
    ap.add_argument("--tiles", default="128x64,256x64,64x128,128x128", help="tile rows x columns (fp16)")
    ap.add_argument("--per-sm", default="1,2", help="programs per SM")
    ap.add_argument("--stages", default="3,4,6", help="tiles Triton keeps in flight + 1")
    args = ap.parse_args()
    cuda_or_exit("the Triton copy probe")
    try:
        import triton
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError as e:
        print(f"the Triton copy probe needs Triton with tensor descriptors (3.3 or newer): {e}", file=sys.stderr)
        return 2
    try:
        tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    except ValueError:
        print(f"error: --tiles takes ROWSxCOLS[,...], got {args.tiles!r}", file=sys.stderr)
        return 2
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    desc_sum, ptr_sum = _kernels()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, {args.mbytes} MB x {args.laps} laps")
    print("| tile | KB | programs / SM | stages | TB/s, pointer loads | TB/s, tensor descriptor |")
    print("|---|---:|---:|---:|---:|---:|")
    for br, bc in tiles:
        src = torch.randn(args.mbytes * (1 << 20) // 2 // bc, bc, dtype=torch.float16, device="cuda")
        n_tiles = src.shape[0] // br
        total = n_tiles * args.laps
        desc = TensorDescriptor.from_tensor(src, [br, bc])
        for per in ints_arg(args.per_sm):
            nprog = sms * per
            out = torch.empty(nprog, device="cuda")
            for stages in ints_arg(args.stages):
                rates = []
                sums = []
                for fn, first in ((ptr_sum, src), (desc_sum, desc)):
                    def call(fn=fn, first=first):
                        fn[(nprog,)](first, out, n_tiles, total, br, bc, nprog, stages, num_warps=4)

                    call()
                    sums.append(out.sum().item())
                    t, _ = time_calls([call])
                    rates.append(total * br * bc * 2 / t / 1e6)
                if abs(sums[0] - sums[1]) > 1e-3 * max(1.0, abs(sums[0])):
                    print(f"FAIL tile {br}x{bc}: the two forms summed {sums[0]} and {sums[1]}", file=sys.stderr)
                    return 1
                print(f"| {br}x{bc} | {br * bc * 2 // 1024} | {per} | {stages} | {rates[0]:.2f} | {rates[1]:.2f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
