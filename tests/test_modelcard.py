"""The model card (README.md) that prune and encode write, and ``eval --ppl --update-card``."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.host.manifest import OUTPUT_MARKER
from sparsekit.hf import modelcard
from tests import tiny_models

runner = CliRunner()


def front_and_body(path: Path) -> tuple[dict, str]:
    text = (path / "README.md").read_text()
    m = re.match(r"---\n(.*?)\n---\n(.*)", text, re.S)
    assert m, text[:200]
    return yaml.safe_load(m.group(1)), m.group(2)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    import sparsekit

    root = tmp_path_factory.mktemp("card")
    tiny_models.save_tiny("llama", root / "tiny")
    calib = tiny_models.write_corpus(root / "calib.txt")
    report = sparsekit.prune(str(root / "tiny"), method="wanda", pattern="2:4", calib=str(calib), nsamples=4,
                             seqlen=32, device="cpu", output=root / "pruned", warn=lambda m: None)
    enc = sparsekit.encode(root / "pruned", root / "packed")
    return {"root": root, "calib": calib, "report": report, "encode": enc}


def test_prune_writes_a_card(dirs):
    pruned = dirs["root"] / "pruned"
    front, body = front_and_body(pruned)
    assert front == {"tags": ["sparsekit", "sparse", "wanda", "2:4"], "library_name": "transformers",
                     "pipeline_tag": "text-generation"}   # no base_model: the source is a local directory
    assert modelcard.is_card(pruned) and not modelcard.is_user_readme(pruned)
    size = sum(f.stat().st_size for f in pruned.glob("*.safetensors"))
    for row in ("| method | wanda |", "| pattern | 2:4 |", f"| size | {size / 1e6:,.1f} MB (dense weights",
                f"| calibration | 4 windows of 32 tokens from {dirs['calib']} (seed 0) |",
                f"| sparsekit | {dirs['report']['sparsekit_version']} |",
                f"| sparsity | {dirs['report']['sparsity']:.0%} of each pruned linear layer's weights |"):
        assert row in body, row
    assert "No evaluation recorded yet" in body


def test_encode_writes_the_packed_card(dirs):
    packed, enc = dirs["root"] / "packed", dirs["encode"]
    front, body = front_and_body(packed)
    assert front["tags"] == ["sparsekit", "sparse", "wanda", "2:4"]
    assert f"| size | {enc['total_bytes'] / 1e6:,.1f} MB packed as TCA-BME (linear weights {enc['ratio']:.3f}x" in body
    assert "import sparsekit" in body and "from_pretrained" in body


def test_a_readme_of_the_users_is_copied_and_never_replaced(dirs, tmp_path):
    import shutil

    import sparsekit

    src = tmp_path / "pruned"
    shutil.copytree(dirs["root"] / "pruned", src)
    (src / "README.md").write_text("# my notes\n")
    sparsekit.encode(src, tmp_path / "packed")
    assert (tmp_path / "packed" / "README.md").read_text() == "# my notes\n"
    res = runner.invoke(app, ["eval", str(tmp_path / "packed"), "--dataset", str(dirs["calib"]), "--seqlen", "32",
                              "--device", "cpu", "--update-card"])
    assert res.exit_code == 2 and "not a sparsekit model card" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "perplexity" not in res.stdout   # refused before the run
    assert (tmp_path / "packed" / "README.md").read_text() == "# my notes\n"


@pytest.mark.parametrize("offload", ["memory", "disk"])
def test_overwrite_keeps_a_readme_of_the_users_in_the_replaced_output(dirs, tmp_path, offload):
    """prune --overwrite (in memory and streamed) and encode --overwrite replace the output but keep
    the user's README there; a card of sparsekit's own is replaced by the new card."""
    import sparsekit

    out = tmp_path / "pruned"
    kw = dict(method="magnitude", sparsity=0.5, device="cpu", output=out, overwrite=True, offload=offload,
              warn=lambda m: None)
    sparsekit.prune(str(dirs["root"] / "tiny"), **kw)
    (out / "README.md").write_text("# mine\n")
    sparsekit.prune(str(dirs["root"] / "tiny"), **kw)
    assert (out / "README.md").read_text() == "# mine\n"
    (out / "README.md").unlink()
    sparsekit.encode(out, tmp_path / "packed")
    (tmp_path / "packed" / "README.md").write_text("# packed, mine\n")
    sparsekit.encode(out, tmp_path / "packed", overwrite=True)
    assert (tmp_path / "packed" / "README.md").read_text() == "# packed, mine\n"
    (tmp_path / "packed" / "README.md").unlink()
    sparsekit.encode(out, tmp_path / "packed", overwrite=True)
    assert modelcard.is_card(tmp_path / "packed")


def test_eval_update_card_records_the_perplexity(dirs, tmp_path):
    import shutil

    packed = tmp_path / "packed"
    shutil.copytree(dirs["root"] / "packed", packed)
    before = (packed / "README.md").read_text()
    args = ["eval", str(packed), "--ppl", "--dataset", str(dirs["calib"]), "--seqlen", "32", "--device", "cpu", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0 and (packed / "README.md").read_text() == before   # no --update-card: untouched
    for windows in ("2", "2", "3"):   # the same settings twice: one entry, replaced
        res = runner.invoke(app, [*args, "--max-windows", windows, "--update-card"])
        assert res.exit_code == 0, res.output
    ppl = json.loads(res.stdout)["ppl"]["ppl"]
    front, body = front_and_body(packed)
    (entry,) = front["model-index"]
    assert [m["name"] for r in entry["results"] for m in r["metrics"]] == \
           ["perplexity (seqlen 32, 2 windows, float32)", "perplexity (seqlen 32, 3 windows, float32)"]
    metric = entry["results"][-1]["metrics"][0]
    assert metric["type"] == "perplexity" and metric["value"] == pytest.approx(ppl, abs=1e-4)
    assert entry["results"][-1]["dataset"]["name"] == dirs["calib"].name
    assert f"| {dirs['calib'].name} | perplexity (seqlen 32, 3 windows, float32) | {ppl:.4g} |" in body
    assert "No evaluation recorded yet" not in body and front["tags"][0] == "sparsekit"
    hidden = [f.name for f in packed.iterdir() if f.name.startswith(".")]
    assert hidden == [OUTPUT_MARKER]   # the temporary file was renamed (the marker is the output's own)


@pytest.mark.parametrize("args, message", [(["--speed"], "add --ppl"), ([], "has no sparsekit model card")])
def test_update_card_errors_before_any_work(dirs, args, message):
    res = runner.invoke(app, ["eval", str(dirs["root"] / "tiny"), "--update-card", "--device", "cpu", *args])
    assert res.exit_code == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_base_model_is_a_hub_id_or_nothing(tmp_path):
    assert modelcard.base_model("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert modelcard.base_model("meta-llama/Llama-2-7b-hf") == "meta-llama/Llama-2-7b-hf"
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert modelcard.base_model(str(tmp_path / "org" / "name")) is None
    assert modelcard.base_model("./local") is None and modelcard.base_model(None) is None
    text = modelcard.render({"model": "meta-llama/Llama-2-7b-hf", "method": "sparsegpt", "pattern": "4:8",
                             "sparsity": 0.5, "sparsekit_version": "9.9"}, packed=None, size_bytes=10**6)
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["base_model"] == "meta-llama/Llama-2-7b-hf" and front["tags"][-1] == "4:8"
