"""`sparsekit eval` end to end: table output, --json (only JSON on stdout), one-line errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.errors import SparsekitError
from conftest import need_demo_model
from tiny_models import save_tiny, write_corpus

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_eval")
    return save_tiny("llama", d / "model"), write_corpus(d / "eval.txt", seed=4)


def test_json_report_matches_the_library(tiny):
    from sparsekit.evaluation.ppl import perplexity
    from sparsekit.runtime.loader import load

    model_dir, text_file = tiny
    res = runner.invoke(app, ["eval", str(model_dir), "--dataset", str(text_file), "--seqlen", "32",
                              "--max-windows", "5", "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)  # stdout holds exactly one JSON document
    assert set(report) == {"model", "ppl"}  # neither --ppl nor --speed means --ppl
    r = report["ppl"]
    assert r["windows"] == 5 and r["seqlen"] == 32 and r["tokens"] == 160 and r["dtype"] == "float32"
    model, tok = load(str(model_dir))
    want = perplexity(model, tok, text_file.read_text(), seqlen=32, max_windows=5)
    assert r["ppl"] == pytest.approx(want["ppl"], rel=1e-6)


def test_json_stays_strict_json_when_the_perplexity_overflows(tiny, tmp_path):
    from tiny_models import make_model, make_tokenizer

    model = make_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(1e5)  # fp16 logits overflow -> non-finite loss -> ppl inf
    model.save_pretrained(tmp_path / "hot")
    make_tokenizer().save_pretrained(tmp_path / "hot")
    res = runner.invoke(app, ["eval", str(tmp_path / "hot"), "--dataset", str(tiny[1]), "--seqlen", "32",
                              "--max-windows", "2", "--device", "cpu", "--dtype", "float16", "--json"])
    assert res.exit_code == 0, res.output

    def reject(constant):
        raise ValueError(f"not JSON: {constant}")

    r = json.loads(res.stdout, parse_constant=reject)["ppl"]  # was "ppl": Infinity
    assert r["ppl"] is None and r["nll"] is None and r["nonfinite_windows"] == 2


def test_table_output_and_seqlen_capped(tiny):
    model_dir, text_file = tiny
    # the tiny model's context is 256: --seqlen 1024 is capped with a warning
    res = runner.invoke(app, ["eval", str(model_dir), "--ppl", "--dataset", str(text_file), "--seqlen", "1024",
                              "--max-windows", "1", "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    assert "Perplexity" in res.stdout and "bfloat16" in res.stdout and "256" in res.stdout
    assert "exceeds the model context" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["eval", "./no/such/model"], "no model at"),
    (["eval", "{model}", "--dataset", "./missing.txt"], "no file at"),
    (["eval", "{model}", "--plot", "x.png"], "add --speed"),
    (["eval", "{model}", "--batch-sizes", "1,x"], "--batch-sizes"),
])
def test_one_line_errors(tiny, args, message):
    args = [a.format(model=tiny[0]) for a in args]
    res = runner.invoke(app, args)
    assert res.exit_code == 2
    assert res.stderr.strip().startswith("error:") and message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU messages")
def test_gpu_requests_without_gpu(tiny):
    res = runner.invoke(app, ["eval", str(tiny[0]), "--device", "cuda"])
    assert res.exit_code == 2 and "no CUDA GPU found" in res.stderr and "--device cpu" in res.stderr
    res = runner.invoke(app, ["eval", str(tiny[0]), "--ppl", "--speed"])  # refused before the ppl run
    assert res.exit_code == 2 and "needs a CUDA GPU" in res.stderr and "Perplexity" not in res.stdout


@pytest.mark.slow
def test_demo_alias_subprocess_json(wikitext_dir):
    """The installed console script on the demo model and the real WikiText-2 test string."""
    need_demo_model()
    cmd = [sys.executable, "-m", "sparsekit.cli.app", "eval", "smollm2-135m", "--dataset",
           str(wikitext_dir / "test.eval-string.txt"), "--seqlen", "128", "--max-windows", "2", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    r = report["ppl"]
    assert r["windows"] == 2 and r["tokens"] == 256 and r["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert 12 < r["ppl"] < 100, r  # measured ~47 at seqlen 128 on CPU


def test_pruned_and_packed_dirs_give_the_same_perplexity(tiny, tmp_path):
    """prune -> encode -> eval: the packed TCA-BME directory evaluates like the pruned one it came from."""
    from sparsekit.packed.encoding import encode
    from sparsekit.pruning.api import prune

    model_dir, text_file = tiny
    pruned, packed = tmp_path / "pruned", tmp_path / "packed"
    prune(str(model_dir), method="wanda", pattern="2:4", calib=str(text_file), nsamples=4, seqlen=32,
          device="cpu", output=pruned, warn=lambda m: None)
    encode(pruned, packed)
    reports = {}
    for name, d in (("pruned", pruned), ("packed", packed)):
        res = runner.invoke(app, ["eval", str(d), "--dataset", str(text_file), "--seqlen", "32", "--max-windows", "8",
                                  "--device", "cpu", "--json"])
        assert res.exit_code == 0, res.output
        reports[name] = json.loads(res.stdout)["ppl"]
    assert reports["packed"]["windows"] == reports["pruned"]["windows"] == 8
    # packed values are stored in fp16; the pruned checkpoint keeps the model's fp32
    assert reports["packed"]["ppl"] == pytest.approx(reports["pruned"]["ppl"], rel=1e-3)


def test_speed_flags_reach_the_runtime(tiny, tmp_path, monkeypatch):
    """--speed/--batch-sizes/--plot are passed to sparsekit.evaluation.speed; --json carries both reports."""
    import sparsekit.cli.render as render
    import sparsekit.evaluation.speed as speed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the runtime itself is faked below
    calls = {}

    def fake_measure(model_dir, *, device, batch_sizes, dtype, progress=None, **kw):
        calls["measure"] = (model_dir, device, batch_sizes, dtype)
        return {"rows": [], "notes": ["a note"], "gpu": "fake"}

    def fake_plot(report, path):
        calls["plot"] = str(path)
        return path

    monkeypatch.setattr(speed, "measure_speed", fake_measure)
    monkeypatch.setattr(render, "plot_speed", fake_plot)
    png = tmp_path / "speed.png"
    res = runner.invoke(app, ["eval", str(tiny[0]), "--speed", "--batch-sizes", "1, 4", "--plot", str(png), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert set(report) == {"model", "speed"}  # --speed alone: no perplexity
    assert calls["measure"] == (str(tiny[0]), "cuda", (1, 4), torch.float16)
    assert calls["plot"] == str(png) and report["speed"]["plot"] == str(png)
    assert "a note" in res.stderr
