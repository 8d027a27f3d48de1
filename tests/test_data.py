"""Calibration windows and evaluation text: formats, determinism, shapes, clear errors."""
from __future__ import annotations

import json

import pytest
import torch

from sparsekit.hf import data
from sparsekit.errors import SparsekitError
from tiny_models import corpus, make_model, make_tokenizer

ROWS = [line for line in corpus(n_words=3000, seed=2).splitlines()]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same rows as .txt (one per line, with blank lines in between), .jsonl and .parquet."""
    d = tmp_path_factory.mktemp("calib")
    txt = d / "rows.txt"
    txt.write_text("\n\n".join(ROWS) + "\n\n\n")
    jsonl = d / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({"text": r, "id": i}) + "\n" for i, r in enumerate(ROWS)))
    import datasets

    parquet = d / "rows.parquet"
    datasets.Dataset.from_dict({"text": ROWS}).to_parquet(str(parquet))
    return {"txt": txt, "jsonl": jsonl, "parquet": parquet}


def test_three_formats_give_the_same_text_and_windows(files, tok):
    want = "\n\n".join(ROWS)
    texts = {k: data.calibration_text(str(p)) for k, p in files.items()}
    assert all(t == want for t in texts.values())
    wins = {k: data.calibration_windows(str(p), tok, nsamples=6, seqlen=40, seed=1) for k, p in files.items()}
    assert torch.equal(wins["txt"], wins["jsonl"]) and torch.equal(wins["txt"], wins["parquet"])


def test_windows_are_seeded_slices_of_the_tokenized_text(files, tok):
    ids = tok(data.calibration_text(str(files["txt"])), return_tensors="pt").input_ids[0]
    a = data.calibration_windows(str(files["txt"]), tok, nsamples=8, seqlen=50, seed=0)
    b = data.calibration_windows(str(files["txt"]), tok, nsamples=8, seqlen=50, seed=0)
    c = data.calibration_windows(str(files["txt"]), tok, nsamples=8, seqlen=50, seed=1)
    assert a.shape == (8, 50) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    # every window is a contiguous run of the token stream
    unfolded = ids.unfold(0, 50, 1)
    for w in a:
        assert (unfolded == w).all(dim=1).any()


def test_short_text_is_a_clear_error(tmp_path, tok):
    short = tmp_path / "short.txt"
    short.write_text("only a few words here\n")
    n = len(tok("only a few words here").input_ids)
    with pytest.raises(SparsekitError, match=rf"only {n} tokens.*seqlen=2048"):
        data.calibration_windows(str(short), tok, nsamples=4, seqlen=2048)
    # exactly one window's worth is enough
    assert data.calibration_windows(str(short), tok, nsamples=3, seqlen=n).shape == (3, n)


def test_bad_sources_are_clear_errors(tmp_path, tok):
    with pytest.raises(SparsekitError, match="no file at"):
        data.calibration_windows(str(tmp_path / "missing.txt"), tok, nsamples=1, seqlen=8)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "x"}\n')
    with pytest.raises(SparsekitError, match='"text" field'):
        data.calibration_windows(str(bad), tok, nsamples=1, seqlen=8)
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    with pytest.raises(SparsekitError, match="unsupported file type"):
        data.calibration_windows(str(csv), tok, nsamples=1, seqlen=8)
    with pytest.raises(SparsekitError, match="nsamples"):
        data.calibration_windows("wikitext2", tok, nsamples=0, seqlen=8)


def test_unreadable_or_non_utf8_files_are_clear_errors(tmp_path, tok, monkeypatch):
    for name in ("latin1.txt", "latin1.jsonl"):
        f = tmp_path / name
        f.write_bytes(b'{"text": "caf\xe9"}\n')  # Latin-1, not UTF-8
        with pytest.raises(SparsekitError, match="not UTF-8"):
            data.calibration_windows(str(f), tok, nsamples=1, seqlen=8)
        with pytest.raises(SparsekitError, match="not UTF-8"):
            data.eval_text(str(f))
    f = tmp_path / "locked.txt"
    f.write_text("some text\n")

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(f), "read_text", denied)  # chmod 000 does not stop root
    with pytest.raises(SparsekitError, match="cannot read .*Permission denied"):
        data.calibration_windows(str(f), tok, nsamples=1, seqlen=8)


def test_corrupt_parquet_is_one_line(tmp_path, tok, capfd):
    f = tmp_path / "bad.parquet"
    f.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(SparsekitError, match="could not load dataset 'parquet'"):
        data.calibration_windows(str(f), tok, nsamples=1, seqlen=8)
    assert "Failed to read schema" not in capfd.readouterr().err  # datasets' own log line is silenced


def test_hub_alias_offline_says_so(tok, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(SparsekitError, match="offline"):
        data.calibration_windows("no-such-user/no-such-dataset", tok, nsamples=2, seqlen=16)


def test_eval_text_formats(tmp_path):
    txt = tmp_path / "e.txt"
    txt.write_text("\n\n = Title = \n\nbody\n")
    assert data.eval_text(str(txt)) == "\n\n = Title = \n\nbody\n"  # verbatim
    rows = ["", " = Title = \n", "", " body \n"]
    jl = tmp_path / "e.jsonl"
    jl.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    assert data.eval_text(str(jl)) == "\n\n".join(rows)  # rows joined, empty rows kept
    with pytest.raises(SparsekitError, match="calibration source"):
        data.eval_text("c4")


def test_cap_seqlen():
    model = make_model("gpt2")  # n_positions = 256
    assert data.cap_seqlen(model, 2048) == 256
    assert data.cap_seqlen(model, 128) == 128
    llama = make_model("llama")  # max_position_embeddings = 256
    assert data.cap_seqlen(llama, 4096) == 256


def test_real_wikitext_rows_join_to_the_eval_string(wikitext_dir):
    """The jsonl rows joined with blank lines are byte-identical to the reference evaluation string."""
    assert data.eval_text(str(wikitext_dir / "test.rows.jsonl")) == data.eval_text(str(wikitext_dir / "test.eval-string.txt"))
