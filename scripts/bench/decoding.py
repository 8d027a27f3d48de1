"""Decoding engines on one GPU: sparsekit's GreedyDecoder against transformers' own static-cache decoding.

Three ways to run greedy decode steps of the same model (dense, then its 50%-packed twin), at each
batch size, on the same GPU in one process:

* ``ours``: ``sparsekit.runtime.decoder.GreedyDecoder`` as ``eval --speed`` runs it (each decoder layer
  through one regional ``torch.compile``, the whole step replayed from one CUDA graph);
* ``hf-generate``: ``model.generate(..., cache_implementation="static")`` with transformers' own
  compile config (``torch.compile`` of the forward, ``mode="reduce-overhead"``): ms per step from
  the difference of two lengths, so prefill and warm-up cancel;
* ``gpt-fast``: a single ``decode_one_token`` (forward on a ``StaticCache`` + argmax) compiled with
  ``mode="reduce-overhead", fullgraph=True``, as pytorch-labs/gpt-fast does.

All three see the same model object with the same fusions (``fusion.prepare_for_decode``), so only
the decoding driver differs. Also reported: the first-call (compile) seconds of each.

    python -m scripts.bench.decoding --model 7b --layers 4 --batch-sizes 1,16 --json out.json
    SPARSEKIT_DEMO_GGUF=... python -m scripts.bench.decoding --model demo --batch-sizes 1,16
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from scripts.common import cuda_or_exit


def _ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def hf_generate_ms(model, ids, short: int, long: int, repeats: int) -> tuple[float, float]:
    """(ms per decode step, seconds of the first call) of transformers' static-cache generate."""
    kw = dict(do_sample=False, cache_implementation="static", eos_token_id=None, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=long, **kw)
    first_s = time.perf_counter() - t0
    model.generate(ids, max_new_tokens=long, **kw)
    per = []
    for _ in range(repeats):
        a = _ms(lambda: model.generate(ids, max_new_tokens=short, **kw))
        b = _ms(lambda: model.generate(ids, max_new_tokens=long, **kw))
        per.append((b - a) / (long - short))
    return statistics.median(per), first_s


def gpt_fast_ms(model, ids, steps: int, repeats: int) -> tuple[float, float]:
    """(ms per decode step, seconds of compiling + the first steps) of one compiled decode_one_token."""
    from sparsekit.hf.compat import cache_kwarg, make_static_cache

    b, n = ids.shape
    cache = make_static_cache(model, n + steps * (repeats + 2) + 2)
    name = cache_kwarg(model.forward)

    def forward(tok, pos):
        out = model(input_ids=tok, position_ids=pos, use_cache=True, logits_to_keep=1, **{name: cache})
        return out.logits[:, -1].argmax(-1, keepdim=True)

    step = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        tok = forward(ids, torch.arange(n, device=ids.device)[None])
        pos = n
        t0 = time.perf_counter()
        for _ in range(3):
            tok = step(tok.clone(), torch.tensor([[pos]], device=ids.device))
            pos += 1
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        per = []
        for _ in range(repeats):
            positions = [torch.tensor([[p]], device=ids.device) for p in range(pos, pos + steps)]

            def loop():
                nonlocal tok
                for p in positions:
                    tok = step(tok.clone(), p)

            per.append(_ms(loop) / steps)
            pos += steps
    return statistics.median(per), first_s


def ours_ms(model, ids, steps: int, repeats: int) -> tuple[float, float]:
    from sparsekit.runtime.decoder import GreedyDecoder

    b, n = ids.shape
    dec = GreedyDecoder(model, b, n + steps + 1, compile=True, strict=True)
    with torch.no_grad():
        dec.prefill(ids)
        t0 = time.perf_counter()
        dec.capture()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        per = []
        for _ in range(repeats):
            dec.prefill(ids)
            per.append(_ms(lambda: [dec.step() for _ in range(steps)]) / steps)
    return statistics.median(per), first_s


def build(args):
    from sparsekit.runtime.fusion import prepare_for_decode

    if args.model == "demo":
        from sparsekit.hf.models import load_model

        from scripts.bench.e2e import prune_

        model, _ = load_model("smollm2-135m", device="cuda", dtype=torch.float16)
    else:
        from scripts.bench.e2e import build_model, prune_

        model = build_model(args.layers, 4096, 11008, 32, 32000)
    prune_(model, 0.5)
    return model, prepare_for_decode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("demo", "7b"), default="7b")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 7B-shaped model")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default="ours,hf-generate,gpt-fast")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cuda_or_exit("scripts.bench.decoding")
    os.environ.setdefault("SPARSEKIT_STRICT", "1")
    import transformers

    from sparsekit.runtime.swap import sparsify

    torch._dynamo.config.automatic_dynamic_shapes = False  # one static graph per batch size, every engine
    from sparsekit.torch_compat import raise_recompile_limit

    raise_recompile_limit(64)
    engines = args.engines.split(",")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    model, prepare = build(args)
    vocab = model.config.vocab_size
    rows = []
    for form in ("dense", "packed"):
        if form == "packed":
            sparsify(model, min_sparsity=0.3)
        prepare(model, fuse_norms=True, fuse_proj=form == "dense", equalize=True)
        for b in batches:
            ids = torch.randint(0, vocab, (b, args.prompt_len), generator=torch.Generator().manual_seed(0)).cuda()
            row = {"form": form, "batch": b}
            for eng in engines:
                torch.compiler.reset()
                try:
                    if eng == "ours":
                        ms, first = ours_ms(model, ids, args.steps, args.repeats)
                    elif eng == "hf-generate":
                        ms, first = hf_generate_ms(model, ids, 8, 8 + args.steps, args.repeats)
                    else:
                        ms, first = gpt_fast_ms(model, ids, args.steps, args.repeats)
                    row[eng] = {"ms_per_step": ms, "first_s": first}
                except Exception as e:  # noqa: BLE001 - a benchmark row says what failed, the others go on
                    row[eng] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
                print(form, b, eng, row[eng], flush=True)
            rows.append(row)
    report = {"gpu": torch.cuda.get_device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": "python -m scripts.bench.decoding " + " ".join(sys.argv[1:]),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "model": args.model, "layers": args.layers if args.model == "7b" else None, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(f"\n{report['gpu']}, torch {torch.__version__}, transformers {transformers.__version__}")
    print("| model | batch | " + " | ".join(f"{e} ms/step (first s)" for e in engines) + " | ours / best other |")
    print("|---|---:|" + "---:|" * (len(engines) + 1))
    for r in rows:
        cells = [f"{r[e]['ms_per_step']:.3f} ({r[e]['first_s']:.1f})" if "ms_per_step" in r[e] else r[e]["error"][:40]
                 for e in engines]
        others = [r[e]["ms_per_step"] for e in engines if e != "ours" and "ms_per_step" in r[e]]
        ratio = (f"{r['ours']['ms_per_step'] / min(others):.2f}" if others and "ms_per_step" in r.get("ours", {})
                 else "-")
        print(f"| {r['form']} | {r['batch']} | " + " | ".join(cells) + f" | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
