"""prune(): the saved checkpoint (exact sparsity, N:M invariants, sparsekit.json) and safe output."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sparsekit.errors import SparsekitError
from sparsekit.pruning.api import prune
from tiny_models import make_workdir, save_tiny

META_KEYS = {"schema_version", "sparsekit_version", "model", "method", "pattern", "sparsity", "calibration", "skip", "layers",
             "versions", "elapsed_s"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("prune"))


def _saved_tensors(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _as_out_in(t: torch.Tensor, kind: str) -> torch.Tensor:
    return t.t() if kind == "conv1d" else t


@pytest.mark.parametrize("arch,method,pattern", [("llama", "sparsegpt", "2:4"), ("gpt2", "wanda", "2:4"),
                                                 ("llama", "wanda", "unstructured")])
def test_saved_checkpoint_has_exact_sparsity(workdir, arch, method, pattern):
    out = workdir / f"out-{arch}-{method}-{pattern.replace(':', '')}"
    rep = prune(str(workdir / arch), method=method, pattern=pattern, sparsity=0.5 if pattern == "unstructured" else None,
                calib=str(workdir / "calib.txt"), nsamples=4, seqlen=64, seed=0, output=out, device="cpu",
                warn=lambda m: None)
    for f in ("config.json", "sparsekit.json"):
        assert (out / f).is_file()
    assert list(out.glob("*.safetensors")) and list(out.glob("tokenizer*"))
    meta = json.loads((out / "sparsekit.json").read_text())
    assert set(meta) == META_KEYS
    assert meta["method"] == method and meta["pattern"] == pattern and meta["sparsity"] == 0.5
    assert meta["calibration"] == {"dataset": str(workdir / "calib.txt"), "nsamples": 4, "seqlen": 64, "seed": 0}
    assert meta["skip"] == ["lm_head"]
    assert rep["overall_sparsity"] == pytest.approx(0.5)
    tensors = _saved_tensors(out)
    n_linears = {"llama": 7, "gpt2": 4}[arch] * 3
    assert len(meta["layers"]) == n_linears
    for name, info in meta["layers"].items():
        w = _as_out_in(tensors[f"{name}.weight"], info["kind"])
        assert list(w.shape) == info["shape"]
        assert (w == 0).sum().item() == w.numel() // 2, name  # exactly the requested sparsity
        assert info["sparsity"] == 0.5
        if pattern == "2:4":
            assert ((w.reshape(w.shape[0], -1, 4) == 0).sum(-1) >= 2).all(), name
    head = tensors.get("lm_head.weight", tensors.get("transformer.wte.weight"))
    assert head is not None and (head == 0).float().mean() < 0.01  # lm_head stays dense


def test_existing_output_refused_before_loading(workdir):
    out = workdir / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SparsekitError, match="--overwrite"):
        prune(str(workdir / "no-such-model"), method="magnitude", output=out)  # output checked first
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(SparsekitError, match="not a sparsekit output"):  # --overwrite replaces only our outputs
        prune(str(workdir / "no-such-model"), method="magnitude", output=out, overwrite=True)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "sparsekit.json").write_text("{}")  # an earlier sparsekit output, holding a file of the user's
    with pytest.raises(SparsekitError, match=r"sparsekit did not write \(keep.txt\).*--delete-extra"):
        prune(str(workdir / "no-such-model"), method="magnitude", output=out, overwrite=True)
    prune(str(workdir / "llama"), method="magnitude", pattern="4:8", output=out, overwrite=True, delete_extra=True,
          device="cpu")
    assert not (out / "keep.txt").exists()
    assert json.loads((out / "sparsekit.json").read_text())["calibration"]["nsamples"] == 0


def test_bad_batch_size_refused_before_loading(workdir):
    for bad in (0, -3):
        with pytest.raises(SparsekitError, match="batch size"):
            prune(str(workdir / "no-such-model"), method="wanda", batch_size=bad, output=workdir / "bs")
    assert not (workdir / "bs").exists()


def test_output_blocked_by_a_file_refused_before_loading(workdir):
    blocker = workdir / "a-file"
    blocker.write_text("mine")
    with pytest.raises(SparsekitError, match="is a file"):  # was a FileExistsError after all the work
        prune(str(workdir / "no-such-model"), method="magnitude", output=blocker / "sub" / "out")
    with pytest.raises(SparsekitError, match="is a file"):
        prune(str(workdir / "no-such-model"), method="magnitude", output=blocker, overwrite=True)
    assert blocker.read_text() == "mine" and [p.name for p in workdir.glob(".a-file*")] == []


def test_output_that_is_the_working_directory_refused_before_loading(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    for out in (".", "", "..", str(workdir)):  # -o . --overwrite failed with EBUSY after all the work
        with pytest.raises(SparsekitError, match="current directory"):
            prune(str(workdir / "no-such-model"), method="magnitude", output=out, overwrite=True)


def test_failure_leaves_no_output_and_no_temp_dir(workdir, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", boom)
    parent = workdir / "failing"
    parent.mkdir()
    with pytest.raises(RuntimeError, match="disk full"):
        prune(str(workdir / "llama"), method="magnitude", output=parent / "out", device="cpu")
    assert list(parent.iterdir()) == []


def test_seqlen_capped_to_model_context(workdir):
    notes = []
    rep = prune(str(workdir / "llama"), method="wanda", calib=str(workdir / "calib.txt"), nsamples=2, seqlen=4096,
                output=workdir / "capped", device="cpu", warn=notes.append)
    assert rep["calibration"]["seqlen"] == 256  # the tiny model's max_position_embeddings
    assert any("context" in n for n in notes)


def test_skip_patterns_leave_modules_dense(workdir):
    rep = prune(str(workdir / "llama"), method="magnitude", skip=["lm_head", "*.mlp.down_proj", "model.layers.0.*"],
                output=workdir / "skipped", device="cpu")
    names = set(rep["layers"])
    assert not any(".down_proj" in n or ".layers.0." in n for n in names)
    assert len(names) == 2 * 6
    with pytest.raises(SparsekitError, match="skip"):
        prune(str(workdir / "llama"), method="magnitude", skip=["*"], output=workdir / "none", device="cpu")
    assert not (workdir / "none").exists()


def test_skip_pattern_matching_nothing_is_warned(workdir):
    notes = []
    rep = prune(str(workdir / "llama"), method="magnitude", skip=["lm_head", "*.q_prj"], output=workdir / "typo",
                device="cpu", warn=notes.append)
    assert any("'*.q_prj' matches no linear layer" in n for n in notes)
    assert not any("lm_head" in n for n in notes)  # a pattern that matches is not reported
    assert any(n.endswith("q_proj") for n in rep["layers"])


def test_default_output_names_differ_when_settings_differ():
    from sparsekit.pruning.api import default_output

    names = {default_output("m", "wanda", p, sp).name for p, sp in [
        ("unstructured", 0.5), ("unstructured", 0.333), ("unstructured", 0.334), ("2:4", 0.5), ("4:8", 0.5),
        ("hybrid", 0.25), ("hybrid", 0.5), ("hybrid:32", 0.25)]}
    assert len(names) == 8  # hybrid 0.25 vs 0.5 used to share out/m-wanda-hybrid
    assert default_output("org/m/", "wanda", "unstructured", 0.5) == Path("out/m-wanda-50")
    assert default_output("m", "sparsegpt", "2:4", 0.5) == Path("out/m-sparsegpt-2of4")


def test_half_checkpoint_is_saved_in_its_own_dtype(tmp_path, workdir):
    src = save_tiny("llama", tmp_path / "half", dtype=torch.float16)
    out = tmp_path / "out"
    rep = prune(str(src), method="wanda", pattern="2:4", calib=str(workdir / "calib.txt"), nsamples=2, seqlen=64,
                output=out, device="cpu", warn=lambda m: None)
    assert (rep["dtype"], rep["saved_dtype"]) == ("float32", "float16")  # computed in fp32 on the CPU
    tensors = _saved_tensors(out)
    for name, info in json.loads((out / "sparsekit.json").read_text())["layers"].items():
        w = tensors[f"{name}.weight"]
        assert w.dtype == torch.float16
        assert info["sparsity"] == (w == 0).float().mean().item() == 0.5


def test_lm_head_stays_dense_unless_asked(workdir):
    rep = prune(str(workdir / "llama"), method="magnitude", skip=["*.mlp.down_proj"], output=workdir / "keep_head",
                device="cpu")
    assert "lm_head" not in rep["layers"] and rep["skip"] == ["lm_head", "*.mlp.down_proj"]
    rep = prune(str(workdir / "llama"), method="magnitude", prune_lm_head=True, output=workdir / "head", device="cpu")
    assert rep["layers"]["lm_head"]["sparsity"] == 0.5
