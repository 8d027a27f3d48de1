"""GPU check of issue 24: transformers' ``from_pretrained(packed, device_map="cuda")`` then greedy
``generate()`` on the demo model gives the text ``sparsekit generate`` gives at temperature 0.

    python -m scripts.checks.gpu_from_pretrained                  # prunes + encodes the demo model first
    python -m scripts.checks.gpu_from_pretrained --packed DIR     # an existing packed directory

The demo model is pruned with Wanda to 50% (32 calibration windows of 256 tokens from the WikiText-2
validation lines, as in the README) into ``out/gpu-check-fp/``. ``sparsekit generate --json`` runs in a
subprocess (the CLI as users run it: defaults, then ``--prefer memory``); ``from_pretrained`` +
``generate(do_sample=False, cache_implementation="static")`` runs here. Prints PASS (exit 0) when the
texts are equal, else FAIL (exit 1) with both texts and where the tokens part.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from scripts.common import CALIB_FILE as CALIB, REPO, wikitext_file


def build_demo(out: Path, calib: str | None) -> Path:
    import sparsekit

    calib = calib or wikitext_file(CALIB)
    sparsekit.prune("smollm2-135m", method="wanda", sparsity=0.5, calib=calib, nsamples=32, seqlen=256,
                    device="cuda", output=out / "pruned", overwrite=True, warn=lambda m: None)
    sparsekit.encode_checkpoint(out / "pruned", out / "packed", overwrite=True)
    return out / "packed"


def cli_text(packed: Path, prompt: str, n: int, *extra: str) -> str:
    cmd = [sys.executable, "-m", "sparsekit.cli.app", "generate", str(packed), "--prompt", prompt,
           "--max-new-tokens", str(n), "--temperature", "0", "--device", "cuda", "--json", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()[-2000:]}")
    return json.loads(res.stdout)["text"]


@torch.no_grad()
def from_pretrained_text(packed: Path, prompt: str, n: int) -> tuple[str, list[int], object, object]:
    import sparsekit  # registers the "sparsekit" quantizer with transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparsekit.runtime.sparse_linear import SparseLinear

    model = AutoModelForCausalLM.from_pretrained(str(packed), device_map="cuda")
    tok = AutoTokenizer.from_pretrained(str(packed))
    layers = sum(isinstance(m, SparseLinear) for m in model.modules())
    print(f"from_pretrained (sparsekit {sparsekit.__version__}): {type(model).__name__}, {layers} SparseLinear, "
          f"dtype {model.dtype}, device {next(model.parameters()).device}")
    if not layers or next(model.parameters()).device.type != "cuda":
        sys.exit("FAIL: from_pretrained did not give a packed model on the GPU")
    ids = tok(prompt, return_tensors="pt").input_ids.to("cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         cache_implementation="static", temperature=None, top_p=None, top_k=None)
    new = out[0, ids.shape[1]:].tolist()
    return tok.decode(new, skip_special_tokens=True), new, model, tok


def margin_where_they_part(model, tok, prompt: str, new: list[int], other: str) -> str:
    """Where the other text's tokens leave ours, and the top-2 logit gap of our model there."""
    ours = tok(prompt, return_tensors="pt").input_ids[0].tolist() + new
    theirs = tok(prompt + other, return_tensors="pt").input_ids[0].tolist()
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    if k == 0 or k >= len(ours):
        return f"the token sequences part at position {k}"
    with torch.no_grad():
        logits = model(torch.tensor([ours[:k]], device="cuda")).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    gap = float(top[0] - top[1])
    return f"the tokens part at position {k}; there the top-2 logit gap of from_pretrained's model is {gap:.4f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packed", help="packed directory (default: prune + encode the demo model)")
    ap.add_argument("--out", default=str(REPO / "out" / "gpu-check-fp"))
    ap.add_argument("--calib", help=f"calibration text (default: {CALIB} from the shared WikiText-2 folder)")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("FAIL: no CUDA GPU: this check runs on a GPU machine")
    packed = Path(args.packed) if args.packed else build_demo(Path(args.out), args.calib)
    want = cli_text(packed, args.prompt, args.max_new_tokens)
    got, new, model, tok = from_pretrained_text(packed, args.prompt, args.max_new_tokens)
    print(f"sparsekit generate: {want!r}")
    print(f"from_pretrained:    {got!r}")
    if got == want:
        print("PASS: from_pretrained + generate gives the text of `sparsekit generate`")
        return 0
    memory = cli_text(packed, args.prompt, args.max_new_tokens, "--prefer", "memory")
    print(f"sparsekit generate --prefer memory: {memory!r} ({'equal' if memory == got else 'differs too'})")
    print(f"FAIL: the texts differ: {margin_where_they_part(model, tok, args.prompt, new, want)}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
