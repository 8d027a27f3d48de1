"""Issue 23: OWL layer allocation (outlier-weighted layerwise sparsity, Yin et al. 2024).

The references here are computed by hand from the paper's formula, or from the dense model by a
plain full-model forward in the test (not by the engine's layer-by-layer scan).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.pruning.api import prune
from sparsekit.pruning.owl import outlier_ratio, owl_sparsities

from test_streaming import tensors
from tiny_models import make_workdir

runner = CliRunner()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("owl"))


def _prune(work: Path, out: str, **kw) -> dict:
    args = dict(method="wanda", sparsity=0.5, allocation="owl", calib=str(work / "calib.txt"), nsamples=8, seqlen=64,
                device="cpu", output=work / out, overwrite=True, offload="memory", warn=lambda m: None)
    args.update(kw)
    return prune(str(work / "llama"), **args)


def test_owl_sparsities_hand_computed():
    # the paper: r = 2*lam*(D - min)/(max - min); density = r - mean(r) + (1 - s); sparsity = 1 - density.
    # D = [2, 5, 8] %, s = 0.7, lam = 0.08: r = [0, 0.08, 0.16], mean 0.08 -> sparsity [0.78, 0.70, 0.62]
    assert owl_sparsities([2.0, 5.0, 8.0], 0.7, 0.08) == pytest.approx([0.78, 0.70, 0.62], abs=1e-12)
    # weighted by size: D = [0, 10, 10], sizes [1, 1, 2], s = 0.5: r = [0, .16, .16], weighted mean
    # (0 + .16 + .32) / 4 = .12 -> [0.62, 0.46, 0.46] (weighted mean (0.62 + 0.46 + 0.92) / 4 = 0.5)
    assert owl_sparsities([0.0, 10.0, 10.0], 0.5, 0.08, params=[1, 1, 2]) == pytest.approx([0.62, 0.46, 0.46],
                                                                                         abs=1e-12)
    # capped at 0.5 (hybrid): s = 0.45, D = [0, 1]: [0.53, 0.37] unclipped; the first is held at 0.5,
    # so the other takes 0.4 to keep the mean at 0.45
    assert owl_sparsities([0.0, 1.0], 0.45, 0.08, hi=0.5) == pytest.approx([0.5, 0.4], abs=1e-9)
    # equal ratios: uniform
    assert owl_sparsities([3.0, 3.0], 0.6, 0.08) == pytest.approx([0.6, 0.6])


def test_outlier_ratio_hand_computed():
    a = torch.ones(2, 2)  # four scores of 1
    b = torch.tensor([[1.0, 1.0], [1.0, 13.0]])  # mean of all 8: 20 / 8 = 2.5; M = 5 -> threshold 12.5
    assert outlier_ratio([a, b], 5.0) == pytest.approx(100.0 / 8)
    assert outlier_ratio([a, b], 6.0) == 0.0  # threshold 15


def _reference_ratios(model, calib: torch.Tensor, m: float) -> list[float]:
    """Each decoder layer's outlier ratio on the dense model, from one full forward with hooks."""
    sq: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            def hook(mod, inp, out, name=name):
                x = inp[0].detach().reshape(-1, inp[0].shape[-1]).double()
                sq[name] = sq.get(name, 0) + (x * x).sum(0)
            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=calib)
    for h in hooks:
        h.remove()
    out = []
    for i in range(len(model.model.layers)):
        scores = [m_.weight.double().abs() * sq[n].sqrt() for n, m_ in model.named_modules()
                  if n.startswith(f"model.layers.{i}.") and n in sq]
        flat = torch.cat([s.reshape(-1) for s in scores])
        out.append(100.0 * float((flat > m * flat.mean()).double().mean()))
    return out


def test_engine_allocation_matches_the_dense_model_reference(work):
    from sparsekit.hf.data import calibration_windows
    from sparsekit.hf.models import load_model

    net, tok = load_model(str(work / "llama"), device="cpu", dtype=torch.float32)
    ids = calibration_windows(str(work / "calib.txt"), tok, nsamples=8, seqlen=64, seed=0)
    ref = _reference_ratios(net, ids[:4], 5.0)
    rep = _prune(work, "owl-ref", sparsity=0.6, owl_lambda=0.1, owl_windows=4)
    a = rep["allocation"]
    assert a["kind"] == "owl" and a["lambda"] == 0.1 and a["m"] == 5.0 and a["windows"] == 4
    assert a["outlier_ratio"] == pytest.approx(ref, rel=1e-4)
    # the paper's formula on the reference ratios (equal layers: the plain mean)
    lo, hi = min(ref), max(ref)
    r = [0.2 * (d - lo) / (hi - lo) for d in ref]
    want = [0.6 - (x - sum(r) / len(r)) for x in r]
    assert a["target"] == pytest.approx(want, abs=1e-6)
    assert max(want) - min(want) == pytest.approx(0.2)
    for entry, t in zip(rep["per_layer"], want):  # each layer at its target, within the per-row rounding
        assert entry["target"] == pytest.approx(t)
        assert entry["sparsity"] == pytest.approx(t, abs=0.01)
    assert rep["overall_sparsity"] == pytest.approx(0.6, abs=1e-3)
    meta = json.loads((Path(rep["output"]) / "sparsekit.json").read_text())
    assert meta["allocation"]["target"] == pytest.approx(want, abs=1e-6)


def test_scan_reads_the_pruning_pass_capture(monkeypatch):
    """The scan reads a copy of the engine's own capture (its first windows, batch for batch) instead of
    capturing again: the dense-model reference ratios still, exactly those of a capture of its own, the
    capture left as it was; no copy where the batches would differ or the scan reads every window."""
    from sparsekit.pruning import owl_pass
    from sparsekit.pruning.capture import capture_inputs
    from sparsekit.pruning.engine import prune_model
    from sparsekit.pruning.owl import OwlSettings
    from tiny_models import make_model

    model, cpu, owl = make_model("llama"), torch.device("cpu"), OwlSettings(windows=4)
    ids = torch.randint(0, 320, (8, 24), generator=torch.Generator().manual_seed(0))
    acts = capture_inputs(model, ids, cpu, batch_size=2)
    before = acts.hidden.clone()
    own = owl_pass.owl_scan(model, ids, cpu, owl, [], batch_size=2)
    assert owl_pass.owl_scan(model, ids, cpu, owl, [], batch_size=2, acts=acts) == own
    assert torch.equal(acts.hidden, before)
    part = owl_pass.scan_activations(acts, 4)
    assert part.spans == [(0, 2), (2, 4)] and torch.equal(part.hidden, before[:4])
    assert owl_pass.scan_activations(acts, 3) is None and owl_pass.scan_activations(acts, 8) is None

    ref = _reference_ratios(model, ids[:4], owl.m)

    def no_second_capture(*args, **kwargs):
        raise AssertionError("the scan captured the windows again")

    monkeypatch.setattr(owl_pass, "capture_inputs", no_second_capture)
    rep = prune_model(model, ids, method="wanda", sparsity=0.5, pattern="unstructured", batch_size=2, owl=owl,
                      warn=lambda m: None)
    assert rep["allocation"]["outlier_ratio"] == own[0] == pytest.approx(ref, rel=1e-4)


@pytest.mark.parametrize("method,sparsity", [("wanda", 0.5), ("sparsegpt", 0.7), ("magnitude", 0.3)])
def test_global_sparsity_holds(work, method, sparsity):
    rep = _prune(work, f"owl-{method}", method=method, sparsity=sparsity)
    t = rep["allocation"]["target"]
    assert max(t) - min(t) > 0.1  # the layers really differ
    total = sum(r["shape"][0] * r["shape"][1] for r in rep["layers"].values())
    zeros = sum(r["sparsity"] * r["shape"][0] * r["shape"][1] for r in rep["layers"].values())
    assert abs(zeros / total - sparsity) <= 1e-3  # weighted by parameter count


def test_hybrid_owl_keeps_tiles_and_the_global_sparsity(work):
    rep = _prune(work, "owl-hybrid", method="sparsegpt", pattern="hybrid:32", sparsity=0.3)
    t = rep["allocation"]["target"]
    assert max(t) <= 0.5 and max(t) - min(t) > 0.1
    total = sum(r["shape"][0] * r["shape"][1] for r in rep["layers"].values())
    # one 32x32 tile (512 zeros) is the unit of a hybrid sparsity
    assert abs(rep["overall_sparsity"] - 0.3) <= 512 / total
    from sparsekit.hf.models import load_model

    net, _ = load_model(rep["output"], device="cpu", dtype=torch.float32)
    for name in rep["layers"]:
        w = net.get_submodule(name).weight
        r, c = w.shape
        tiles = (w == 0).reshape(r // 32, 32, c // 32, 32).permute(0, 2, 1, 3).reshape(-1, 32, 8, 4).sum(-1)
        per_tile = tiles.reshape(tiles.shape[0], -1)
        assert bool(((per_tile == 0).all(1) | (per_tile >= 2).all(1)).all()), name  # dense or 2:4


def test_streamed_equals_in_memory(work):
    mem = _prune(work, "owl-mem", method="sparsegpt", offload="memory")
    disk = _prune(work, "owl-disk", method="sparsegpt", offload="disk")
    assert (mem["offload"], disk["offload"]) == ("memory", "disk")
    assert mem["allocation"]["outlier_ratio"] == disk["allocation"]["outlier_ratio"]
    assert mem["allocation"]["target"] == disk["allocation"]["target"]
    a, b = tensors(Path(mem["output"])), tensors(Path(disk["output"]))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert mem["layers"] == disk["layers"]


def test_owl_settings_from_cli_and_recipe(work, tmp_path):
    recipe = tmp_path / "owl.yaml"
    recipe.write_text("method: wanda\nsparsity: 0.6\nallocation: owl\nowl: {lambda: 0.05, m: 7, windows: 2}\n")
    out = tmp_path / "o"
    res = runner.invoke(app, ["prune", str(work / "llama"), "--recipe", str(recipe), "--calib", str(work / "calib.txt"),
                              "--nsamples", "4", "--seqlen", "32", "--device", "cpu", "--owl-m", "6", "-o", str(out),
                              "--json"])
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "sparsekit.json").read_text())
    assert {k: meta["allocation"][k] for k in ("lambda", "m", "windows")} == {"lambda": 0.05, "m": 6.0, "windows": 2}
    t = meta["allocation"]["target"]
    assert max(t) - min(t) == pytest.approx(0.1)


@pytest.mark.parametrize("args,words", [
    (["--pattern", "2:4", "--allocation", "owl"], "2:4"),
    (["--allocation", "owl", "--owl-lambda", "0.7"], "lambda"),
    (["--allocation", "owl", "--owl-m", "0"], "M"),
    (["--method", "cats", "--allocation", "owl"], "weight method"),
    (["--allocation", "owl", "--learn-mask", "--pattern", "hybrid"], "one-shot"),
    (["--owl-lambda", "0.1"], "--allocation owl"),
    (["--dsnot-cycles", "3"], "--refine dsnot"),
    (["--admm-iters", "3"], "--update admm"),
])
def test_bad_owl_input_is_a_one_line_error(work, tmp_path, args, words):
    res = runner.invoke(app, ["prune", str(work / "llama"), "--device", "cpu", "-o", str(tmp_path / "x"), *args])
    assert res.exit_code == 2, res.output
    assert words in res.output and len(res.output.strip().splitlines()) == 1, res.output



def test_resident_layers_keep_in_order_within_the_budget():
    """OWL's scan leaves device copies for the pruning pass: in layer order, while they fit, and only
    copies that match the layer's tensors are handed back."""
    from sparsekit.pruning.offload import ResidentLayers

    t = [torch.zeros(10, dtype=torch.float16), torch.zeros(5, dtype=torch.float32)]   # 40 bytes
    r = ResidentLayers(100)
    assert r.keep(0, t) and r.keep(1, list(t))
    assert not r.keep(2, list(t))                     # 120 > 100
    assert not r.keep(3, [torch.zeros(1)])            # fits, but a later layer than a refused one: kept in order only
    assert r.report(4) == {"layers_kept": 2, "of": 4, "budget_bytes": 100, "kept_bytes": 80}
    assert r.take(0, t) is t and r.used == 40
    assert r.take(0, t) is None                       # taken once
    assert r.take(1, [torch.zeros(10, dtype=torch.float32), t[1]]) is None   # dtype differs: copied in as usual
    assert r.take(2, t) is None and r.used == 0
    assert ResidentLayers(-5).budget == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the overlapped layer mover)")
def test_resident_scan_copies_prune_the_same(work, monkeypatch):
    """The pruning pass on the scan's device copies gives the same weights as on fresh copies."""
    from sparsekit.pruning import engine

    a = _prune(work, "owl-res", device="cuda")
    assert a["allocation"]["resident"]["layers_kept"] == len(a["per_layer"])
    monkeypatch.setattr(engine, "resident_for", lambda *args: None)
    b = _prune(work, "owl-nores", device="cuda")
    assert "resident" not in b["allocation"]
    from safetensors.torch import load_file

    wa = {k: v for f in sorted(Path(a["output"]).glob("*.safetensors")) for k, v in load_file(f).items()}
    wb = {k: v for f in sorted(Path(b["output"]).glob("*.safetensors")) for k, v in load_file(f).items()}
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
