"""``load`` builds the tokenizer in a thread while the model loads (issue 20): the same model, tokenizer
and generated text as loading them one after the other; the same error lines; a failure in the thread
is retried in the caller's thread, so its error, if any, is the one a plain load gives."""
from __future__ import annotations

import threading

import pytest
import torch
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.errors import SparsekitError
from sparsekit.hf import models
from sparsekit.runtime import loader
from sparsekit.runtime.generate import check_sampling, generate_text
from tiny_models import save_tiny

PROMPT = "the river city"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("conc") / "model")


@pytest.fixture(scope="module")
def packed(tiny, tmp_path_factory):
    from sparsekit.pruning.api import prune
    from sparsekit.packed.encoding import encode_checkpoint

    out = tmp_path_factory.mktemp("conc_packed")
    prune(str(tiny), method="magnitude", sparsity=0.5, output=out / "pruned")
    encode_checkpoint(out / "pruned", out / "packed")
    return out / "packed"


def sequential(path):
    """What ``load`` returned before: the tokenizer first, then the model, in this thread."""
    location = models.resolve_model(str(path))
    tok = models.open_tokenizer(location)
    return loader.open_model(location, torch.device("cpu"), torch.float32), tok


@pytest.mark.parametrize("which", ["dense", "packed"])
def test_the_tokenizer_is_built_in_a_thread_and_generation_is_unchanged(tiny, packed, which, monkeypatch):
    path = tiny if which == "dense" else packed
    want_model, want_tok = sequential(path)
    threads = []
    build = models.build_tokenizer

    def recording(location):
        threads.append(threading.current_thread())
        return build(location)

    monkeypatch.setattr(models, "build_tokenizer", recording)
    model, tok = loader.load(str(path), "cpu")
    assert len(threads) == 1 and threads[0] is not threading.main_thread()
    assert type(tok) is type(want_tok) and tok.get_vocab() == want_tok.get_vocab()
    assert tok(PROMPT).input_ids == want_tok(PROMPT).input_ids
    got = generate_text(model, tok, PROMPT, check_sampling(12))
    want = generate_text(want_model, want_tok, PROMPT, check_sampling(12))
    assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]


def test_cli_generate_prints_what_a_sequential_load_generates(tiny):
    model, tok = sequential(tiny)
    want = generate_text(model, tok, PROMPT, check_sampling(10))["text"]
    res = CliRunner().invoke(app, ["generate", str(tiny), "--prompt", PROMPT, "-n", "10", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert res.stdout.rstrip("\n") == want


def test_a_failure_in_the_thread_is_retried_here(tiny, monkeypatch):
    build = models.build_tokenizer
    calls = []

    def flaky(location):
        calls.append(threading.current_thread() is threading.main_thread())
        if len(calls) == 1:
            raise ImportError("deadlock detected by _ModuleLock")   # a raced import
        return build(location)

    monkeypatch.setattr(models, "build_tokenizer", flaky)
    _, tok = loader.load(str(tiny), "cpu")
    assert calls == [False, True] and tok(PROMPT).input_ids


def test_tokenizer_errors_are_the_same_lines(tiny, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny, bare)
    for f in models.tokenizer_files(bare):
        (bare / f).unlink()
    with pytest.raises(SparsekitError, match="has no tokenizer files"):
        loader.load(str(bare), "cpu")
    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(SparsekitError, match="could not load the tokenizer of"):
        loader.load(str(broken), "cpu")
