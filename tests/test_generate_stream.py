"""`sparsekit generate` streams token by token, keeps what it generated when interrupted, and
caps --max-new-tokens at the model's context (issue 25 items 3 and 10). A tiny Llama on the CPU; the
reference is transformers' own greedy generate."""
from __future__ import annotations

import contextlib

import pytest
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.cli.common import Terminated
from sparsekit.errors import SparsekitWarning
from sparsekit.runtime.generate import check_sampling, generate_text
from test_generate import PROMPT, loaded, tiny  # noqa: F401 - fixtures
from test_generate import _reference as reference

runner = CliRunner()


def _reference(model, tok, n):
    return reference(model, tok, PROMPT, n)


@contextlib.contextmanager
def on_step(model, fn):
    """Call ``fn(step)`` at each forward of the LM head: step 1 is the prompt, step i computes token i."""
    count = {"n": 0}

    def hook(module, args, output):
        count["n"] += 1
        fn(count["n"])
    handle = model.lm_head.register_forward_hook(hook)
    try:
        yield count
    finally:
        handle.remove()


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_text_streams_token_by_token(loaded, engine):
    """The streamer printed whole words only: a reply without spaces showed nothing for 15 s and more."""
    model, tok = loaded
    want = _reference(model, tok, 10)
    streamed, seen = [], {}
    with on_step(model, lambda step: seen.setdefault(step, "".join(streamed))):
        generate_text(model, tok, PROMPT, check_sampling(10), on_text=streamed.append, engine=engine)
    for step in range(2, 11):   # before computing token `step`, tokens 1..step-1 are out
        text = tok.decode(want[: step - 1], skip_special_tokens=True)
        assert seen[step] == text.rstrip(" \ufffd"), step   # (a trailing space or half a character waits)


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_an_interrupt_keeps_every_token_generated_so_far(loaded, engine):
    """SIGINT dropped the text held back so far and printed only "interrupted"."""
    model, tok = loaded
    want = _reference(model, tok, 12)
    streamed = []

    def interrupt(step):
        if step == 7:
            raise KeyboardInterrupt
    with on_step(model, interrupt), pytest.raises(KeyboardInterrupt):
        generate_text(model, tok, PROMPT, check_sampling(12), on_text=streamed.append, engine=engine)
    assert "".join(streamed) == tok.decode(want[:6], skip_special_tokens=True)


@pytest.mark.parametrize("signal, code, word", [(KeyboardInterrupt, 130, "interrupted"), (Terminated, 143, "terminated")])
def test_cli_flushes_the_text_then_says_it_was_interrupted(tiny, loaded, monkeypatch, signal, code, word):
    import sparsekit.runtime.loader as loader

    model, tok = loaded
    want = _reference(model, tok, 12)
    real = loader.load
    hooks = []

    def load_then_stop_at_step_7(*a, **k):
        lm, t = real(*a, **k)
        hooks.append(on_step(lm, lambda step: (_ for _ in ()).throw(signal()) if step == 7 else None))
        hooks[-1].__enter__()
        return lm, t
    monkeypatch.setattr(loader, "load", load_then_stop_at_step_7)
    res = runner.invoke(app, ["generate", str(tiny), "--prompt", PROMPT, "-n", "12", "--device", "cpu"])
    assert res.exit_code == code, res.output
    assert res.stdout == tok.decode(want[:6], skip_special_tokens=True) + "\n"
    assert word in res.stderr and "Traceback" not in res.output


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_max_new_tokens_is_capped_at_the_context_with_a_warning(loaded, engine, monkeypatch):
    """`generate -n 100000000` was accepted (the static decoder sized its cache for it)."""
    model, tok = loaded
    monkeypatch.setattr(model.config, "max_position_embeddings", 24)
    prompt_tokens = len(tok(PROMPT).input_ids)

    def past_the_context(step):
        assert step <= 24 - prompt_tokens, "generated past the model's context"
    with on_step(model, past_the_context), pytest.warns(SparsekitWarning, match="context of 24 tokens") as w:
        r = generate_text(model, tok, PROMPT, check_sampling(5000), engine=engine)   # (small: no big cache if this fails)
    mine = [str(x.message) for x in w if issubclass(x.category, SparsekitWarning)]
    assert len(mine) == 1 and f"at most {24 - prompt_tokens} new tokens" in mine[0]
    assert r["new_tokens"] <= 24 - prompt_tokens


def test_cli_warns_in_one_line_when_capping(tiny, monkeypatch):
    import sparsekit.runtime.loader as loader

    real = loader.load

    def short_context(*a, **k):
        lm, t = real(*a, **k)
        lm.config.max_position_embeddings = 24

        def past_the_context(step):
            if step > 24:
                raise RuntimeError("generated past the model's context")
        on_step(lm, past_the_context).__enter__()
        return lm, t
    monkeypatch.setattr(loader, "load", short_context)
    res = runner.invoke(app, ["generate", str(tiny), "--prompt", PROMPT, "-n", "100000000", "--device", "cpu",
                              "--json"])
    assert res.exit_code == 0, res.output
    lines = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and "--max-new-tokens 100000000" in lines[0] and "context of 24 tokens" in lines[0]
