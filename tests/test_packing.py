"""sparsekit.packed.encoding.encode: which tensors are packed, per-layer choice, casting, bad input, demo model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparsekit.errors import SparsekitError
from sparsekit.packed.encoding import encode
from sparsekit.packed.shards import INDEX_NAME, read_packed
from sparsekit.packed.tcabme import decode
from sparsekit.packed.verify import verify_packed


def make_pruned(path: Path, arch: str = "llama", dtype=torch.float16, sparsity: float = 0.5,
                layer_sparsity: dict[str, float] | None = None, seed: int = 0, **save_kw) -> dict[str, torch.Tensor]:
    """A tiny randomly initialised causal LM, magnitude-pruned per linear layer, saved with save_pretrained.

    Dimensions (96, 160) are deliberately not multiples of 64. Returns the saved state dict.
    """
    import transformers as T

    from sparsekit.hf.modules import find_decoder_layers, find_linears, set_weight_out_in, weight_out_in

    torch.manual_seed(seed)
    if arch == "llama":
        cfg = T.LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    else:
        cfg = T.GPT2Config(vocab_size=128, n_embd=96, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = T.AutoModelForCausalLM.from_config(cfg).to(dtype)
    prefix, blocks = find_decoder_layers(model)
    for name, mod in find_linears(blocks, prefix=prefix).items():
        s = (layer_sparsity or {}).get(name.split(".")[-1], sparsity)
        w = weight_out_in(mod).float()
        k = int(s * w.numel())
        if k:
            thr = w.abs().flatten().kthvalue(k).values
            w = torch.where(w.abs() > thr, w, torch.zeros(()))
        set_weight_out_in(mod, w)
    model.config.torch_dtype = dtype
    model.save_pretrained(path, **save_kw)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (path / "tokenizer.json").write_text("{}")
    state = {}
    for f in path.glob("*.safetensors"):
        state.update(load_file(f))
    return state


def bits(x):
    return x.contiguous().view(torch.int16)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_encode_round_trip_and_layout(tmp_path, arch):
    src, out = tmp_path / "pruned", tmp_path / "packed"
    state = make_pruned(src, arch)
    report = encode(src, out)
    n_linear = 14 if arch == "llama" else 8
    assert report["layers"] == report["packed_layers"] == n_linear
    ck = read_packed(out)
    assert set(ck.packed) == set(report["per_layer"])
    for module, p in ck.packed.items():
        info = ck.layers[module]
        w = state[f"{module}.weight"]
        assert info["transposed"] == (arch == "gpt2")
        expect = w.t() if info["transposed"] else w
        assert list(p.shape) == info["shape"] == list(expect.shape)
        assert torch.equal(bits(decode(p)), bits(expect))
        assert abs(info["sparsity"] - 0.5) < 0.01
        assert info["stored_bytes"] == p.nbytes
    # everything else stored as it is, under its usual name
    packed_names = {f"{m}.weight" for m in ck.packed}
    assert set(ck.dense) == set(state) - packed_names
    for k, t in ck.dense.items():
        assert torch.equal(t, state[k])
    # self-contained: config and tokenizer files came along
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).is_file()
    meta = json.loads((out / INDEX_NAME).read_text())["metadata"]
    assert meta["format"] == "tcabme" and meta["format_version"] == 1 and meta["sparsekit_version"]
    verify_packed(out)


def test_min_sparsity_and_force(tmp_path):
    src = tmp_path / "pruned"
    state = make_pruned(src, layer_sparsity={"q_proj": 0.1, "k_proj": 0.0})
    report = encode(src, tmp_path / "a")
    layers = report["per_layer"]
    dense = {m for m, i in layers.items() if not i["packed"]}
    assert dense == {m for m in layers if m.endswith(("q_proj", "k_proj"))}
    for m in dense:
        assert "kept dense" in layers[m]["reason"]
        assert layers[m]["stored_bytes"] == layers[m]["dense_bytes"]
    ck = read_packed(tmp_path / "a")
    for m in dense:  # a dense layer is stored as it is
        assert torch.equal(ck.dense[f"{m}.weight"], state[f"{m}.weight"])
    forced = encode(src, tmp_path / "b", force=True)
    assert forced["packed_layers"] == forced["layers"]
    assert all("forced" in forced["per_layer"][m]["reason"] for m in dense)
    none = encode(src, tmp_path / "c", min_sparsity=0.9)
    assert none["packed_layers"] == 0


def test_fp32_is_cast_and_recorded(tmp_path):
    src = tmp_path / "pruned"
    state = make_pruned(src, dtype=torch.float32)
    report = encode(src, tmp_path / "out")
    assert report["cast_from"] == "float32" and report["dtype"] == "float16"
    ck = read_packed(tmp_path / "out")
    m = "model.layers.1.mlp.down_proj"
    assert ck.packed[m].values.dtype == torch.float16
    assert torch.equal(decode(ck.packed[m]), state[f"{m}.weight"].half())
    assert ck.metadata["cast_from"] == "float32"


def test_bf16_and_sharded_input_and_output(tmp_path):
    src = tmp_path / "pruned"
    state = make_pruned(src, dtype=torch.bfloat16, max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").is_file()
    report = encode(src, tmp_path / "out", max_shard_size="60KB")
    assert report["shards"] > 1
    index = json.loads((tmp_path / "out" / INDEX_NAME).read_text())
    for shard, info in index["shards"].items():
        assert (tmp_path / "out" / shard).stat().st_size == info["bytes"]
    ck = read_packed(tmp_path / "out")
    for m, p in ck.packed.items():
        assert p.values.dtype == torch.bfloat16
        assert torch.equal(bits(decode(p)), bits(state[f"{m}.weight"]))


def test_sparsekit_json_layers_are_authoritative(tmp_path):
    src = tmp_path / "pruned"
    make_pruned(src)
    (src / "sparsekit.json").write_text(json.dumps({
        "model": "tiny", "pattern": "unstructured",
        "layers": {"model.layers.0.mlp.up_proj": {"sparsity": 0.5, "shape": [160, 96], "kind": "linear"}},
    }))
    report = encode(src, tmp_path / "out")
    assert list(report["per_layer"]) == ["model.layers.0.mlp.up_proj"]
    assert (tmp_path / "out" / "sparsekit.json").is_file()
    assert json.loads((tmp_path / "out" / INDEX_NAME).read_text())["metadata"]["source_model"] == "tiny"


def _no_leftovers(parent: Path, name: str) -> bool:
    return not any(p.name == name or p.name.startswith(f".{name}.tmp") for p in parent.iterdir())


def test_bad_inputs_one_clear_error_no_partial_output(tmp_path):
    src = tmp_path / "pruned"
    state = make_pruned(src)
    out = tmp_path / "out"
    # a "linear" layer whose weight is not 2-D
    (src / "sparsekit.json").write_text(json.dumps({"layers": {"model.norm": {"kind": "linear"}}}))
    with pytest.raises(SparsekitError, match="2-D"):
        encode(src, out)
    assert _no_leftovers(tmp_path, "out")
    # an unsupported dtype
    (src / "sparsekit.json").unlink()
    bad = dict(state)
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"].to(torch.int8)
    save_file(bad, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SparsekitError, match="unsupported dtype"):
        encode(src, out)
    assert _no_leftovers(tmp_path, "out")
    # missing input, existing output, already packed input
    with pytest.raises(SparsekitError, match="no pruned checkpoint"):
        encode(tmp_path / "nope", out)
    out.mkdir()
    with pytest.raises(SparsekitError, match="already exists"):
        encode(src, out)
    with pytest.raises(SparsekitError, match="min-sparsity"):
        encode(src, tmp_path / "x", min_sparsity=1.5)


def test_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    src = tmp_path / "pruned"
    make_pruned(src)
    from sparsekit.packed import tcabme

    calls = {"n": 0}
    real = tcabme.encode

    def flaky(w):
        calls["n"] += 1
        if calls["n"] == 5:
            raise SparsekitError("boom: simulated failure")
        return real(w)

    monkeypatch.setattr(tcabme, "encode", flaky)
    with pytest.raises(SparsekitError, match="boom"):
        encode(src, tmp_path / "out")
    assert _no_leftovers(tmp_path, "out")


@pytest.mark.slow
def test_demo_model_50_percent_unstructured(tmp_path):
    """Real SmolLM2-135M weights, magnitude-pruned to 50% per layer: packed linear bytes <= 0.58x dense."""
    pytest.importorskip("gguf")
    from sparsekit.hf.models import resolve_model

    try:
        demo = Path(resolve_model("smollm2-135m"))
    except SparsekitError as e:
        pytest.skip(f"demo model unavailable: {e}")
    import shutil

    from sparsekit.packed.encoding import checkpoint_files, linear_modules, load_json, resolve_key

    src = tmp_path / "pruned"
    src.mkdir()
    files = checkpoint_files(demo)
    state = {}
    for f in set(files.values()):
        state.update(load_file(f))
    modules = linear_modules(demo, load_json(demo / "config.json"), {})
    assert len(modules) == 30 * 7
    import numpy as np

    for m in modules:  # magnitude pruning, 50% of each layer
        key = resolve_key(m, state)
        a = state[key].numpy()  # float16
        mag = np.abs(a).reshape(-1)
        thr = np.partition(mag, mag.size // 2)[mag.size // 2]
        state[key] = torch.from_numpy(np.where(np.abs(a) >= thr, a, np.float16(0)))
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    for f in demo.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, src / f.name)
    report = encode(src, tmp_path / "packed")
    shutil.rmtree(src)   # 270 MB: the suite's disk footprint stays small
    assert report["packed_layers"] == report["layers"] == 210
    assert report["linear_stored_bytes"] <= 0.58 * report["linear_dense_bytes"], report["ratio"]
    verify_packed(tmp_path / "packed")
    ck = read_packed(tmp_path / "packed")
    for m in ("model.layers.0.self_attn.k_proj", "model.layers.29.mlp.down_proj"):
        assert torch.equal(bits(decode(ck.packed[m])), bits(state[f"{m}.weight"]))


def test_truncated_input_checkpoint(tmp_path):
    src = tmp_path / "pruned"
    make_pruned(src, max_shard_size="100KB")
    shard = sorted(src.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-50])
    with pytest.raises(SparsekitError, match=rf"{shard.name}.*(truncated|corrupt)"):
        encode(src, tmp_path / "out")
    assert _no_leftovers(tmp_path, "out")


def test_negative_zeros_from_mask_multiplication_count_as_pruned(tmp_path):
    """w * mask leaves -0.0 for negative pruned weights: the encoder must see them as zeros."""
    src, out = tmp_path / "pruned", tmp_path / "packed"
    state = make_pruned(src, "llama")
    name = "model.layers.0.mlp.up_proj.weight"
    w = state[name]
    mask = w != 0
    dense = torch.randn(w.shape, generator=torch.Generator().manual_seed(1)).to(w.dtype)
    masked = dense * mask                       # -0.0 wherever dense < 0 and pruned
    n_neg = int((bits(masked) == -32768).sum())
    assert n_neg > 0
    shard = next(src.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors[name] = masked
    save_file(tensors, shard, metadata={"format": "pt"})
    report = encode(src, out)
    info = report["per_layer"]["model.layers.0.mlp.up_proj"]
    assert info["packed"] and abs(info["sparsity"] - 0.5) < 0.01
    assert info["negative_zeros_cleared"] == n_neg
    got = decode(read_packed(out).packed["model.layers.0.mlp.up_proj"])
    assert torch.equal(got, masked)                      # equal as numbers (-0.0 == 0.0)
    assert int((bits(got) == -32768).sum()) == 0         # stored as plain zeros


def test_fp32_beyond_fp16_range_is_refused(tmp_path):
    """Casting would silently turn a weight above 65504 into inf: one clear error, no output."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "pruned"
    make_pruned(src, dtype=torch.float32)
    f = src / "model.safetensors"
    state = load_file(f)
    state["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e5
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(SparsekitError, match=r"model\.layers\.0\.mlp\.up_proj\.weight .*beyond the float16 range"):
        encode(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
