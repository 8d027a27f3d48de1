"""Where a decode step's time goes: per-kernel GPU time of the 7B-shaped model, dense and sparse.

Builds the model of ``scripts.bench.e2e`` (random fp16 weights, every decoder linear pruned
by magnitude per row), merges q/k/v and gate/up, and for each batch size captures one decode step
in a CUDA graph exactly as ``sparsekit eval --speed`` does (compiled layers, fused RMSNorm). The
step is timed with CUDA events (median of 5 loops of 32 replays), then ``torch.profiler`` records
the kernels of 16 replays. Printed per model and batch: step time, the sum of kernel times (the
rest is the gaps between kernels), and the kernels grouped (sparse SpMM, cuBLAS, attention,
Triton glue, other) with their count and time per step. GPU only.

    python -m scripts.bench.profile_e2e [--layers 8] [--batch-sizes 1,16] [--pattern 2:4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch


# attention before cuBLAS: PyTorch's memory-efficient attention kernel is a CUTLASS one (``fmha_cutlassF_...``)
GROUPS = (("sparse", ("sparsekit::kernels",)), ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
          ("cublas", ("gemm", "gemv", "xmma", "cutlass", "sm90_", "nvjet")), ("triton", ("triton",)))


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def step_ms(dec, ids, loops: int = 5, steps: int = 32) -> float:
    from sparsekit.runtime.timing import time_ms

    def replays():
        for _ in range(steps):
            dec.graph.replay()

    times = []
    for _ in range(loops):
        dec.prefill(ids)   # the cache has room for new_tokens steps after each prefill
        times.append(time_ms(replays) / steps)
    return statistics.median(times)


# the SDPA backend a variant leaves enabled (None: torch's own choice, cuDNN here). Flash cannot
# take HF's decode mask and HF's eager attention cannot be captured, so neither is a variant.
ATTN = {"sdpa": None, "sdpa-efficient": "efficient", "sdpa-math": "math"}


def attention_mode(attn: str):
    """Context for one ``--attn`` variant: the SDPA backends torch may pick (set globally: the
    compiled layer picks its backend when it is traced)."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        b = torch.backends.cuda
        saved = (b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled())
        only = ATTN[attn]
        if only:
            b.enable_cudnn_sdp(False)
            b.enable_flash_sdp(False)
            b.enable_mem_efficient_sdp(only == "efficient")
            b.enable_math_sdp(only == "math")
        try:
            yield
        finally:
            for f, v in zip((b.enable_cudnn_sdp, b.enable_flash_sdp, b.enable_mem_efficient_sdp, b.enable_math_sdp), saved):
                f(v)

    return ctx()


def profile_step(model, batch: int, prompt_len: int, new_tokens: int, replays: int = 16) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from sparsekit.runtime.decoder import GreedyDecoder

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).cuda()
    dec = GreedyDecoder(model, batch, prompt_len + new_tokens + 1, use_graph=True, compile=True)
    dec.prefill(ids)
    dec.step()  # captures
    ms = step_ms(dec, ids, steps=min(32, new_tokens - 1))
    dec.prefill(ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(min(replays, new_tokens - 1)):
            dec.graph.replay()
        torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            k = kernels[ev.name]
            k[0] += 1
            k[1] += ev.device_time_total
    groups = defaultdict(lambda: [0, 0.0])
    for name, (cnt, us) in kernels.items():
        g = groups[group_of(name)]
        g[0] += cnt
        g[1] += us
    total_us = sum(us for _, us in kernels.values()) / replays
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]
    del dec
    torch.cuda.empty_cache()
    return {
        "batch": batch, "step_ms": ms, "kernel_ms_per_step": total_us / 1e3,
        "groups": {g: {"calls_per_step": c / replays, "us_per_step": us / replays} for g, (c, us) in groups.items()},
        "top": [{"name": n[:90], "calls_per_step": c / replays, "us_per_call": us / max(c, 1),
                 "us_per_step": us / replays} for n, (c, us) in top],
    }


def show(label: str, r: dict) -> None:
    print(f"\n== {label} batch {r['batch']}: step {r['step_ms']:.3f} ms, kernels {r['kernel_ms_per_step']:.3f} ms "
          f"(gaps {r['step_ms'] - r['kernel_ms_per_step']:.3f} ms)")
    for g, v in sorted(r["groups"].items(), key=lambda kv: -kv[1]["us_per_step"]):
        print(f"  {g:10s} {v['calls_per_step']:7.1f} calls {v['us_per_step'] / 1e3:8.3f} ms")
    for t in r["top"]:
        print(f"    {t['us_per_step'] / 1e3:7.3f} ms  {t['calls_per_step']:6.1f} x {t['us_per_call']:7.2f} us  {t['name']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--pattern", choices=("unstructured", "2:4", "hybrid"), default="unstructured",
                    help="the mask (2:4 and hybrid: the layers planned with prefer=memory, as in bench_e2e)")
    ap.add_argument("--attn", default="sdpa", help=f"comma-separated attention variants to compare: {', '.join(ATTN)}")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    unknown = [a for a in args.attn.split(",") if a not in ATTN]
    if unknown:
        print(f"unknown --attn variant(s) {', '.join(unknown)}: use {', '.join(ATTN)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA GPU: profile_e2e runs on a GPU machine", file=sys.stderr)
        return 2
    from scripts.bench.e2e import build_model, prune_

    from sparsekit.runtime.decoder import reset_compiled_layer
    from sparsekit.runtime.fusion import equalize_packed_sizes, fuse_projections, fuse_rms_norms
    from sparsekit.runtime.swap import densify, sparsify

    batches = [int(b) for b in args.batch_sizes.split(",")]
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False   # variants differ only in the backend flags
    model = build_model(args.layers, 4096, 11008, 32, 32000)
    prune_(model, 0.5 if args.pattern == "2:4" else args.sparsity, args.pattern)
    fuse_rms_norms(model)
    fuse_projections(model)             # as bench_e2e: merge the projections, then encode (each layer's tile census)
    sparsify(model, min_sparsity=0.3)
    equalize_packed_sizes(model)
    if args.pattern != "unstructured":   # each layer's form and kernels as bench_e2e --prefer memory plans them
        from sparsekit.runtime.dispatch import plan_dispatch

        rep = plan_dispatch(model, prefer="memory", sp24=True, cache=False)
        print("; ".join(f"{g['shape'][0]}x{g['shape'][1]} {g['form']}" for g in rep["groups"]), flush=True)
    torch.cuda.empty_cache()
    out = {"gpu": torch.cuda.get_device_name(), "layers": args.layers, "runs": []}

    def run(label):
        for attn in args.attn.split(","):
            for b in batches:
                torch._dynamo.reset()          # the attention backend is chosen when a layer is traced
                reset_compiled_layer()
                try:
                    with attention_mode(attn):
                        r = profile_step(model, b, args.prompt_len, args.new_tokens)
                except Exception as e:  # noqa: BLE001 - a backend that cannot run this step
                    print(f"\n== {label} {attn} batch {b}: failed ({type(e).__name__}: {str(e)[:200]})")
                    continue
                r.update(model=label, attn=attn)
                out["runs"].append(r)
                show(f"{label} {attn}", r)

    run("sparse")
    densify(model)                      # the same merged weights as nn.Linear (cuBLAS)
    torch.cuda.empty_cache()
    run("dense")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
