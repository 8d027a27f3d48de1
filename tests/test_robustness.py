"""Issue 15 (parts 2 and 6): ``verify`` checks that a packed directory loads, the loader names
config and tokenizer problems as what they are, and small fixes. Each test failed before its fix.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.errors import SparsekitError

from tiny_models import save_tiny, write_corpus

runner = CliRunner()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny Llama, its magnitude-pruned checkpoint and that checkpoint packed."""
    from sparsekit.packed.encoding import encode
    from sparsekit.pruning.api import prune

    d = tmp_path_factory.mktemp("robust")
    save_tiny("llama", d / "base")
    write_corpus(d / "calib.txt")
    prune(str(d / "base"), method="magnitude", output=str(d / "pruned"), device="cpu", warn=lambda m: None)
    encode(d / "pruned", d / "packed")
    return d


def _copy(dirs: Path, name: str, src: str = "packed") -> Path:
    out = dirs / name
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(dirs / src, out)
    return out


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------- part 2: verify = loadable
def _no_config(p: Path) -> None:
    (p / "config.json").unlink()


def _broken_json(p: Path) -> None:
    (p / "config.json").write_text('{"model_type": "llama",\n')


def _unknown_model_type(p: Path) -> None:
    cfg = json.loads((p / "config.json").read_text())
    (p / "config.json").write_text(json.dumps({**cfg, "model_type": "no-such-architecture"}))


def _config_of_another_size(p: Path) -> None:
    cfg = json.loads((p / "config.json").read_text())
    (p / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] // 2}))


def _no_tokenizer(p: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (p / f).unlink()


@pytest.mark.parametrize("damage, message", [
    (_no_config, r"has no config\.json"),
    (_broken_json, r"config\.json is not valid JSON"),
    (_unknown_model_type, r"config\.json is not a model config transformers can read"),
    (_config_of_another_size, r"packed layer model\.layers\.0\.mlp\.\w+_proj is \d+x\d+, the model of config\.json expects"),
    (_no_tokenizer, r"has no tokenizer files \(none of tokenizer\.json, tokenizer\.model"),
])
def test_verify_refuses_a_directory_that_cannot_load(dirs, damage, message):
    """verify said ok on a packed directory that eval could not load."""
    from sparsekit.packed.verify import verify_packed

    p = _copy(dirs, f"bad-{damage.__name__}")
    damage(p)
    with pytest.raises(SparsekitError, match=message):
        verify_packed(p)
    res = runner.invoke(app, ["verify", str(p)])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "ok" not in res.stdout


def test_verify_still_passes_a_good_directory(dirs):
    from sparsekit.packed.verify import verify_packed

    assert verify_packed(dirs / "packed")["ok"]


def test_missing_tokenizer_is_named_not_sentencepiece(dirs):
    """A packed directory without tokenizer files was reported as 'install sentencepiece or tiktoken'."""
    from sparsekit.runtime.loader import load

    p = _copy(dirs, "no-tokenizer")
    _no_tokenizer(p)
    with pytest.raises(SparsekitError, match=r"has no tokenizer files") as err:
        load(str(p), device="cpu")
    assert "install" not in str(err.value) and "\n" not in str(err.value)
    q = _copy(dirs, "no-tokenizer-pruned", src="pruned")
    _no_tokenizer(q)
    from sparsekit.hf.models import load_tokenizer

    with pytest.raises(SparsekitError, match=r"has no tokenizer files"):
        load_tokenizer(str(q))


def test_bad_config_is_a_config_problem_not_a_tokenizer_one(dirs):
    """An invalid config.json was reported as 'could not load a tokenizer'."""
    from sparsekit.runtime.loader import load, load_packed

    p = _copy(dirs, "broken-config")
    _broken_json(p)
    for call in (lambda: load(str(p), device="cpu"), lambda: load_packed(p, device="cpu")):
        with pytest.raises(SparsekitError, match=r"config\.json is not valid JSON") as err:
            call()
        assert "tokenizer" not in str(err.value)
    res = runner.invoke(app, ["eval", str(p), "--dataset", str(dirs / "calib.txt"), "--seqlen", "32", "--device", "cpu"])
    assert res.exit_code == 2 and "config.json is not valid JSON" in res.stderr and "tokenizer" not in res.stderr


# ----------------------------------------------------------------------------- part 6
def test_format_version_read_in_either_spelling(dirs):
    """The shards store format_version as the string "1", the index as the number 1: an index with
    "1" was refused with "version '1' is not supported (this sparsekit reads version 1)"."""
    from sparsekit.packed.shards import load_index, read_packed
    from sparsekit.packed.verify import verify_packed

    p = _copy(dirs, "string-version")
    index = json.loads((p / "tcabme.index.json").read_text())
    index["metadata"]["format_version"] = "1"
    (p / "tcabme.index.json").write_text(json.dumps(index))
    assert load_index(p)["metadata"]["format_version"] == "1"
    assert read_packed(p).packed
    assert verify_packed(p)["ok"]
    index["metadata"]["format_version"] = 2
    (p / "tcabme.index.json").write_text(json.dumps(index))
    with pytest.raises(SparsekitError, match=r"version 2 is not supported \(this sparsekit reads version 1\)"):
        load_index(p)


def test_pruned_files_follow_the_umask(dirs):
    """model.safetensors was written 0600 while every other file was 0644."""
    want = 0o666 & ~_current_umask()
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (dirs / "pruned").iterdir()}
    assert "model.safetensors" in modes
    assert modes == {name: want for name in modes}


def test_prune_lm_head_on_a_tied_head_says_drop_the_flag(tmp_path):
    """The message said 'add it to --skip'; the fix is to drop --prune-lm-head."""
    from sparsekit.pruning.api import prune

    save_tiny("gpt2", tmp_path / "gpt2")  # GPT-2 ties lm_head to the token embeddings
    with pytest.raises(SparsekitError, match=r"lm_head is tied to the input embeddings.*: drop --prune-lm-head$"):
        prune(str(tmp_path / "gpt2"), method="magnitude", prune_lm_head=True, device="cpu",
              output=str(tmp_path / "out"), warn=lambda m: None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_no_gpu_message_of_the_library_names_the_argument(dirs):
    """load_packed(device="cuda") told a Python caller to 'use --device cpu'."""
    from sparsekit.runtime.loader import load_packed

    with pytest.raises(SparsekitError, match=r'no CUDA GPU found: use device="cpu"'):
        load_packed(dirs / "packed", device="cuda")


def test_no_gpu_notice_points_at_the_caller_not_torch(dirs, monkeypatch):
    """The notice was attributed to torch/nn/modules/module.py (and printed its source line)."""
    from sparsekit.runtime import sparse_linear
    from sparsekit.runtime.loader import load_packed

    monkeypatch.setattr(sparse_linear, "notices_shown", set())
    model = load_packed(dirs / "packed", device="cpu", dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.tensor([[1, 2, 3]]))
    notes = [w for w in caught if "reference path" in str(w.message)]
    assert len(notes) == 1 and notes[0].filename == __file__


def test_inspect_says_checksums_were_not_checked(dirs):
    """inspect passed a shard with a flipped data byte silently."""
    from sparsekit.packed.shards import read_header

    p = _copy(dirs, "flipped")
    shard = next(p.glob("tcabme-*.safetensors"))
    _, start = read_header(shard)
    data = bytearray(shard.read_bytes())
    data[start + 100] ^= 0xFF
    shard.write_bytes(bytes(data))
    res = runner.invoke(app, ["inspect", str(p), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["checksums_verified"] is False
    res = runner.invoke(app, ["inspect", str(p)])
    assert res.exit_code == 0 and "checksums not checked: run `sparsekit verify`" in res.stdout
    res = runner.invoke(app, ["verify", str(p)])
    assert res.exit_code == 2 and "sha256 mismatch" in res.stderr


def test_seqlen_minimum_is_the_same_for_prune_and_eval(dirs):
    """prune refused seqlen below 8, eval accepted down to 2 (and checked only after loading)."""
    from sparsekit.evaluation.ppl import perplexity_report
    from sparsekit.pruning.recipes import resolve_settings

    with pytest.raises(SparsekitError) as pruned:
        resolve_settings(seqlen=4)
    with pytest.raises(SparsekitError) as evaluated:  # refused before the (missing) model is looked up
        perplexity_report(str(dirs / "no-such-model"), dataset=str(dirs / "calib.txt"), seqlen=4, max_windows=1,
                          device="cpu")
    assert str(pruned.value) == str(evaluated.value) == "seqlen must be at least 8, got 4"
    res = runner.invoke(app, ["eval", str(dirs / "pruned"), "--dataset", str(dirs / "calib.txt"), "--seqlen", "4",
                              "--device", "cpu"])
    assert res.exit_code == 2 and "seqlen must be at least 8" in res.stderr


def test_magnitude_says_calibration_flags_are_ignored(dirs, tmp_path):
    """magnitude silently ignored --calib/--nsamples."""
    from sparsekit.pruning.api import prune

    notes: list[str] = []
    prune(str(dirs / "base"), method="magnitude", calib=str(dirs / "calib.txt"), nsamples=4, device="cpu",
          output=str(tmp_path / "m"), warn=notes.append)
    assert [n for n in notes if "ignored" in n] == ["method magnitude uses no calibration data: calib, nsamples are ignored"]
    notes.clear()
    prune(str(dirs / "base"), method="magnitude", device="cpu", output=str(tmp_path / "m2"), warn=notes.append)
    assert not [n for n in notes if "ignored" in n]  # nothing given, nothing said
    res = runner.invoke(app, ["prune", str(dirs / "base"), "--method", "magnitude", "--seqlen", "64",
                              "--device", "cpu", "-o", str(tmp_path / "m3")])
    assert res.exit_code == 0, res.output
    assert "seqlen is ignored" in res.stderr


def test_cli_shows_the_no_gpu_notice_as_one_line(dirs, monkeypatch):
    """The CLI printed the notice with a line of torch internals (module.py, return forward_call(...))."""
    from sparsekit.runtime import sparse_linear

    monkeypatch.setattr(sparse_linear, "notices_shown", set())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(app, ["eval", str(dirs / "packed"), "--dataset", str(dirs / "calib.txt"), "--seqlen", "32",
                              "--max-windows", "1", "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    lines = [l for l in res.stderr.splitlines() if "reference path" in l]
    assert lines == [f"warning: {sparse_linear.NO_GPU_NOTICE}"]
    assert "module.py" not in res.stderr and "forward_call" not in res.stderr and "SparsekitWarning" not in res.stderr
