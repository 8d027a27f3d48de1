"""`sparsekit encode / inspect / verify / export-bitmask / import-bitmask` through the CLI."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.packed.shards import read_packed
from sparsekit.packed.tcabme import decode

from test_packing import make_pruned

runner = CliRunner()


def _json(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_pack")
    state = make_pruned(d / "pruned", layer_sparsity={"v_proj": 0.05})  # too dense to gain by packing
    return d, state


def test_encode_inspect_verify_json(work):
    d, state = work
    rep = _json(runner.invoke(app, ["encode", str(d / "pruned"), "-o", str(d / "packed"), "--json",
                                    "--max-shard-size", "100KB"]))
    assert rep["layers"] == 14 and rep["packed_layers"] == 12 and rep["shards"] > 1
    ck = read_packed(d / "packed")
    m = "model.layers.0.mlp.up_proj"
    assert torch.equal(decode(ck.packed[m]), state[f"{m}.weight"])

    ins = _json(runner.invoke(app, ["inspect", str(d / "packed"), "--json"]))
    assert ins["totals"]["packed_layers"] == 12
    assert ins["totals"]["dense_bytes"] == rep["linear_dense_bytes"]
    assert ins["totals"]["packed_bytes"] == rep["linear_stored_bytes"]
    dense_rows = [r for r in ins["layers"] if not r["packed"]]
    assert len(dense_rows) == 2 and all("kept dense" in r["reason"] for r in dense_rows)

    ver = _json(runner.invoke(app, ["verify", str(d / "packed"), "--json"]))
    assert ver["ok"] and ver["packed_layers"] == 12


def test_tables_and_messages(work):
    d, _ = work
    out = d / "packed2"
    res = runner.invoke(app, ["encode", str(d / "pruned"), "-o", str(out), "--force"])
    assert res.exit_code == 0, res.output
    assert "packed 14/14" in res.stdout
    res = runner.invoke(app, ["inspect", str(out)])
    assert res.exit_code == 0 and "total" in res.stdout and "ratio" in res.stdout
    res = runner.invoke(app, ["verify", str(out)])
    assert res.exit_code == 0 and "ok" in res.stdout


def test_errors_are_one_line_exit_2(work, tmp_path):
    d, _ = work
    res = runner.invoke(app, ["encode", str(tmp_path / "missing"), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "error:" in res.output and "Traceback" not in res.output
    (tmp_path / "exists").mkdir()
    res = runner.invoke(app, ["encode", str(d / "pruned"), "-o", str(tmp_path / "exists")])
    assert res.exit_code == 2 and "--overwrite" in res.output
    res = runner.invoke(app, ["verify", str(d / "pruned")])
    assert res.exit_code == 2 and "not a TCA-BME checkpoint" in res.output
    res = runner.invoke(app, ["encode", str(d / "pruned"), "-o", str(tmp_path / "o"), "--max-shard-size", "lots"])
    assert res.exit_code == 2 and "size" in res.output



@pytest.mark.parametrize("damage, words", [
    ("binary config.json", "config.json is not valid JSON"),
    ("no tokenizer", "has no tokenizer files"),
    ("no config.json", "has no config.json"),
])
def test_encode_refuses_at_once_what_verify_would_reject(work, tmp_path, damage, words):
    """Issue 25 item 5: a binary config.json was a UnicodeDecodeError traceback (encode, export-bitmask).
    Item 7: encode of a pruned directory without a tokenizer succeeded, then verify rejected the output."""
    d, _ = work
    src = tmp_path / "src"
    shutil.copytree(d / "pruned", src)
    if damage == "binary config.json":
        (src / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" + bytes(range(256)))
    elif damage == "no tokenizer":
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (src / f).unlink()
    else:
        (src / "config.json").unlink()
    for cmd in ("encode", "export-bitmask") if damage != "no tokenizer" else ("encode",):
        res = runner.invoke(app, [cmd, str(src), "-o", str(tmp_path / "o")])
        assert res.exit_code == 2, (cmd, res.output)
        assert len(res.stderr.strip().splitlines()) == 1 and words in res.stderr, (cmd, res.stderr)
        assert not (tmp_path / "o").exists()

def test_verify_corrupt_exit_2(work, tmp_path):
    d, _ = work
    bad = tmp_path / "bad"
    runner.invoke(app, ["encode", str(d / "pruned"), "-o", str(bad)])
    shard = next(bad.glob("tcabme-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-10])
    res = runner.invoke(app, ["verify", str(bad), "--json"])
    assert res.exit_code == 2 and shard.name in res.output and res.stdout.strip() == ""


def test_export_import_json(work, tmp_path):
    d, state = work
    exp = _json(runner.invoke(app, ["export-bitmask", str(d / "pruned"), "-o", str(tmp_path / "ct"), "--json"]))
    assert exp["compressed_weights"] == 14
    imp = _json(runner.invoke(app, ["import-bitmask", str(tmp_path / "ct"), "-o", str(tmp_path / "back"), "--json"]))
    assert imp["decompressed_weights"] == 14
    from safetensors.torch import load_file

    back = load_file(tmp_path / "back" / "model.safetensors")
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_pruner_output_is_encoded(tmp_path):
    """The contract with `sparsekit prune`: its sparsekit.json "layers" (incl. GPT-2 conv1d) drive encode."""
    from tiny_models import save_tiny

    from sparsekit.pruning.api import prune

    save_tiny("gpt2", tmp_path / "tiny")
    prune(str(tmp_path / "tiny"), method="magnitude", sparsity=0.5, pattern="2:4",
          output=str(tmp_path / "pruned"), warn=lambda *a: None)
    rep = _json(runner.invoke(app, ["encode", str(tmp_path / "pruned"), "-o", str(tmp_path / "packed"), "--json"]))
    assert rep["packed_layers"] == rep["layers"] == 12
    info = rep["per_layer"]["transformer.h.0.attn.c_attn"]
    assert info["transposed"] and info["pattern"] == "2:4" and info["shape"] == [192, 64]
    assert _json(runner.invoke(app, ["verify", str(tmp_path / "packed"), "--json"]))["ok"]
    shutil.rmtree(tmp_path / "tiny")
