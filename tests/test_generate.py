"""`sparsekit generate` and sparsekit.runtime.generate on a tiny Llama (CPU): greedy equals
transformers' generate, both engines agree, --json, --seed, --chat from piped stdin, one-line errors."""
from __future__ import annotations

import gc
import json
import re
import weakref

import pytest
import torch
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.errors import SparsekitError
from sparsekit.runtime.generate import Chat, StopFilter, check_sampling, generate_text
from tiny_models import save_tiny

runner = CliRunner()
PROMPT = "the river city"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("gen") / "model")


@pytest.fixture(scope="module")
def loaded(tiny):
    from sparsekit.runtime.loader import load

    return load(str(tiny), "cpu")


def _reference(model, tok, prompt, n):
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=n, attention_mask=torch.ones_like(ids),
                             pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def run(*args, input=None):
    return runner.invoke(app, ["generate", *map(str, args)], input=input)


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_greedy_equals_transformers_generate(loaded, engine):
    model, tok = loaded
    streamed = []
    r = generate_text(model, tok, PROMPT, check_sampling(12), on_text=streamed.append, engine=engine)
    want = _reference(model, tok, PROMPT, 12)
    assert r["token_ids"] == want and r["engine"] == engine
    assert r["text"] == tok.decode(want, skip_special_tokens=True) == "".join(streamed)
    assert r["new_tokens"] == len(want) and r["prompt_tokens"] == len(tok(PROMPT).input_ids)


@pytest.mark.parametrize("arch", ["opt", "gpt2", "gpt_neox"])
def test_both_engines_agree_on_other_architectures(tmp_path, arch):
    from sparsekit.runtime.loader import load

    model, tok = load(str(save_tiny(arch, tmp_path / arch)), "cpu")
    hf, static = (generate_text(model, tok, PROMPT, check_sampling(8), engine=e) for e in ("hf", "static"))
    assert hf["token_ids"] == static["token_ids"] == _reference(model, tok, PROMPT, 8)


def test_static_engine_stops_at_eos_like_generate(loaded):
    model, tok = loaded
    prompt = "the"
    want = _reference(model, tok, prompt, 40)
    model.generation_config.eos_token_id = want[3]  # make the 4th greedy token the end
    try:
        for engine in ("hf", "static"):
            r = generate_text(model, tok, prompt, check_sampling(40), engine=engine)
            assert r["token_ids"] == want[: want.index(want[3]) + 1], engine
    finally:
        model.generation_config.eos_token_id = 0


def test_cli_streams_the_greedy_text_and_reports_speed_on_stderr(tiny, loaded):
    model, tok = loaded
    res = run(tiny, "--prompt", PROMPT, "-n", 10, "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert res.stdout == tok.decode(_reference(model, tok, PROMPT, 10), skip_special_tokens=True) + "\n"
    assert "tokens/s" in res.stderr and "tokens/s" not in res.stdout


def test_cli_json_has_the_text_and_timings(tiny, loaded):
    model, tok = loaded
    res = run(tiny, "--prompt", PROMPT, "--max-new-tokens", 6, "--device", "cpu", "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)  # one JSON document, nothing streamed
    assert r["text"] == tok.decode(_reference(model, tok, PROMPT, 6), skip_special_tokens=True)
    assert r["new_tokens"] == 6 and r["prompt_tokens"] == len(tok(PROMPT).input_ids)
    assert r["seconds"] > 0 and r["tokens_per_s"] == pytest.approx(6 / r["seconds"])
    assert r["sampling"] == {"max_new_tokens": 6, "temperature": 0.0, "top_p": 1.0, "seed": None}
    assert (r["device"], r["dtype"], r["engine"]) == ("cpu", "float32", "hf")


def test_console_script_gc_policy_gives_the_same_json(tiny, loaded, monkeypatch):
    """As the console script runs it (common.long_lived on: no GC during imports and load, then frozen)."""
    import sparsekit.cli.generate as gen_cli
    from sparsekit.cli.common import long_lived

    model, tok = loaded
    monkeypatch.setattr(gen_cli, "long_lived", lambda: long_lived(True))
    try:
        res = run(tiny, "--prompt", PROMPT, "--max-new-tokens", 6, "--device", "cpu", "--json")
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["text"] == tok.decode(_reference(model, tok, PROMPT, 6), skip_special_tokens=True)


class _Node:
    pass


def test_long_lived_freezes_what_it_made_and_collects_again_after():
    from sparsekit.cli.common import long_lived

    with long_lived():   # pytest's process is not the console script's: nothing changes
        assert gc.isenabled()
    gc.collect()
    try:
        with long_lived(True):
            assert not gc.isenabled()
            kept = _Node()
            kept.me = kept                    # a cycle: only the collector could free it
        assert gc.isenabled() and gc.get_freeze_count() > 0
        assert gc.is_tracked(kept) and not any(o is kept for o in gc.get_objects())   # frozen: out of every generation
        later = _Node()
        later.me = later
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None                 # the collector works on what comes after
    finally:
        gc.unfreeze()
    with pytest.raises(RuntimeError), long_lived(True):
        raise RuntimeError("the load failed")
    assert gc.isenabled() and gc.get_freeze_count() == 0   # an error: the collector on again, nothing frozen


def test_seed_makes_sampling_repeatable(tiny):
    def sample(seed):
        res = run(tiny, "--prompt", PROMPT, "-n", 16, "--temperature", 1.5, "--top-p", 0.95, "--seed", seed,
                  "--device", "cpu", "--json")
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)["text"]

    a, b, c = sample(1), sample(1), sample(2)
    assert a == b and a != c


def test_chat_reads_piped_stdin_keeps_history_and_stops_at_exit(tiny):
    res = run(tiny, "--chat", "-n", 4, "--device", "cpu", "--json", input="hello there\n\nthe city\n/exit\nnever read\n")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["chat_template"] is False and [t["user"] for t in r["turns"]] == ["hello there", "the city"]
    assert r["turns"][1]["prompt_tokens"] > r["turns"][0]["prompt_tokens"]  # the history goes along
    assert "no chat template" in res.stderr

    res = run(tiny, "--chat", "-n", 3, "--device", "cpu", input="hello\n")  # EOF ends it too
    assert res.exit_code == 0, res.output
    assert res.stdout.count("\n") == 1 and "tokens/s" in res.stderr


def test_chat_uses_the_chat_template(loaded):
    model, tok = loaded
    tok.chat_template = TEMPLATE
    try:
        chat = Chat(model, tok, check_sampling(3))
        assert chat.templated
        first = chat.send("hi")
        chat.send("more")
        assert chat.render() == (f"<|user|>hi\n<|assistant|>{first['text'].strip()}\n<|user|>more\n"
                                 f"<|assistant|>{chat.messages[-1]['content']}\n<|assistant|>")
    finally:
        tok.chat_template = None
    plain = Chat(model, tok, check_sampling(3))
    plain.send("hi")
    assert plain.render().startswith("User: hi\nAssistant:") and plain.render().endswith("\nAssistant:")


def test_stop_filter_holds_back_a_possible_stop_and_cuts_at_it():
    out = []
    f = StopFilter(out.append, "\nUser:")
    for piece in ["Hello", " there\n", "Us", "er: next", " more"]:
        f(piece)
    f.flush()
    assert "".join(out) == "Hello there" and f.stopped
    out.clear()
    g = StopFilter(out.append, "\nUser:")
    g("a\nUs")
    g("e it")
    g.flush()
    assert "".join(out) == "a\nUse it"


@pytest.mark.parametrize("args,match", [
    ((), "--prompt TEXT, or --chat"),
    (("--prompt", "  "), "prompt is empty"),
    (("--prompt", "x", "--temperature", -0.5), "temperature must be >= 0"),
    (("--prompt", "x", "--top-p", 0), r"top-p must be in \(0, 1\]"),
    (("--prompt", "x", "--top-p", 1.01), r"top-p must be in \(0, 1\]"),
    (("--prompt", "x", "--max-new-tokens", 0), "max-new-tokens must be at least 1"),
    (("--prompt", "x", "--prefer", "fast"), "--prefer must be speed or memory"),
])
def test_bad_arguments_are_one_line_errors(tiny, args, match):
    res = run(tiny, *args, "--device", "cpu")
    assert res.exit_code == 2
    assert len(res.stderr.strip().splitlines()) == 1 and re.search(match, res.stderr)


def test_missing_model_dir_is_one_line(tmp_path):
    res = run(tmp_path / "nope", "--prompt", "hi", "--device", "cpu")
    assert res.exit_code == 2 and "does not exist" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_library_refuses_sampling_on_the_static_engine(loaded):
    with pytest.raises(SparsekitError, match="greedily"):
        generate_text(*loaded, PROMPT, check_sampling(2, temperature=0.5), engine="static")


def test_auto_falls_back_to_transformers_when_the_static_decoder_cannot_run(loaded, monkeypatch):
    import sparsekit.runtime.decoder as decoder
    import sparsekit.runtime.generate as gen

    def broken(*a, **k):
        raise RuntimeError("no static cache for this model")

    model, tok = loaded
    monkeypatch.setattr(decoder, "GreedyDecoder", broken)
    monkeypatch.setattr(gen, "pick_engine", lambda *a, **k: "static")  # as auto does on CUDA
    with pytest.raises(SparsekitError, match="no static cache"):  # strict (the tests' default): no fallback
        generate_text(model, tok, PROMPT, check_sampling(6))
    monkeypatch.setenv("SPARSEKIT_STRICT", "0")
    streamed = []
    r = generate_text(model, tok, PROMPT, check_sampling(6), on_text=streamed.append)
    assert r["engine"] == "hf" and "no static cache" in r["notes"][0]
    assert r["token_ids"] == _reference(model, tok, PROMPT, 6) and "".join(streamed) == r["text"]
    with pytest.raises(SparsekitError, match="no static cache"):
        generate_text(model, tok, PROMPT, check_sampling(6), engine="static")
