"""`sparsekit eval --ppl --baseline`: the dense model's perplexity beside the pruned one, on the same windows."""
from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from sparsekit.cli.app import app
from tiny_models import make_model, make_tokenizer, save_tiny, write_corpus

runner = CliRunner()
WINDOWS = ["--seqlen", "32", "--max-windows", "5", "--device", "cpu"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny dense Llama, its 2:4 Wanda pruning (sparsekit.json names the dense dir) and the packed form."""
    from sparsekit.packed.encoding import encode
    from sparsekit.pruning.api import prune

    d = tmp_path_factory.mktemp("baseline")
    dense, text = save_tiny("llama", d / "dense"), write_corpus(d / "eval.txt", seed=4)
    prune(str(dense), method="wanda", pattern="2:4", calib=str(text), nsamples=4, seqlen=32, device="cpu",
          output=d / "pruned", warn=lambda m: None)
    encode(d / "pruned", d / "packed")
    return {"dense": dense, "pruned": d / "pruned", "packed": d / "packed", "text": text}


def ppl_json(*args):
    res = runner.invoke(app, ["eval", *map(str, args), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["ppl"]


def test_baseline_is_the_dense_model_on_the_same_windows(dirs):
    from sparsekit.evaluation.ppl import perplexity
    from sparsekit.runtime.loader import load

    r = ppl_json(dirs["pruned"], "--ppl", "--baseline", "--dataset", dirs["text"], *WINDOWS)
    text = dirs["text"].read_text()
    dense = perplexity(*load(str(dirs["dense"])), text, seqlen=32, max_windows=5)
    pruned = perplexity(*load(str(dirs["pruned"])), text, seqlen=32, max_windows=5)
    assert r["windows"] == 5 and r["tokens"] == 160
    assert r["ppl"] == pytest.approx(pruned["ppl"], rel=1e-6)
    assert r["baseline"]["model"] == str(dirs["dense"])
    assert r["baseline"]["ppl"] == pytest.approx(dense["ppl"], rel=1e-6)
    assert r["baseline"]["nll"] == pytest.approx(dense["nll"], rel=1e-6)
    assert r["ratio"] == pytest.approx(r["ppl"] / r["baseline"]["ppl"], rel=1e-9)
    assert r["ppl"] != pytest.approx(r["baseline"]["ppl"], rel=1e-3)  # pruning did change the model
    plain = ppl_json(dirs["pruned"], "--dataset", dirs["text"], *WINDOWS)
    assert "baseline" not in plain and "ratio" not in plain


def test_packed_dir_finds_its_dense_source(dirs, tmp_path):
    want = ppl_json(dirs["pruned"], "--baseline", "--dataset", dirs["text"], *WINDOWS)["baseline"]
    r = ppl_json(dirs["packed"], "--baseline", "--dataset", dirs["text"], *WINDOWS)
    assert r["baseline"]["model"] == str(dirs["dense"])
    assert r["baseline"]["ppl"] == pytest.approx(want["ppl"], rel=1e-6)
    # without the copied sparsekit.json, the index metadata names the source
    bare = tmp_path / "packed"
    shutil.copytree(dirs["packed"], bare)
    (bare / "sparsekit.json").unlink()
    assert ppl_json(bare, "--baseline", "--dataset", dirs["text"], *WINDOWS)["baseline"]["model"] == str(dirs["dense"])


def test_table_has_dense_column_and_rough_note(dirs):
    res = runner.invoke(app, ["eval", str(dirs["pruned"]), "--ppl", "--baseline", "--dataset", str(dirs["text"]),
                              *WINDOWS], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    out = " ".join(res.stdout.split())  # the caption may wrap
    assert "dense ppl" in out and "x dense" in out and "same 5 windows" in out
    assert "rough: only 5 windows" in out
    res = runner.invoke(app, ["eval", str(dirs["pruned"]), "--dataset", str(dirs["text"]), "--seqlen", "16",
                              "--max-windows", "32", "--device", "cpu"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "rough" not in res.stdout and "dense" not in res.stdout


def one_line_error(args, *needles):
    res = runner.invoke(app, ["eval", *map(str, args)])
    assert res.exit_code == 2, res.output
    err = res.stderr.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


def test_missing_source_says_how_to_pass_it(dirs, tmp_path):
    moved = tmp_path / "pruned"
    shutil.copytree(dirs["pruned"], moved)
    meta = json.loads((moved / "sparsekit.json").read_text())
    meta["model"] = str(tmp_path / "gone" / "dense")
    (moved / "sparsekit.json").write_text(json.dumps(meta))
    one_line_error([moved, "--baseline", "--dataset", dirs["text"], *WINDOWS], "cannot be found", "--baseline-model")
    r = ppl_json(moved, "--baseline-model", dirs["dense"], "--dataset", dirs["text"], *WINDOWS)  # implies --baseline
    assert r["baseline"]["model"] == str(dirs["dense"])
    # a dense directory records no source at all
    one_line_error([dirs["dense"], "--baseline", "--dataset", dirs["text"], *WINDOWS],
                   "does not record the dense model", "--baseline-model")


def test_different_tokenizer_is_refused(dirs, tmp_path):
    tok = make_tokenizer(vocab_size=290)  # another vocabulary: the text splits differently
    other = tmp_path / "other"
    make_model("llama", vocab_size=len(tok)).save_pretrained(other)
    tok.save_pretrained(other)
    one_line_error([dirs["pruned"], "--baseline-model", other, "--dataset", dirs["text"], *WINDOWS],
                   "splits the text differently")


def test_baseline_needs_ppl(dirs):
    one_line_error([dirs["pruned"], "--tasks", "x", "--baseline"], "add --ppl")


def test_the_table_fits_80_columns(dirs, tmp_path):
    """Issue 25 item 15: at 80 columns the --baseline table cut its headers and values ("seqle",
    "devic", "float3"), with the dataset file of the README's demo."""
    text = tmp_path / "validation.stripped-nonblank-lines.txt"
    shutil.copy(dirs["text"], text)
    res = runner.invoke(app, ["eval", str(dirs["pruned"]), "--ppl", "--baseline", "--dataset", str(text),
                              *WINDOWS], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert "…" not in res.stdout and all(len(line) <= 80 for line in res.stdout.splitlines())
    words = set(res.stdout.split())
    for head in ("seqlen", "windows", "tokens", "nll", "ppl", "dense", "x"):
        assert head in words, (head, res.stdout)
    assert "(cpu, float32)" in " ".join(res.stdout.split())
