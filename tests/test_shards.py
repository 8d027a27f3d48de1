"""Shards, the index, read_packed, verify and inspect; corruption gives one clear error."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparsekit.packed import shards as sh
from sparsekit.errors import SparsekitError
from sparsekit.packed.encoding import encode
from sparsekit.packed.verify import inspect_packed, verify_packed

from test_packing import make_pruned


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    make_pruned(root / "pruned", layer_sparsity={"k_proj": 0.1})
    encode(root / "pruned", root / "packed", max_shard_size="80KB")
    return root / "packed"


@pytest.fixture
def copy(packed, tmp_path) -> Path:
    dst = tmp_path / "packed"
    shutil.copytree(packed, dst)
    return dst


def index_of(path: Path) -> dict:
    return json.loads((path / sh.INDEX_NAME).read_text())


@pytest.mark.parametrize("text,expect", [("2GB", 2 * 10**9), ("500MB", 5 * 10**8), ("1GiB", 2**30),
                                         ("1.5kb", 1500), ("1024", 1024), (77, 77)])
def test_parse_size(text, expect):
    assert sh.parse_size(text) == expect


@pytest.mark.parametrize("bad, message", [("two GB", "cannot read size 'two GB': write e.g. 2GB"),
                                          ("-1GB", "cannot read size '-1GB'"), ("5XB", "cannot read size '5XB'"),
                                          ("0", "shard size must be positive, got '0'")])
def test_parse_size_rejects(bad, message):
    with pytest.raises(SparsekitError, match=message):
        sh.parse_size(bad)


def test_shard_writer_respects_max_size(tmp_path):
    writer = sh.ShardWriter(tmp_path, max_bytes=1000, file_metadata={"format": "tcabme", "format_version": "1"})
    groups = [{f"t{i}.a": torch.zeros(100, dtype=torch.int16), f"t{i}.b": torch.ones(100, dtype=torch.int16)}
              for i in range(7)]  # 400 bytes per group
    groups.append({"big": torch.zeros(1000, dtype=torch.int16)})  # larger than a shard: alone
    for g in groups:
        writer.add(g)
    weight_map, shards = writer.close()
    assert len(shards) == 5
    for name, info in shards.items():
        file = tmp_path / name
        assert info["bytes"] == file.stat().st_size and info["sha256"] == sh.file_sha256(file)
        tensors = load_file(file)
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 1000 or set(tensors) == {"big"}
    for g in groups:  # a group stays in one shard
        assert len({weight_map[n] for n in g}) == 1
    assert not list(tmp_path.glob(".*part"))


def test_index_and_metadata(packed):
    index = index_of(packed)
    meta = index["metadata"]
    assert meta["format"] == "tcabme" and meta["format_version"] == 1
    assert meta["sparsekit_version"] and meta["source_model"]
    assert len(index["shards"]) > 1
    assert all(len(i["sha256"]) == 64 for i in index["shards"].values())
    assert set(index["weight_map"]) == set(index["checksums"])
    names = set(index["weight_map"])
    for module, info in index["layers"].items():
        if info["packed"]:
            assert {f"{module}.tcabme.{f}" for f in ("bitmaps", "values", "gtile_offsets", "strip_offsets", "shape")} <= names
        else:
            assert info["weight"] in names and "kept dense" in info["reason"]
        assert {"sparsity", "pattern", "shape", "transposed", "dense_bytes", "stored_bytes"} <= set(info)


def test_read_packed_device_and_layers(packed):
    ck = sh.read_packed(packed, device="cpu")
    assert ck.metadata["format"] == "tcabme"
    assert all(p.bitmaps.dtype == torch.uint64 for p in ck.packed.values())
    assert {m for m, i in ck.layers.items() if not i["packed"]} == {m for m in ck.layers if m.endswith("k_proj")}
    assert "model.embed_tokens.weight" in ck.dense and "lm_head.weight" in ck.dense


def test_verify_ok(packed):
    report = verify_packed(packed)
    assert report["ok"] and report["shards"] > 1 and report["packed_layers"] == 12


def test_inspect_totals(packed):
    rep = inspect_packed(packed)
    rows = rep["layers"]
    assert len(rows) == 14
    assert [r["layer"] for r in rows][:2] == ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj"]
    for r in rows:
        assert r["ratio"] == pytest.approx(r["packed_bytes"] / r["dense_bytes"])
        if r["packed"]:
            p_shape = r["shape"]
            assert r["dense_bytes"] == p_shape[0] * p_shape[1] * 2
    tot = rep["totals"]
    assert tot["dense_bytes"] == sum(r["dense_bytes"] for r in rows)
    assert tot["packed_bytes"] == sum(r["packed_bytes"] for r in rows)
    assert tot["packed_layers"] == 12
    assert tot["checkpoint_bytes"] == tot["packed_bytes"] + tot["other_bytes"]


def _shard_holding(path: Path, tensor: str) -> Path:
    return path / index_of(path)["weight_map"][tensor]


def _flip_tensor_byte(file: Path, tensor: str, at: int = 0) -> None:
    header, start = sh.read_header(file)
    lo, _ = header[tensor]["data_offsets"]
    data = bytearray(file.read_bytes())
    data[start + lo + at] ^= 0x40
    file.write_bytes(bytes(data))


VALUES = "model.layers.1.mlp.up_proj.tcabme.values"


def test_flipped_byte_names_shard_and_tensor(copy):
    file = _shard_holding(copy, VALUES)
    _flip_tensor_byte(file, VALUES, at=3)
    with pytest.raises(SparsekitError, match=rf"{file.name}.*{VALUES}.*sha256"):
        verify_packed(copy)


def test_loading_a_flipped_byte_is_a_clear_error(copy):
    """read_packed (and so load_packed / eval) must not hand back silently wrong weights."""
    file = _shard_holding(copy, VALUES)
    _flip_tensor_byte(file, VALUES, at=3)
    with pytest.raises(SparsekitError, match=rf"corrupt shard {file.name}, tensor {VALUES}: sha256"):
        sh.read_packed(copy)
    assert VALUES.rsplit(".tcabme", 1)[0] in sh.read_packed(copy, check_checksums=False).packed


def test_truncated_shard(copy):
    file = _shard_holding(copy, VALUES)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(SparsekitError, match=rf"{file.name}.*truncated"):
        verify_packed(copy)
    with pytest.raises(SparsekitError, match=rf"{file.name}.*truncated"):
        sh.read_packed(copy)


def test_wrong_version(copy):
    index = index_of(copy)
    index["metadata"]["format_version"] = 2
    (copy / sh.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(SparsekitError, match="version 2 is not supported"):
        verify_packed(copy)
    with pytest.raises(SparsekitError, match="version"):
        sh.read_packed(copy)


def test_missing_index_entry(copy):
    index = index_of(copy)
    name = "model.layers.0.self_attn.q_proj.tcabme.bitmaps"
    del index["weight_map"][name]
    (copy / sh.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(SparsekitError, match=rf"{name}.*missing"):
        verify_packed(copy)
    with pytest.raises(SparsekitError, match=name):
        sh.read_packed(copy)


def test_missing_shard_and_not_packed(copy, tmp_path):
    file = _shard_holding(copy, VALUES)
    file.unlink()
    with pytest.raises(SparsekitError, match=rf"{file.name}.*missing"):
        verify_packed(copy)
    with pytest.raises(SparsekitError, match="not a TCA-BME checkpoint"):
        verify_packed(tmp_path)


def _rewrite(copy: Path, tensor: str, mutate) -> str:
    """Change one tensor and re-sign the shard (valid checksums), so that only structure is wrong."""
    index = index_of(copy)
    shard = index["weight_map"][tensor]
    file = copy / shard
    tensors = load_file(file)
    tensors[tensor] = mutate(tensors[tensor].clone())
    save_file(tensors, str(file), metadata={"format": "tcabme", "format_version": "1"})
    index["shards"][shard] = {"bytes": file.stat().st_size, "sha256": sh.file_sha256(file)}
    index["checksums"][tensor] = sh.tensor_sha256(tensors[tensor])
    (copy / sh.INDEX_NAME).write_text(json.dumps(index))
    return shard


@pytest.mark.parametrize("field,mutate,what", [
    ("gtile_offsets", lambda t: torch.cat([t[:1], t[1:] + 8]), "offsets end at"),
    ("gtile_offsets", lambda t: t.index_put_((torch.tensor([1]),), torch.tensor([3], dtype=t.dtype)), "multiples of 8|monotone|popcount"),
    ("bitmaps", lambda t: t.view(torch.int64).bitwise_xor_(1).view(torch.uint64), "popcount"),
    ("strip_offsets", lambda t: t.index_put_((torch.tensor([1]),), t[1] + 1), "strip offsets"),
    ("shape", lambda t: t + 64, "bitmaps|index says"),
])
def test_structure_errors_name_the_tensor(copy, field, mutate, what):
    tensor = f"model.layers.1.mlp.up_proj.tcabme.{field}"
    shard = _rewrite(copy, tensor, mutate)
    with pytest.raises(SparsekitError, match=rf"{shard}.*model\.layers\.1\.mlp\.up_proj\.tcabme\.\w+.*({what})"):
        verify_packed(copy)


def test_size_formula_from_files(packed):
    """Stored bytes of each packed layer = 4(NGT+1) + 8 NBT + 2 NNZ + 2 PAD + 16 NGT + 16."""
    ck = sh.read_packed(packed)
    for module, p in ck.packed.items():
        ngt = p.ngt
        pad = p.values.numel() - p.nnz
        assert 0 <= pad < 8 * ngt
        expect = 4 * (ngt + 1) + 8 * 64 * ngt + 2 * p.nnz + 2 * pad + 16 * ngt + 16
        assert ck.layers[module]["stored_bytes"] == expect == p.nbytes


def test_damaged_header_entry_names_shard_and_tensor(copy):
    """A flipped byte inside a shard's JSON header (here a key name) is one clear error, not a KeyError."""
    file = _shard_holding(copy, VALUES)
    data = bytearray(file.read_bytes())
    n = int.from_bytes(data[:8], "little")
    at = 8 + bytes(data[8:8 + n]).index(b'"data_offsets"') + 1
    data[at] ^= 0x20   # "data_offsets" -> "Data_offsets"
    file.write_bytes(bytes(data))
    for check in (verify_packed, sh.read_packed, inspect_packed):
        with pytest.raises(SparsekitError, match=rf"{file.name}.*tensor .*damaged"):
            check(copy)


@pytest.fixture
def remembering(monkeypatch, tmp_path):
    """Loads may skip shards that passed before (conftest turns that off for every other test), with a cache of
    this test's own and no settling time, so a shard read now can be remembered now."""
    from sparsekit.packed import trusted

    monkeypatch.delenv("SPARSEKIT_REHASH", raising=False)
    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(trusted, "SETTLE_S", 0.0)
    hashed = []
    real = sh.tensor_sha256
    monkeypatch.setattr(sh, "tensor_sha256", lambda t: hashed.append(1) or real(t))
    return hashed


def test_a_shard_that_passed_is_not_hashed_again_until_it_changes(copy, remembering):
    hashed = remembering
    sh.read_packed(copy)
    first = len(hashed)
    assert first == sum(1 for _ in index_of(copy)["checksums"])   # every tensor hashed once
    sh.read_packed(copy)
    assert len(hashed) == first                                    # nothing hashed: every shard passed before
    time.sleep(0.05)                                               # past the file system's time granularity
    file = _shard_holding(copy, VALUES)
    _flip_tensor_byte(file, VALUES, at=3)                          # same size, new times
    with pytest.raises(SparsekitError, match=rf"corrupt shard {file.name}, tensor {VALUES}: sha256"):
        sh.read_packed(copy)
    assert len(hashed) > first


def test_a_shard_is_hashed_again_under_rehash_or_when_just_written(copy, remembering, monkeypatch):
    from sparsekit.packed import trusted

    hashed = remembering
    sh.read_packed(copy)
    n = len(hashed)
    sh.read_packed(copy, rehash=True)
    assert len(hashed) == 2 * n
    monkeypatch.setenv("SPARSEKIT_REHASH", "1")
    sh.read_packed(copy)
    assert len(hashed) == 3 * n
    monkeypatch.delenv("SPARSEKIT_REHASH")
    other = copy.parent / "fresh"
    shutil.copytree(copy, other)                                   # another path, other inodes: never passed
    monkeypatch.setattr(trusted, "SETTLE_S", 60.0)                 # written just now: not remembered
    sh.read_packed(other)
    sh.read_packed(other)
    assert len(hashed) == 5 * n
