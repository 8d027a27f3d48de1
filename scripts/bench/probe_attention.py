"""What a decode step's attention costs on each of torch's attention kernels (issue 22, docs/kernels-notes.md "v42"
item 5): about a quarter of the 7B-shaped dense step at batch 1 and 16 is what the dense and the sparse model share,
the attention first (session 36's profile: 13 us a layer at batch 1 and 37 us at batch 16, 0.7 TB/s of its K and V),
so end-to-end ratios cannot pass ~1.45x (2:4) or ~1.29x (35% hybrid) until it shrinks. GPU only::

    python -m scripts.bench.probe_attention [--batch-sizes 1,16] [--lens 160,1024] [--cache 0] [--heads 32]
        [--kv-heads 32] [--head-dim 128]

One query token a sequence attends to the first L positions of a static cache of ``max(L, --cache)`` positions,
as the decoder's step does (a boolean mask over the cache). Backends: ``efficient`` and ``cudnn`` (torch's
memory-efficient and cuDNN kernels on the masked cache; the decoder runs the first, ``runtime.decoder``), and the
same two on K and V cut to the L positions with no mask (``*_cut``: what a kernel that knows the length reads;
``flash_cut`` too, torch's flash kernel, which takes no mask). Microseconds a call (CUDA-graph replays over copies of
K and V that together exceed the L2) and the GB/s of the K and V it must read; each output is checked first against
float32 (relative error below 1e-2; a wrong one is named and not timed, exit status 1; a backend torch refuses for
these shapes is "n/a").
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from scripts.common import copies_for, cuda_or_exit, ints_arg, time_calls

BACKENDS = ("efficient", "cudnn", "efficient_cut", "cudnn_cut", "flash_cut")


def _sdpa(name: str):
    from torch.nn.attention import SDPBackend

    return {"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION}[name.removesuffix("_cut")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=ints_arg, default="1,16", help="sequences a step")
    ap.add_argument("--lens", type=ints_arg, default="160,1024", help="positions a query attends to")
    ap.add_argument("--cache", type=int, default=0, help="static cache positions (0: each L; else at least L)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=0, help="K and V heads (0: --heads; fewer: grouped queries)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"of {', '.join(BACKENDS)}")
    args = ap.parse_args()
    kvh = args.kv_heads or args.heads
    backends = args.backends.split(",")
    if any(v <= 0 for v in args.batch_sizes + args.lens) or min(args.heads, kvh, args.head_dim) <= 0 \
            or args.cache < 0:
        ap.error("batch sizes, lengths, heads and the head size are positive; --cache is 0 or more")
    if args.heads % kvh:
        ap.error(f"--kv-heads ({kvh}) must divide --heads ({args.heads})")
    if not backends or any(b not in BACKENDS for b in backends):
        ap.error(f"--backends takes {', '.join(BACKENDS)}")
    cuda_or_exit("the attention probe")
    from torch.nn.attention import sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(1)
    gqa = dict(enable_gqa=True) if kvh != args.heads else {}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.heads} query heads, {kvh} K/V heads "
          f"of {args.head_dim}\n")
    print("| batch | L | cache | K+V MB | " + " | ".join(f"{b} us (GB/s)" for b in backends) + " |")
    print("|---:|---:|---:|---:|" + "---|" * len(backends))
    wrong = 0
    for b in args.batch_sizes:
        for n in args.lens:
            cache = max(n, args.cache)
            kv_bytes = 2 * b * kvh * n * args.head_dim * 2          # what the L positions of K and V hold
            shape = (b, kvh, cache, args.head_dim)
            kvs = [(torch.randn(shape, device="cuda", generator=gen).half(),
                    torch.randn(shape, device="cuda", generator=gen).half()) for _ in range(copies_for(kv_bytes))]
            q = torch.randn(b, args.heads, 1, args.head_dim, device="cuda", generator=gen).half()
            mask = (torch.arange(cache, device="cuda") < n).view(1, 1, 1, cache).expand(b, 1, 1, cache)
            k0, v0 = kvs[0][0][:, :, :n].float(), kvs[0][1][:, :, :n].float()
            ref = F.scaled_dot_product_attention(q.float(), k0, v0, **gqa)
            row = f"| {b} | {n} | {cache} | {kv_bytes / 1e6:.1f}"
            for name in backends:
                cut = name.endswith("_cut")

                def call(kv, name=name, cut=cut):
                    k, v = (kv[0][:, :, :n], kv[1][:, :, :n]) if cut else kv
                    with sdpa_kernel([_sdpa(name)]):
                        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if cut else mask, **gqa)
                try:
                    err = float((call(kvs[0]).float() - ref).norm() / ref.norm())
                except RuntimeError as e:                 # torch has no kernel of that kind for these inputs
                    row += " | n/a"
                    print(f"    {name} at batch {b}, L {n}: n/a ({str(e).splitlines()[0][:100]})", file=sys.stderr)
                    continue
                if not err < 1e-2:
                    row += " | wrong"
                    print(f"    {name} at batch {b}, L {n}: rel err {err:.3g} against float32", file=sys.stderr)
                    wrong += 1
                    continue
                t, _ = time_calls([lambda kv=kv: call(kv) for kv in kvs])
                row += f" | {t:.1f} ({kv_bytes / t / 1e3:.0f})"
            print(row + " |", flush=True)
            del kvs
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
