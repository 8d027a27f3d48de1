"""CATS: thresholds are quantiles, the thresholded MLP is the masked reference, thresholds are
calibrated layer by layer on thresholded inputs, survive the checkpoint (and encode) and are
installed on load; the CLI runs it and refuses what does not apply with one line."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from sparsekit.pruning.methods import cats
from sparsekit.runtime import cats as rcats
from sparsekit.cli.app import app
from sparsekit.errors import SparsekitError
from tiny_models import make_model, make_workdir

runner = CliRunner()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("cats"), llama="tiny")


@pytest.fixture(scope="module")
def cats_dir(workdir):
    """The tiny Llama through ``sparsekit.prune(method="cats", sparsity=0.5)``."""
    import sparsekit

    out = workdir / "cats50"
    report = sparsekit.prune(str(workdir / "tiny"), method="cats", sparsity=0.5,
                                     calib=str(workdir / "calib.txt"), nsamples=4, seqlen=64, device="cpu",
                                     output=out, warn=lambda m: None)
    return out, report


def masked_mlp_forward(mlp: nn.Module, x: torch.Tensor, t: float) -> torch.Tensor:
    """The CATS MLP written out by hand: down(silu(gate x) * [|silu(gate x)| >= t] * up x)."""
    a = torch.nn.functional.silu(x @ mlp.gate_proj.weight.T)
    a = a * (a.abs() >= t).to(a.dtype)
    return (a * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T


def calib_ids(workdir, n=4, seqlen=64):
    from sparsekit.hf.data import calibration_windows
    from sparsekit.hf.models import load_tokenizer

    return calibration_windows(str(workdir / "calib.txt"), load_tokenizer(str(workdir / "tiny")),
                               nsamples=n, seqlen=seqlen, seed=0)


# ----------------------------------------------------------------------------- the math
@pytest.mark.parametrize("k", [0.0, 0.3, 0.5, 0.9])
def test_threshold_is_the_quantile(k):
    v = torch.randn(20_000, generator=torch.Generator().manual_seed(1)).abs()
    t = cats.threshold_for(v, k)
    assert abs((v < t).float().mean().item() - k) <= 1 / v.numel()


def test_sampled_threshold_is_close_and_seeded():
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(40, 1000, generator=g).abs() * (1 + i) for i in range(5)]  # 200k values
    every = torch.cat([b.reshape(-1) for b in batches])

    def sample(seed):
        s = cats.ActivationSample(every.numel(), size=2**14, seed=seed)
        for b in batches:
            s.add(b)
        return s

    s = sample(0)
    assert not s.exact and len(s.values()) == 2**14
    for k in (0.25, 0.5, 0.8):
        frac = (every < s.threshold(k)).float().mean().item()
        assert abs(frac - k) < 0.015, (k, frac)  # ~4 standard errors of a 16k sample
    assert sample(0).threshold(0.5) == s.threshold(0.5)
    assert sample(1).threshold(0.5) != s.threshold(0.5)
    small = cats.ActivationSample(every.numel(), size=every.numel(), seed=0)
    for b in batches:
        small.add(b)
    assert small.exact and torch.equal(small.values(), every)  # no more values than the size: all of them


def test_threshold_range_errors():
    with pytest.raises(SparsekitError, match="out of range"):
        cats.threshold_for(torch.ones(4), 1.0)
    with pytest.raises(SparsekitError, match="calibration"):
        cats.threshold_for(torch.empty(0), 0.5)


def test_wrapped_mlp_equals_masked_reference():
    model = make_model("llama")
    mlp = model.model.layers[1].mlp
    x = torch.randn(2, 7, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dense = mlp(x)
        a = nn.functional.silu(mlp.gate_proj(x))
        t = float(a.abs().median())
        rcats.apply_threshold(mlp, t)
        got = mlp(x)
        ref = masked_mlp_forward(mlp, x, t)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, dense, atol=1e-3)
    assert isinstance(mlp.act_fn, rcats.CatsActivation) and float(mlp.act_fn.threshold) == pytest.approx(t)
    assert not any("threshold" in k for k in model.state_dict())  # the weights are those of the dense model
    rcats.apply_threshold(mlp, 0.0)  # re-thresholding replaces; t = 0 is the dense MLP again
    assert not isinstance(mlp.act_fn.act, rcats.CatsActivation)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), dense)


def test_gated_mlps_found_generically():
    llama = make_model("llama")
    assert list(cats.find_gated_mlps(llama)) == [f"model.layers.{i}.mlp" for i in range(3)]
    assert list(cats.find_gated_mlps(llama, skip=["model.layers.1.*"])) == ["model.layers.0.mlp", "model.layers.2.mlp"]
    wrapper = nn.ModuleDict({"inner": llama})  # no fixed model.model.layers path
    assert list(cats.find_gated_mlps(wrapper))[0] == "inner.model.layers.0.mlp"
    for arch in ("gpt2", "opt"):
        with pytest.raises(SparsekitError, match="gated MLP") as e:
            cats.require_gated_mlps(make_model(arch))
        assert "\n" not in str(e.value) and "--method" in str(e.value)


# ----------------------------------------------------------------------------- calibration
def test_layer_thresholds_measured_on_thresholded_inputs(workdir):
    """Layer i's threshold is the quantile of its activations with layers < i thresholded."""
    from sparsekit.pruning.engine import prune_model
    from sparsekit.hf.models import load_model

    ids = calib_ids(workdir)
    model, _ = load_model(str(workdir / "tiny"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = prune_model(model, ids, method="cats", sparsity=0.5, pattern="unstructured", device="cpu")
    th = {n: r["threshold"] for n, r in report["cats"].items()}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # no weight changed

    def quantile_of_layer(m, i):
        seen = []
        h = m.model.layers[i].mlp.act_fn.register_forward_hook(lambda mod, inp, out: seen.append(out.abs().reshape(-1)))
        with torch.no_grad():
            m(input_ids=ids, use_cache=False)
        h.remove()
        return torch.quantile(torch.cat(seen), 0.5).item()

    ref, _ = load_model(str(workdir / "tiny"))
    dense_q = [quantile_of_layer(ref, i) for i in range(3)]
    for i in range(3):
        assert quantile_of_layer(ref, i) == pytest.approx(th[f"model.layers.{i}.mlp"], rel=1e-5)
        rcats.apply_threshold(ref.model.layers[i].mlp, th[f"model.layers.{i}.mlp"])
    assert dense_q[0] == pytest.approx(th["model.layers.0.mlp"], rel=1e-5)
    for i in (1, 2):  # on the dense model's activations they would differ
        assert dense_q[i] != pytest.approx(th[f"model.layers.{i}.mlp"], rel=1e-4)
    for r in report["cats"].values():
        assert r["exact"] and abs(r["activation_sparsity"] - 0.5) < 1e-3

    # the engine leaves the model as it was: no threshold hook, no CatsActivation, the dense outputs
    for i in range(3):
        act = model.model.layers[i].mlp.act_fn
        assert not isinstance(act, rcats.CatsActivation) and not act._forward_hooks
    dense, _ = load_model(str(workdir / "tiny"))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, dense(input_ids=ids).logits, rtol=0, atol=0)
    # the reported thresholds, installed by the runtime, give the activation sparsity the engine measured
    rcats.install_thresholds(model, th)
    assert all(float(model.get_submodule(n).act_fn.threshold) == pytest.approx(t) for n, t in th.items())
    assert activation_sparsity(model, ids, th) == pytest.approx({n: r["activation_sparsity"] for n, r in
                                                                 report["cats"].items()}, abs=1e-12)


def activation_sparsity(model, ids, names) -> dict[str, float]:
    """The fraction of zeros in each named MLP's ``act_fn`` output over one forward of ``ids``."""
    counts = {n: [0, 0] for n in names}

    def count(name):
        def hook(module, inputs, output):
            counts[name][0] += int((output == 0).sum())
            counts[name][1] += output.numel()
        return hook

    hooks = [model.get_submodule(n).act_fn.register_forward_hook(count(n)) for n in names]
    with torch.no_grad():
        model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
    for h in hooks:
        h.remove()
    return {n: z / t for n, (z, t) in counts.items()}


def test_prune_writes_thresholds_and_the_loader_installs_them(workdir, cats_dir):
    from safetensors.torch import load_file

    from sparsekit.runtime.loader import load as load_model

    out, report = cats_dir
    meta = json.loads((out / "sparsekit.json").read_text())
    assert meta["method"] == "cats" and meta["pattern"] == "unstructured" and meta["sparsity"] == 0.5
    assert set(meta["cats"]["mlps"]) == {f"model.layers.{i}.mlp" for i in range(3)}
    for r in meta["cats"]["mlps"].values():
        assert r["threshold"] > 0 and abs(r["activation_sparsity"] - 0.5) < 1e-3
    assert meta["cats"] == report["cats"]
    src, dst = load_file(workdir / "tiny" / "model.safetensors"), load_file(out / "model.safetensors")
    assert src.keys() == dst.keys() and all(torch.equal(src[k], dst[k]) for k in src)  # weights unchanged

    model, _ = load_model(str(out))
    dense, _ = load_model(str(workdir / "tiny"))
    ths = {n: r["threshold"] for n, r in meta["cats"]["mlps"].items()}
    for name, t in ths.items():
        act = model.get_submodule(name).act_fn
        assert isinstance(act, rcats.CatsActivation) and float(act.threshold) == pytest.approx(t)
    ids = calib_ids(workdir, n=2)
    with torch.no_grad():
        got = model(input_ids=ids).logits
        plain = dense(input_ids=ids).logits
        for name, t in ths.items():  # the hand-written masked MLP in the dense model
            mlp = dense.get_submodule(name)
            mlp.forward = lambda x, _m=mlp, _t=t: masked_mlp_forward(_m, x, _t)
        ref = dense(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert (got - plain).abs().max() > 1e-2


def test_encode_keeps_thresholds_and_load_packed_installs_them(workdir, cats_dir, tmp_path):
    from sparsekit.runtime.loader import load as load_model
    from sparsekit.packed.encoding import encode

    out, report = cats_dir
    encode(out, tmp_path / "packed")
    assert json.loads((tmp_path / "packed" / "sparsekit.json").read_text())["cats"] == report["cats"]
    model, _ = load_model(str(tmp_path / "packed"), device="cpu", dtype="float32")
    for name, r in report["cats"]["mlps"].items():
        act = model.get_submodule(name).act_fn
        assert isinstance(act, rcats.CatsActivation) and float(act.threshold) == pytest.approx(r["threshold"])


def test_mismatched_thresholds_are_refused(tmp_path):
    model = make_model("llama")
    with pytest.raises(SparsekitError, match="not a gated MLP"):
        rcats.install_thresholds(model, {"model.layers.7.mlp": 0.1})
    with pytest.raises(SparsekitError, match="malformed"):
        cats.thresholds_from_metadata({"cats": {"mlps": {"model.layers.0.mlp": 0.1}}})
    (tmp_path / "sparsekit.json").write_text("{not json")
    with pytest.raises(SparsekitError, match="sparsekit.json"):
        rcats.install_from_checkpoint(model, tmp_path)


# ----------------------------------------------------------------------------- CLI
def test_cli_prune_cats_json_and_table(workdir):
    args = ["prune", str(workdir / "tiny"), "--method", "cats", "--sparsity", "0.3", "--calib",
            str(workdir / "calib.txt"), "--nsamples", "2", "--seqlen", "64", "--device", "cpu"]
    res = runner.invoke(app, args + ["-o", str(workdir / "cli30"), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["method"] == "cats" and rep["cats"]["target"] == 0.3
    assert all(abs(r["activation_sparsity"] - 0.3) < 2e-3 for r in rep["cats"]["mlps"].values())
    assert json.loads((workdir / "cli30" / "sparsekit.json").read_text())["cats"] == rep["cats"]
    res = runner.invoke(app, args + ["-o", str(workdir / "cli30t")])
    assert res.exit_code == 0, res.output
    assert "CATS thresholds per gated MLP" in res.stdout and "model.layers.2.mlp" in res.stdout


@pytest.mark.parametrize("extra, model, match", [
    ([], "gpt2", "gated MLP"),
    (["--pattern", "2:4"], "tiny", "pattern 2:4"),
    (["--pattern", "hybrid"], "tiny", "pattern hybrid"),
    (["--sparsity", "1.0"], "tiny", "out of range"),
    (["--sparsity", "-0.1"], "tiny", "out of range"),
    (["--prune-lm-head"], "tiny", "lm_head"),
    (["--skip", "*.mlp"], "tiny", "left after --skip"),
])
def test_cli_cats_refusals_are_one_line(workdir, extra, model, match):
    out = workdir / "refused"
    res = runner.invoke(app, ["prune", str(workdir / model), "--method", "cats", "--calib", str(workdir / "calib.txt"),
                              "--nsamples", "2", "--seqlen", "64", "--device", "cpu", "-o", str(out), *extra])
    assert res.exit_code == 2, res.output
    assert match in res.stderr and len(res.stderr.strip().splitlines()) == 1 and res.stdout == ""
    assert not out.exists()


def test_cats_recipe_and_help():
    from pathlib import Path

    from sparsekit.pruning.recipes import resolve_settings

    s = resolve_settings(Path(__file__).resolve().parents[1] / "recipes" / "cats-unstructured50.yaml")
    assert (s.method, s.pattern, s.sparsity) == ("cats", "unstructured", 0.5)
    with pytest.raises(SparsekitError, match="does not apply"):
        resolve_settings(None, method="cats", pattern="4:8")
    res = runner.invoke(app, ["prune", "--help"])
    assert res.exit_code == 0 and "cats" in res.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_matches_cpu_and_leaves_the_model_on_the_cpu(workdir):
    """On CUDA (layers visit the GPU one at a time, thresholds are made there) the thresholds
    match the CPU run's and every tensor of the model, the new threshold buffers included, ends
    back on the CPU; the weights are unchanged."""
    from sparsekit.pruning.engine import prune_model
    from sparsekit.hf.models import load_model

    ids = calib_ids(workdir)
    cpu, _ = load_model(str(workdir / "tiny"))
    gpu, _ = load_model(str(workdir / "tiny"))
    before = {k: v.clone() for k, v in gpu.state_dict().items()}
    rc = prune_model(cpu, ids, method="cats", sparsity=0.5, pattern="unstructured", device="cpu")
    rg = prune_model(gpu, ids, method="cats", sparsity=0.5, pattern="unstructured", device="cuda")
    assert rc["cats"].keys() == rg["cats"].keys()
    for name in rc["cats"]:
        assert rg["cats"][name]["threshold"] == pytest.approx(rc["cats"][name]["threshold"], rel=1e-3)
        assert abs(rg["cats"][name]["activation_sparsity"] - 0.5) < 1e-2
    assert all(t.device.type == "cpu" for t in list(gpu.parameters()) + list(gpu.buffers()))
    assert all(torch.equal(v, gpu.state_dict()[k]) for k, v in before.items())
    for name in rg["cats"]:  # the model is left as it was: the thresholds were hooks, removed
        act = gpu.get_submodule(name).act_fn
        assert not isinstance(act, rcats.CatsActivation) and not act._forward_hooks
    rcats.install_thresholds(gpu, {n: r["threshold"] for n, r in rg["cats"].items()})
    got = activation_sparsity(gpu, ids, rg["cats"])  # on the CPU, with the thresholds calibrated on CUDA
    assert all(abs(got[n] - 0.5) < 1e-2 for n in got)
    for name in rg["cats"]:
        assert float(gpu.get_submodule(name).act_fn.threshold) == pytest.approx(rg["cats"][name]["threshold"])


def test_speed_loader_installs_thresholds_of_an_unpacked_checkpoint(cats_dir):
    """`sparsekit eval --speed` on the pruned (not packed) directory measures the CATS model: it opens
    it through the one loader."""
    from sparsekit.runtime.loader import open_model

    out, report = cats_dir
    model = open_model(out, torch.device("cpu"), torch.float32)
    for name, r in report["cats"]["mlps"].items():
        act = model.get_submodule(name).act_fn
        assert isinstance(act, rcats.CatsActivation) and float(act.threshold) == pytest.approx(r["threshold"])


def test_pruning_a_cats_checkpoint_keeps_its_thresholds_in_force(workdir, cats_dir, tmp_path):
    """A weight method pruning a CATS checkpoint sees the thresholded activations (as the runtime runs the
    model): the weights equal those of the engine run on the model with CatsActivation installed."""
    import sparsekit
    from sparsekit.hf.models import load_model
    from sparsekit.pruning import engine
    from sparsekit.pruning.methods import METHODS
    from sparsekit.pruning.patterns import Pattern
    from safetensors.torch import load_file

    src, _ = cats_dir
    sparsekit.prune(str(src), method="wanda", sparsity=0.5, calib=str(workdir / "calib.txt"), nsamples=4,
                    seqlen=64, device="cpu", output=tmp_path / "w", warn=lambda m: None)
    got = load_file(tmp_path / "w" / "model.safetensors")

    def engine_weights(with_thresholds: bool):
        model, _ = load_model(str(src), device="cpu")
        if with_thresholds:
            assert rcats.install_from_checkpoint(model, src) > 0
        engine.prune_model(model, calib_ids(workdir), method=METHODS["wanda"], sparsity=0.5,
                           pattern=Pattern.parse("unstructured"), skip=["lm_head"], device="cpu", warn=lambda m: None)
        return {k: v for k, v in model.state_dict().items() if k.endswith("proj.weight")}

    want, plain = engine_weights(True), engine_weights(False)
    assert want.keys() and all(torch.equal(got[k].to(v.dtype), v) for k, v in want.items())
    assert any(not torch.equal(want[k], plain[k]) for k in want)  # the thresholds change the masks
