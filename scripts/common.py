"""What the scripts share, the one helper module of ``scripts/`` (run every script from the repository
root as a module: ``python -m scripts.bench.kernels``, ``python -m scripts.demos.cats``, ...):

- the WikiText-2 files (``wikitext_file``: the one place that knows where the data lives);
- the model shapes of the benchmarks (``SHAPES``);
- a tiny random Llama with a tokenizer and a text, for the ``--smoke`` runs (``smoke_model``);
- the demos' calibration and evaluation options (``add_demo_options``) and their perplexity of a
  directory (``perplexity_of``);
- for the kernel scripts (bench.kernels, bench.tune_kernels, bench.probe_kernels, checks.gpu_kernels):
  random pruned weights, rotated weight copies, graph-replay timing, and the list arguments.
"""
from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import torch

from sparsekit.runtime.timing import time_ms

REPO = Path(__file__).resolve().parents[1]
WIKITEXT_DIRS = (REPO / ".devdata" / "wikitext", REPO.parent / "shared" / "data" / "wikitext-2-raw-v1")
CALIB_FILE, EVAL_FILE = "validation.stripped-nonblank-lines.txt", "test.eval-string.txt"

SHAPES = {
    # Llama-2-7B: 32 layers, hidden 4096, MLP 11008, 32 heads (MHA), vocab 32000
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                      tie_word_embeddings=False),
    # Llama-2-70B: 80 layers, hidden 8192, MLP 28672, 64 heads with 8 KV heads (GQA), vocab 32000
    "llama2-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096,
                       tie_word_embeddings=False),
    # a toy shape for --smoke runs on the CPU
    "toy": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512, tie_word_embeddings=False),
    # SmolLM2-135M (the demo model): 30 layers, hidden 576, MLP 1536, 9 heads, 3 kv heads, vocab 49152
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
}


def cuda_or_exit(what: str) -> None:
    """Exit with status 2 and one line on stderr when there is no CUDA GPU: ``what`` runs on one."""
    if not torch.cuda.is_available():
        print(f"{what} runs on a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)


def wikitext_file(name: str, folder: str | None = None) -> str:
    """``name`` (``CALIB_FILE`` or ``EVAL_FILE``) in ``folder``, else in the usual places (``WIKITEXT_DIRS``);
    exits with one line when it is nowhere."""
    dirs = [Path(folder)] if folder else list(WIKITEXT_DIRS)
    for d in dirs:
        if (d / name).is_file():
            return str(d / name)
    sys.exit(f"cannot find {name} in {', '.join(map(str, dirs))}: pass the WikiText-2 raw folder")


def add_demo_options(ap) -> None:
    """The calibration and evaluation options every demo takes (the protocol of docs/results.md)."""
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-seqlen", type=int, default=2048)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--device", default="cuda")


def perplexity_of(path, text: str, args) -> dict:
    """``sparsekit.evaluation.ppl.perplexity`` of the model at ``path`` (any directory the loader opens)
    on ``text``, with the demo options ``args``; the model is freed afterwards."""
    from sparsekit.evaluation.ppl import perplexity
    from sparsekit.runtime.loader import load

    model, tok = load(str(path), device=args.device)
    report = perplexity(model, tok, text, seqlen=args.eval_seqlen, max_windows=args.max_windows)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return report


def smoke_model(folder: Path) -> tuple[str, str, str]:
    """A tiny random Llama with a byte-level BPE tokenizer, and synthetic calibration/evaluation texts:
    ``(model dir, calibration file, evaluation file)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ("the of and to in is was for on as with by at from river city music army station season king "
             "church film album team game school war north south early later first great small old new").split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(15)) + " ." for _ in range(600))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "calib.txt").write_text(text)
    (folder / "eval.txt").write_text(text[::-1])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    model.save_pretrained(folder / "tiny")
    fast.save_pretrained(folder / "tiny")
    return str(folder / "tiny"), str(folder / "calib.txt"), str(folder / "eval.txt")

L2_ROTATE_BYTES = 200 * 2**20


def random_pruned(m: int, k: int, sparsity: float, gen: torch.Generator, device="cuda") -> torch.Tensor:
    """An fp16 [m, k] normal weight with about ``sparsity`` of its entries zeroed."""
    w = torch.randn(m, k, device=device, generator=gen).half()
    w[torch.rand(m, k, device=device, generator=gen) < sparsity] = 0
    return w


def copies_for(nbytes: int) -> int:
    """Copies of an ``nbytes`` operand that together exceed L2_ROTATE_BYTES (at least 4)."""
    return max(4, math.ceil(L2_ROTATE_BYTES / max(nbytes, 1)))


def weight_copies(p) -> list:
    """``copies_for`` independent copies of the packed weight ``p`` (rotated so L2 cannot hold them)."""
    return [type(p)(bitmaps=p.bitmaps.clone(), values=p.values.clone(), gtile_offsets=p.gtile_offsets.clone(),
                    strip_offsets=p.strip_offsets.clone(), shape=p.shape) for _ in range(copies_for(p.nbytes))]


def time_calls(calls, reps: int = 15, graph: bool = True) -> tuple[float, str]:
    """Median microseconds per call over ``reps`` replays of all ``calls`` (graph, else eager)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    mode = "graph"
    run = None
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for c in calls:
                    c()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for c in calls:
                    c()
            run = g.replay
        except Exception:  # noqa: BLE001 - not capturable: time eagerly
            torch.cuda.synchronize()
            run = None
    if run is None:
        mode = "eager"

        def run():
            for c in calls:
                c()
    return time_ms(run, repeats=reps, warmup=1) * 1e3 / len(calls), mode


def shapes_arg(text: str | None) -> list | None:
    """``"4096x4096,576x576"`` -> [(4096, 4096), (576, 576)] (None stays None)."""
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")] if text else None


def ints_arg(text: str | None) -> list | None:
    """``"1,16"`` -> [1, 16] (None stays None)."""
    return [int(v) for v in text.split(",")] if text else None


def plan_arg(text: str) -> dict:
    """``"tokens=128,strips=2"`` -> {"tokens": 128, "strips": 2}: a kernel plan's forced numbers (ValueError if not
    KEY=INT pairs)."""
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


def floats_arg(text: str | None) -> list | None:
    """``"0.5,0.7"`` -> [0.5, 0.7] (None stays None)."""
    return [float(v) for v in text.split(",")] if text else None


def masked_weight(m: int, k: int, kind, gen: torch.Generator, device="cuda") -> torch.Tensor:
    """An fp16 [m, k] normal weight pruned by ``kind``: a sparsity (float, random positions),
    ``"2:4"`` (two random survivors in every 4 along K; K padded up to a multiple of 4 is cut back),
    or ``"hybrid"`` (64x64 tiles alternately dense and 2:4). Pruned entries are +0.0 (torch.where)."""
    w = torch.randn(m, k, device=device, generator=gen)
    if not isinstance(kind, str):
        return torch.where(torch.rand(m, k, device=device, generator=gen) >= kind, w, 0.0).half()
    k4 = -(-k // 4) * 4
    order = torch.rand(m, k4 // 4, 4, device=device, generator=gen).argsort(-1)
    keep = (order < 2).reshape(m, k4)[:, :k]
    if kind == "hybrid":
        tiles = (torch.arange(m, device=device).view(-1, 1) // 64 + torch.arange(k, device=device) // 64) % 2 == 0
        keep = keep | tiles
    elif kind != "2:4":
        raise ValueError(f"unknown mask kind {kind!r}")
    return torch.where(keep, w, 0.0).half()


def kind_arg(text: str | None) -> list | None:
    """``"0.5,0.7,2:4,hybrid"`` -> [0.5, 0.7, "2:4", "hybrid"] (None stays None)."""
    if not text:
        return None
    return [v if v in ("2:4", "hybrid") else float(v) for v in text.split(",")]


def save_results(out_dir: str, name: str, rows: list, **meta) -> dict:
    """Write ``{"meta": ..., "rows": rows}`` to ``out_dir/name`` (meta: GPU, date, torch, command,
    and ``meta``'s extra keys) and return the meta."""
    import datetime
    import json
    import os
    import sys

    meta = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                torch=torch.__version__, command=" ".join(sys.argv), **meta)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return meta


def save_stub_tokenizer(path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` tokens ("t0" ..) saved into the checkpoint ``path``:
    encode and load_packed refuse a directory without tokenizer files, and a random-weight model
    for a kernel check has none."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)
