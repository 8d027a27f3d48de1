"""transformers loads a packed directory: ``from_pretrained`` (after ``import sparsekit``), the
pipeline, the static cache, lm-eval's ``hf`` model, ``save_pretrained``'s refusal, peft.

The reference is always ``sparsekit.load_packed`` on the same directory: the model from_pretrained
returns must have the same modules and the same tensors, bit for bit, and so the same logits.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.errors import SparsekitError
from tests import tiny_models
from tests.test_runtime import IDS, pruned_tiny, write_pruned

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """``{arch: packed directory}``: a Llama (untied head) and a GPT-2 (Conv1D, tied head); and a
    Llama pruned by Wanda 2:4 with CATS thresholds on top (``"cats"``)."""
    import sparsekit

    root = tmp_path_factory.mktemp("fp")
    out = {}
    for arch in ("llama", "gpt2"):
        write_pruned(pruned_tiny(arch), root / f"{arch}-pruned")
        sparsekit.encode(root / f"{arch}-pruned", root / arch)
        out[arch] = root / arch
    tiny_models.save_tiny("llama", root / "tiny")
    sparsekit.prune(str(root / "tiny"), method="wanda", pattern="2:4", cats=0.5, calib=str(
        tiny_models.write_corpus(root / "calib.txt")), nsamples=4, seqlen=32, device="cpu",
        output=root / "cats-pruned", warn=lambda m: None)
    sparsekit.encode(root / "cats-pruned", root / "cats")
    out["cats"] = root / "cats"
    return out


def from_pretrained(path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), **kw)


def reference(path, dtype=torch.float32):
    from sparsekit.runtime.loader import load_packed

    return load_packed(path, device="cpu", dtype=dtype)


def assert_same_model(model, ref):
    assert [(n, type(m).__name__) for n, m in model.named_modules()] == \
           [(n, type(m).__name__) for n, m in ref.named_modules()]
    got, want = model.state_dict(), ref.state_dict()
    assert list(got) == list(want)
    assert [(n, p.requires_grad) for n, p in model.named_parameters()] == \
           [(n, p.requires_grad) for n, p in ref.named_parameters()]
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text.strip(), text
    return text


# --- from_pretrained == load_packed ------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gpt2", "cats"])
def test_from_pretrained_equals_load_packed(packed, arch):
    from sparsekit.runtime.cats import cats_activations
    from sparsekit.runtime.sparse_linear import SparseLinear

    model, ref = from_pretrained(packed[arch]), reference(packed[arch])
    assert sum(isinstance(m, SparseLinear) for m in model.modules()) == len(
        json.loads((packed[arch] / "config.json").read_text())["quantization_config"]["packed_modules"]) > 0
    assert_same_model(model, ref)
    assert not model.training and model.is_quantized
    want = {n: float(a.threshold) for n, a in cats_activations(ref).items()}
    assert {n: float(a.threshold) for n, a in cats_activations(model).items()} == want
    assert bool(want) == (arch == "cats")
    if arch == "gpt2":  # tied head: one tensor, as load_packed ties it
        assert model.lm_head.weight is model.transformer.wte.weight


def test_dtype_is_honoured(packed):
    model = from_pretrained(packed["llama"], dtype=torch.float16)
    assert model.model.embed_tokens.weight.dtype == torch.float16
    assert_same_model(model, reference(packed["llama"], dtype=torch.float16))
    with pytest.raises(SparsekitError, match="unsupported dtype"):
        from_pretrained(packed["llama"], dtype=torch.float64)


@pytest.mark.parametrize("device_map", ["cpu", "auto", {"": "cpu"}])
def test_device_maps_of_one_device(packed, device_map):
    model = from_pretrained(packed["llama"], device_map=device_map)
    want = "cuda" if device_map == "auto" and torch.cuda.is_available() else "cpu"
    assert {t.device.type for t in model.state_dict().values()} == {want}


@pytest.mark.parametrize("device_map, message", [
    ({"model": "cpu", "lm_head": "disk"}, "offloads to disk"),
    ({"model": "cpu", "lm_head": 0}, "runs on one device"),
    ("balanced", "spreads a model over several devices"),
])
def test_device_maps_that_split_or_offload_are_one_line(packed, device_map, message):
    with pytest.raises(SparsekitError, match=message) as e:
        from_pretrained(packed["llama"], device_map=device_map)
    one_line(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_without_a_gpu_is_one_line(packed):
    with pytest.raises(SparsekitError, match="no CUDA GPU") as e:
        from_pretrained(packed["llama"], device_map="cuda")
    one_line(e.value)


def test_cpu_reference_path_says_the_same_notice_as_load(packed, monkeypatch):
    import warnings

    from sparsekit.runtime import sparse_linear

    model = from_pretrained(packed["llama"])
    monkeypatch.setattr(sparse_linear, "notices_shown", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(IDS)
    notices = [str(w.message) for w in caught if issubclass(w.category, sparse_linear.SparsekitWarning)]
    want = sparse_linear.CPU_NOTICE if torch.cuda.is_available() else sparse_linear.NO_GPU_NOTICE
    assert notices == [want]


# --- the ecosystem ------------------------------------------------------------------------------
def test_pipeline_and_static_cache_generate_as_load_packed(packed):
    from transformers import AutoTokenizer, pipeline

    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = reference(packed["llama"])
    with torch.no_grad():
        want = ref.generate(IDS, **kw)
        got = from_pretrained(packed["llama"]).generate(IDS, cache_implementation="static", **kw)
    assert torch.equal(got, want)

    tok = AutoTokenizer.from_pretrained(packed["llama"])
    prompt = "the river city was"
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        want = ref.generate(ids, **kw)[0]
    gen = pipeline("text-generation", model=str(packed["llama"]))
    assert gen(prompt, return_tensors=True, **kw)[0]["generated_token_ids"] == want.tolist()
    assert gen(prompt, **kw)[0]["generated_text"] == tok.decode(want, skip_special_tokens=True)


def test_lm_eval_hf_model_scores_a_packed_directory(packed, monkeypatch):
    pytest.importorskip("lm_eval", reason='lm-eval is not installed: pip install "sparsekit[tasks]"')
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from sparsekit.evaluation.tasks import task_manager
    from tests.test_tasks import TASK, TASKS_DIR, questions, reference_accuracy

    monkeypatch.chdir(TASKS_DIR)  # the task's data_files path is relative
    lm = HFLM(pretrained=str(packed["llama"]), device="cpu", dtype="float32", batch_size=4)
    assert_same_model(lm.model, reference(packed["llama"]))   # lm-eval's own from_pretrained: the sparse model
    out = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=task_manager(TASKS_DIR, include_defaults=False),
                                  limit=6, log_samples=False, verbosity="ERROR")
    res = out["results"][TASK]
    from transformers import AutoTokenizer

    want_acc, want_norm = reference_accuracy(reference(packed["llama"]), AutoTokenizer.from_pretrained(packed["llama"]),
                                             questions(6))
    assert res["acc,none"] == pytest.approx(want_acc, abs=1e-9)
    assert res["acc_norm,none"] == pytest.approx(want_norm, abs=1e-9)


def test_peft_refuses_packed_layers_and_trains_on_the_dense_copy(packed):
    peft = pytest.importorskip("peft")

    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = from_pretrained(packed["llama"])
    with pytest.raises(ValueError, match="SparseLinear.*not supported") as e:
        peft.get_peft_model(model, peft.LoraConfig(**config))
    one_line(e.value)

    dense = from_pretrained(packed["llama"]).dequantize()   # the route: a dense copy takes adapters
    assert not any(type(m).__name__ == "SparseLinear" for m in dense.modules())
    with torch.no_grad():
        assert torch.equal(dense(IDS).logits, reference(packed["llama"])(IDS).logits)
    lora = peft.get_peft_model(dense, peft.LoraConfig(**config))
    opt = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.05)
    losses = []
    for _ in range(4):
        loss = lora(input_ids=IDS, labels=IDS).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with torch.no_grad():
        want = lora(IDS).logits
        merged = lora.merge_and_unload()
        assert isinstance(merged.model.layers[0].self_attn.q_proj, nn.Linear)
        torch.testing.assert_close(merged(IDS).logits, want, rtol=1e-4, atol=1e-4)


def test_a_hub_id_loads_its_whole_snapshot(packed, tmp_path, monkeypatch):
    """A hub repo (offline here: a hub cache made by hand) where transformers fetched only config.json
    and the stub: the rest of that commit is fetched into the same cache, then loaded."""
    import huggingface_hub

    repo, sha, cache = "sparsekit-test/tiny-packed", "0123456789abcdef0123456789abcdef01234567", tmp_path / "hub"
    snapshot = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / sha
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(sha)
    for name in ("config.json", "tcabme.stub.safetensors"):
        shutil.copy(packed["llama"] / name, snapshot / name)
    calls = []

    def snapshot_download(repo_id, revision=None, cache_dir=None, **kwargs):
        calls.append((repo_id, revision, Path(cache_dir)))
        for f in packed["llama"].iterdir():
            shutil.copy(f, snapshot / f.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model = from_pretrained(repo, cache_dir=str(cache))
    assert calls == [(repo, sha, cache)]
    assert_same_model(model, reference(packed["llama"]))


# --- saving -------------------------------------------------------------------------------------
def test_save_pretrained_refuses_in_one_line_and_writes_nothing(packed, tmp_path):
    from sparsekit.runtime.hf_quantizer import SAVE_REFUSAL

    model = from_pretrained(packed["gpt2"])
    with pytest.raises(SparsekitError, match="sparsekit encode") as e:
        model.save_pretrained(tmp_path / "out")
    assert one_line(e.value) == SAVE_REFUSAL
    assert not (tmp_path / "out").exists()


def test_dequantized_model_saves_dense_under_a_plain_config(packed, tmp_path):
    """The dense way out: dequantize() gives GPT-2 its Conv1D layers back; the saved checkpoint has no
    quantization_config and loads (without sparsekit's quantizer) to the same logits."""
    model = from_pretrained(packed["gpt2"]).dequantize()
    model.save_pretrained(tmp_path / "dense")
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    back = from_pretrained(tmp_path / "dense")
    assert not getattr(back, "is_quantized", False)
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, reference(packed["gpt2"])(IDS).logits)


# --- what encode writes, and older directories -----------------------------------------------------
def test_encode_writes_the_quantization_config_and_a_stub(packed):
    from sparsekit.packed import quantconfig
    from sparsekit.packed.shards import load_index
    from sparsekit.packed.verify import verify_packed

    for arch, cats in (("llama", None), ("cats", "sparsekit.json")):
        qc = json.loads((packed[arch] / "config.json").read_text())["quantization_config"]
        layers = load_index(packed[arch])["layers"]
        assert qc == {"quant_method": "sparsekit", "format": "tcabme", "format_version": 1,
                      "packed_modules": sorted(m for m, i in layers.items() if i["packed"]),
                      "cats_thresholds": cats, "sparsekit_version": qc["sparsekit_version"]}
        assert quantconfig.check(qc) == qc
        from safetensors import safe_open

        with safe_open(str(packed[arch] / quantconfig.STUB_NAME), "pt") as f:
            assert list(f.keys()) == []
        assert verify_packed(packed[arch])["from_pretrained"] is True


def test_bitmask_round_trip_writes_dense_configs_and_encode_puts_it_back(packed, tmp_path):
    """import-bitmask writes a dense pruned checkpoint: no quantization_config (transformers loads it as
    it is); encoding that gives the packed config again. export-bitmask writes compressed-tensors' own."""
    from sparsekit.packed.encoding import encode
    from sparsekit.packed.interchange import export_bitmask, import_bitmask

    export_bitmask(packed["llama"], tmp_path / "ct")
    assert json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "compressed-tensors"
    import_bitmask(tmp_path / "ct", tmp_path / "dense")
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    with torch.no_grad():
        assert torch.equal(from_pretrained(tmp_path / "dense")(IDS).logits, reference(packed["llama"])(IDS).logits)
    encode(tmp_path / "dense", tmp_path / "again")
    assert_same_model(from_pretrained(tmp_path / "again"), reference(packed["llama"]))


def test_a_directory_without_quantization_config_still_loads_through_sparsekit(packed, tmp_path):
    """An older packed directory: sparsekit.load reads it; from_pretrained fails (no weights file for
    transformers), it never builds a model of random weights."""
    import sparsekit
    from sparsekit.packed.verify import verify_packed

    old = tmp_path / "old"
    shutil.copytree(packed["llama"], old)
    config = json.loads((old / "config.json").read_text())
    del config["quantization_config"]
    (old / "config.json").write_text(json.dumps(config))
    (old / "tcabme.stub.safetensors").unlink()
    model, _ = sparsekit.load(str(old), device="cpu")
    assert verify_packed(old)["from_pretrained"] is False
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(packed["llama"])(IDS).logits)
    with pytest.raises(OSError, match="model.safetensors"):
        from_pretrained(old)


# --- a tampered quantization_config ---------------------------------------------------------------
def tamper(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("changes, message", [
    ({"format_version": 99}, "format version 99"),
    ({"format": "sentinel_payload:run"}, "names format 'sentinel_payload:run'"),
    ({"loader": "sentinel_payload"}, "unknown field 'loader'"),
    ({"cats_thresholds": "../sentinel_payload.py"}, "for the CATS thresholds"),
    ({"packed_modules": ["model.layers.0.mlp.up_proj"]}, "differ from tcabme.index.json"),
    ({"packed_modules": ["__import__('os')"]}, "not a list of module names"),
])
def test_tampered_quantization_config_fails_in_one_line_and_runs_nothing(packed, tmp_path, monkeypatch, changes,
                                                                         message):
    """A module on sys.path that a loader trusting the config could import: it would leave a file."""
    (tmp_path / "sentinel_payload.py").write_text(
        f"open({str(tmp_path / 'ran')!r}, 'w').write('imported')\ndef run(*a, **k):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = tamper(packed["llama"], tmp_path / "bad", **changes)
    with pytest.raises(SparsekitError, match=message) as e:
        from_pretrained(bad)
    one_line(e.value)
    res = CliRunner().invoke(app, ["verify", str(bad)])
    assert res.exit_code == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "ran").exists() and "sentinel_payload" not in sys.modules


def test_a_missing_shard_fails_in_one_line(packed, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(packed["llama"], bad)
    next(bad.glob("tcabme-0*.safetensors")).unlink()
    with pytest.raises(SparsekitError, match="shard tcabme-00001-of-00001.safetensors is missing") as e:
        from_pretrained(bad)
    one_line(e.value)


# --- registration -------------------------------------------------------------------------------
def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_import_sparsekit_registers_lazily_and_without_it_nothing_loads(packed):
    """``import sparsekit`` imports no transformers, and from_pretrained works after it; imported after
    transformers it registers at once; before the import, from_pretrained fails (no model at all)."""
    load = (f"m = AutoModelForCausalLM.from_pretrained({str(packed['llama'])!r}); "
            "print(type(m.model.layers[0].mlp.up_proj).__name__)")
    res = run_python("import sys, sparsekit; assert 'transformers' not in sys.modules, 'eager'\n"
                     f"from transformers import AutoModelForCausalLM\n{load}")
    assert res.returncode == 0 and res.stdout.split() == ["SparseLinear"], res.stderr[-2000:]
    res = run_python("from transformers import AutoModelForCausalLM\nimport transformers.quantizers\n"
                     f"try:\n    {load}\nexcept OSError as e:\n    print('refused', 'model.safetensors' in str(e))\n"
                     f"import sparsekit\n{load}")
    assert res.returncode == 0 and res.stdout.split() == ["refused", "True", "SparseLinear"], res.stderr[-2000:]
