"""Encode / decode throughput of TCA-BME (sparsekit.packed.tcabme), in MB/s of dense weights.

    python -m scripts.bench.encode                 # CPU (and CUDA when present), markdown table
    python -m scripts.bench.encode --json          # the same as JSON
    python -m scripts.bench.encode --demo          # also `sparsekit encode` of the demo model, end to end

Weights are random fp16/bf16 matrices with a given sparsity and pattern; every decode is checked
bit-exact against the input before its time counts. Times are wall clock (perf_counter; CUDA
synchronised), median of --repeat runs after one warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from sparsekit.packed import tcabme

SHAPES = {
    "smollm2 q_proj 576x576": (576, 576),
    "smollm2 up_proj 1536x576": (1536, 576),
    "smollm2 down_proj 576x1536": (576, 1536),
    "llama-7b up_proj 11008x4096": (11008, 4096),
}


def make_weight(m: int, k: int, sparsity: float, pattern: str, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(m, k, generator=gen).to(dtype)
    if pattern == "2:4":
        score = torch.rand(m, k // 4, 4, generator=gen)
        keep = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, score.topk(2, dim=-1).indices, True)
        return torch.where(keep.reshape(m, k), w, torch.zeros((), dtype=dtype))
    return torch.where(torch.rand(m, k, generator=gen) >= sparsity, w, torch.zeros((), dtype=dtype))


def timed(fn, device: str, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def bench(device: str, repeat: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    cases = [(name, shape, 0.5, "unstructured", torch.float16) for name, shape in SHAPES.items()]
    big = SHAPES["llama-7b up_proj 11008x4096"]
    cases += [("llama-7b up_proj 11008x4096", big, 0.5, "2:4", torch.float16),
              ("llama-7b up_proj 11008x4096", big, 0.5, "unstructured", torch.bfloat16),
              ("llama-7b up_proj 11008x4096", big, 0.7, "unstructured", torch.float16),
              ("llama-7b up_proj 11008x4096", big, 0.0, "unstructured", torch.float16)]
    for name, (m, k), sparsity, pattern, dtype in cases:
        w = make_weight(m, k, sparsity, pattern, dtype, gen).to(device)
        packed = tcabme.encode(w)
        out = tcabme.decode(packed)
        if not torch.equal(out.view(torch.int16), w.view(torch.int16)):
            raise SystemExit(f"round trip not bit-exact for {name}")
        mb = w.numel() * w.element_size() / 1e6
        t_enc = timed(lambda: tcabme.encode(w), device, repeat)
        t_dec = timed(lambda: tcabme.decode(packed), device, repeat)
        rows.append({"device": device, "weight": name, "shape": [m, k], "dtype": str(dtype).removeprefix("torch."),
                     "pattern": pattern, "sparsity": sparsity, "dense_mb": round(mb, 2),
                     "ratio": round(packed.nbytes / (mb * 1e6), 4),
                     "encode_ms": round(t_enc * 1e3, 2), "decode_ms": round(t_dec * 1e3, 2),
                     "encode_mb_s": round(mb / t_enc), "decode_mb_s": round(mb / t_dec)})
        print(f"  {device} {name} {pattern} {sparsity:.0%} {rows[-1]['dtype']}: encode {rows[-1]['encode_mb_s']} MB/s, "
              f"decode {rows[-1]['decode_mb_s']} MB/s", file=sys.stderr)
    return rows


def bench_demo() -> dict:
    """`sparsekit.packed.encoding.encode` of SmolLM2-135M magnitude-pruned to 50% (files, checksums and all)."""
    import numpy as np
    from safetensors.torch import load_file, save_file

    from sparsekit.hf.models import resolve_model
    from sparsekit.packed.encoding import checkpoint_files, encode, linear_modules, load_json, resolve_key

    demo = Path(resolve_model("smollm2-135m"))
    state = {}
    for f in set(checkpoint_files(demo).values()):
        state.update(load_file(f))
    for mod in linear_modules(demo, load_json(demo / "config.json"), {}):
        key = resolve_key(mod, state)
        a = state[key].numpy()
        mag = np.abs(a).reshape(-1)
        thr = np.partition(mag, mag.size // 2)[mag.size // 2]
        state[key] = torch.from_numpy(np.where(np.abs(a) >= thr, a, np.float16(0)))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "pruned"
        src.mkdir()
        save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
        (src / "config.json").write_text((demo / "config.json").read_text())
        t = time.perf_counter()
        rep = encode(src, Path(tmp) / "packed")
        elapsed = time.perf_counter() - t
    total_mb = sum(v.numel() * v.element_size() for v in state.values()) / 1e6
    return {"checkpoint_mb": round(total_mb, 1), "linear_dense_mb": round(rep["linear_dense_bytes"] / 1e6, 1),
            "linear_packed_mb": round(rep["linear_stored_bytes"] / 1e6, 1), "ratio": round(rep["ratio"], 4),
            "elapsed_s": round(elapsed, 2), "mb_s": round(total_mb / elapsed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--demo", action="store_true", help="also time `sparsekit encode` of the demo model")
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    args = ap.parse_args()
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
               "torch": torch.__version__, "python": platform.python_version(),
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
               "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rows = [r for d in devices for r in bench(d, args.repeat)]
    report = {"machine": machine, "rows": rows}
    if args.demo:
        report["demo_encode"] = bench_demo()
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"Machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} "
          f"({machine['torch_threads']} threads), load average {machine['loadavg_1min']:.1f}, {machine['date']}\n")
    print("| device | weight | dtype | pattern | sparsity | dense MB | packed/dense | encode ms | encode MB/s | decode ms | decode MB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['device']} | {r['weight']} | {r['dtype']} | {r['pattern']} | {r['sparsity']:.0%} | {r['dense_mb']} | "
              f"{r['ratio']:.3f} | {r['encode_ms']} | {r['encode_mb_s']} | {r['decode_ms']} | {r['decode_mb_s']} |")
    if args.demo:
        d = report["demo_encode"]
        print(f"\n`sparsekit encode` of SmolLM2-135M at 50% (magnitude): {d['checkpoint_mb']} MB checkpoint in "
              f"{d['elapsed_s']} s = {d['mb_s']} MB/s end to end (read, encode, sha256, write); linear weights "
              f"{d['linear_dense_mb']} MB -> {d['linear_packed_mb']} MB ({d['ratio']:.3f}x)")


if __name__ == "__main__":
    main()
