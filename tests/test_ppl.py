"""Perplexity: the exact WikiText-2 protocol (windows, leftover dropped, mean NLL) against a hand computation."""
from __future__ import annotations

import math

import pytest
import torch

from sparsekit.errors import SparsekitError
from sparsekit.evaluation.ppl import perplexity, window_ids
from conftest import need_demo_model
from tiny_models import corpus, make_model, make_tokenizer

SEQLEN = 32


@pytest.fixture(scope="module")
def tiny():
    tok = make_tokenizer()
    model = make_model("llama", seed=3, vocab_size=len(tok))
    return model, tok


def hand_ppl(model, ids: torch.Tensor, seqlen: int, max_windows=None) -> tuple[float, int]:
    """Reference: one window at a time, float64 log-softmax, explicit loop over positions."""
    n = len(ids) // seqlen
    if max_windows is not None:
        n = min(n, max_windows)
    losses = []
    with torch.no_grad():
        for w in range(n):
            window = ids[w * seqlen:(w + 1) * seqlen]
            logp = torch.log_softmax(model(window[None]).logits[0].double(), dim=-1)
            nll = [-logp[t, window[t + 1]].item() for t in range(seqlen - 1)]
            losses.append(sum(nll) / len(nll))
    return math.exp(sum(losses) / n), n


def test_matches_hand_computation_and_drops_leftover(tiny):
    model, tok = tiny
    text = corpus(n_words=700, seed=5)
    ids = tok(text, return_tensors="pt").input_ids[0]
    assert len(ids) % SEQLEN != 0  # so that there is a leftover to drop
    want, n = hand_ppl(model, ids, SEQLEN)
    got = perplexity(model, tok, text, seqlen=SEQLEN, batch_size=3)  # 3 does not divide n: ragged last batch
    assert got["windows"] == n == len(ids) // SEQLEN
    assert got["tokens"] == n * SEQLEN < got["text_tokens"] == len(ids)
    assert got["ppl"] == pytest.approx(want, rel=1e-5)
    assert got["nll"] == pytest.approx(math.log(want), rel=1e-5)
    # the dropped leftover really is ignored: cutting the text to the full windows changes nothing
    cut = perplexity(model, tok, tok.decode(ids[: n * SEQLEN]), seqlen=SEQLEN)
    assert cut["windows"] == n and cut["ppl"] == pytest.approx(got["ppl"], rel=1e-5)


def test_max_windows_and_batch_size_independence(tiny):
    model, tok = tiny
    text = corpus(n_words=700, seed=5)
    ids = tok(text, return_tensors="pt").input_ids[0]
    want, _ = hand_ppl(model, ids, SEQLEN, max_windows=2)
    results = [perplexity(model, tok, text, seqlen=SEQLEN, max_windows=2, batch_size=b) for b in (1, 2, 7)]
    for r in results:
        assert r["windows"] == 2 and r["tokens"] == 2 * SEQLEN
        assert r["ppl"] == pytest.approx(want, rel=1e-5)


def test_window_ids_shape():
    ids = torch.arange(103)
    w = window_ids(ids, 10)
    assert w.shape == (10, 10) and torch.equal(w[3], torch.arange(30, 40))
    assert window_ids(ids, 10, max_windows=4).shape == (4, 10)


def test_clear_errors(tiny):
    model, tok = tiny
    with pytest.raises(SparsekitError, match=r"only \d+ tokens.*seqlen=4096"):
        perplexity(model, tok, "a short text", seqlen=4096)
    with pytest.raises(SparsekitError, match="max-windows"):
        perplexity(model, tok, corpus(n_words=200), seqlen=8, max_windows=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precisions_close_to_fp32(tiny, dtype):
    model, tok = tiny
    text = corpus(n_words=400, seed=7)
    ref = perplexity(model, tok, text, seqlen=SEQLEN)["ppl"]
    half = make_model("llama", seed=3, vocab_size=len(tok)).to(dtype)
    got = perplexity(half, tok, text, seqlen=SEQLEN)
    assert got["nonfinite_windows"] == 0
    assert got["ppl"] == pytest.approx(ref, rel=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu(tiny):
    model, tok = tiny
    text = corpus(n_words=400, seed=7)
    ref = perplexity(model, tok, text, seqlen=SEQLEN)["ppl"]
    gpu = make_model("llama", seed=3, vocab_size=len(tok)).cuda()
    assert perplexity(gpu, tok, text, seqlen=SEQLEN)["ppl"] == pytest.approx(ref, rel=1e-3)


@pytest.mark.slow
def test_demo_model_on_real_wikitext(wikitext_dir):
    """SmolLM2-135M (Q4_1 dequantized) on the real WikiText-2 test string: a sane perplexity."""
    from sparsekit.hf.data import eval_text
    from sparsekit.hf.models import load_model

    need_demo_model()
    model, tok = load_model("smollm2-135m", device="cpu")
    text = eval_text(str(wikitext_dir / "test.eval-string.txt"))
    assert text.startswith("\n\n = Robert Boulter = \n\n")
    r = perplexity(model, tok, text, seqlen=256, max_windows=2)
    assert r["windows"] == 2 and r["tokens"] == 512
    assert r["text_tokens"] > 250_000  # the whole test split was tokenized once
    assert 12 < r["ppl"] < 60, r  # measured 30.9; a broken conversion gives hundreds or more


class _OomAbove(torch.nn.Module):
    """Delegates to a model but raises CUDA's out-of-memory error for batches larger than ``limit``."""

    def __init__(self, model, limit):
        super().__init__()
        self.inner, self.limit, self.config = model, limit, model.config

    def forward(self, input_ids, **kw):
        if input_ids.shape[0] > self.limit:
            raise torch.cuda.OutOfMemoryError("fake OOM")
        return self.inner(input_ids=input_ids, **kw)


def test_out_of_memory_halves_the_batch(tiny):
    model, tok = tiny
    text = corpus(n_words=700, seed=5)
    want = perplexity(model, tok, text, seqlen=SEQLEN, batch_size=1)
    got = perplexity(_OomAbove(model, 2), tok, text, seqlen=SEQLEN, batch_size=8)  # 8 -> 4 -> 2
    assert got["windows"] == want["windows"] and got["ppl"] == pytest.approx(want["ppl"], rel=1e-6)
    with pytest.raises(SparsekitError, match="out of GPU memory"):
        perplexity(_OomAbove(model, 0), tok, text, seqlen=SEQLEN, batch_size=4)


def test_progress_is_the_one_callback_shape(tiny):
    """``progress(stage, done, total)``: 0 first, then after each batch, ending at the window count."""
    model, tok = tiny
    calls = []
    r = perplexity(model, tok, corpus(seed=1), seqlen=SEQLEN, max_windows=5, batch_size=2,
                   progress=lambda *a: calls.append(a))
    assert calls == [("perplexity", 0, 5), ("perplexity", 2, 5), ("perplexity", 4, 5), ("perplexity", 5, 5)]
    assert r["windows"] == 5
