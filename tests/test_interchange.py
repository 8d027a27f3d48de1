"""compressed-tensors sparse-bitmask interchange: layout, round trip, and the package's own decompressor."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from sparsekit.errors import SparsekitError
from sparsekit.packed.interchange import bitmask_compress, bitmask_decompress, export_bitmask, import_bitmask
from sparsekit.packed.encoding import encode

from test_packing import make_pruned


def load_dir(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8) if a[k].dim() else a[k], b[k].view(torch.uint8) if b[k].dim() else b[k]) for k in a)


def test_layout_hand_checked():
    w = torch.zeros(2, 10, dtype=torch.float16)
    w[0, 0], w[0, 9], w[1, 3], w[1, 8] = 1.0, 2.0, 3.0, -0.0
    parts = bitmask_compress(w)
    assert parts["shape"].tolist() == [2, 10] and parts["shape"].dtype == torch.int64
    assert parts["compressed"].tolist() == [1.0, 2.0, 3.0, -0.0]
    assert torch.signbit(parts["compressed"][3])  # -0.0 is kept: bit-exact
    # bitorder little: column c of a row -> bit c % 8 of byte c // 8
    assert parts["bitmask"].dtype == torch.uint8
    assert parts["bitmask"].tolist() == [[0b00000001, 0b00000010], [0b00001000, 0b00000001]]
    assert parts["row_offsets"].tolist() == [0, 2]
    assert torch.equal(bitmask_decompress(parts).view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_compress_round_trip_random(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 70, generator=g).to(dtype)
    w[torch.rand(37, 70, generator=g) < 0.6] = 0
    parts = bitmask_compress(w)
    assert parts["bitmask"].shape == (37, 9)
    assert parts["compressed"].numel() == int((w != 0).sum())
    assert torch.equal(bitmask_decompress(parts), w)


def test_decompress_detects_inconsistency():
    w = torch.eye(8, dtype=torch.float16)
    parts = bitmask_compress(w)
    parts["compressed"] = parts["compressed"][:-1]
    with pytest.raises(SparsekitError, match="bitmask marks"):
        bitmask_decompress(parts, "x")
    parts = bitmask_compress(w)
    parts["row_offsets"] = parts["row_offsets"] + 1
    with pytest.raises(SparsekitError, match="row_offsets"):
        bitmask_decompress(parts, "x")


@pytest.fixture(scope="module")
def pruned(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("ic")
    state = make_pruned(root / "pruned", arch="gpt2")
    return root / "pruned", state


@pytest.mark.parametrize("from_packed", [False, True])
def test_export_import_round_trip(pruned, tmp_path, from_packed):
    src, state = pruned
    if from_packed:
        encode(src, tmp_path / "packed")
        src = tmp_path / "packed"
    rep = export_bitmask(src, tmp_path / "ct", max_shard_size="150KB")
    assert rep["compressed_weights"] == 8 and rep["shards"] > 1
    assert (tmp_path / "ct" / "model.safetensors.index.json").is_file()
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())
    sc = cfg["quantization_config"]["sparsity_config"]
    assert sc["format"] == "sparse-bitmask" and abs(sc["global_sparsity"] - 0.5) < 0.01
    stored = load_dir(tmp_path / "ct")
    w = state["transformer.h.0.mlp.c_fc.weight"]  # Conv1D: compressed in its stored [in, out] layout
    assert stored["transformer.h.0.mlp.c_fc.shape"].tolist() == list(w.shape)
    assert "transformer.h.0.mlp.c_fc.weight" not in stored
    assert torch.equal(stored["transformer.wte.weight"], state["transformer.wte.weight"])
    import_bitmask(tmp_path / "ct", tmp_path / "back")
    back = load_dir(tmp_path / "back")
    assert same(back, state)
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())


def test_compressed_tensors_decompresses_our_export(pruned, tmp_path):
    pytest.importorskip("compressed_tensors")
    try:
        from compressed_tensors.compressors import ModelCompressor
    except ImportError:
        pytest.skip("this compressed-tensors version has no ModelCompressor")
    src, state = pruned
    export_bitmask(src, tmp_path / "ct")
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())
    compressor = ModelCompressor.from_compression_config(cfg["quantization_config"])
    if compressor is None or getattr(compressor, "sparsity_compressor", None) is None:
        pytest.skip("this compressed-tensors version cannot decompress sparse-bitmask")
    dense = dict(compressor.sparsity_compressor.decompress(str(tmp_path / "ct")))
    assert same(dense, state)


def test_import_rejects_other_formats(pruned, tmp_path):
    src, _ = pruned
    with pytest.raises(SparsekitError, match="not a sparse-bitmask checkpoint"):
        import_bitmask(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    export_bitmask(src, tmp_path / "ct")
    f = tmp_path / "ct" / "model.safetensors"
    t = load_file(f)
    del t["transformer.h.1.attn.c_proj.bitmask"]
    save_file(t, str(f))
    with pytest.raises(SparsekitError, match=r"transformer\.h\.1\.attn\.c_proj lacks .*bitmask"):
        import_bitmask(tmp_path / "ct", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp*"))


def test_encode_and_export_refuse_a_bitmask_checkpoint(pruned, tmp_path):
    """A sparse-bitmask dir has no dense weights: encode/export say to import it first."""
    src, _ = pruned
    export_bitmask(src, tmp_path / "ct")
    for fn in (encode, export_bitmask):
        with pytest.raises(SparsekitError, match="sparse-bitmask checkpoint: run `sparsekit import-bitmask"):
            fn(tmp_path / "ct", tmp_path / "out")
        assert not (tmp_path / "out").exists()
