"""CATS stacked on weight sparsity (`sparsekit prune --method wanda --sparsity 0.5 --cats 0.5`): the
weights are pruned first, then each layer's thresholds are calibrated on the pruned model with the
earlier layers pruned and thresholded; the activation sparsity reached on the calibration data is
within 1% of the target for every MLP; sparsekit.json, encode and the loader keep both; eval reports
the activation sparsity reached on its text; bad combinations are refused with one line."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.errors import SparsekitError
from sparsekit.runtime import cats as rcats
from tiny_models import make_model, make_workdir

runner = CliRunner()
NSAMPLES, SEQLEN = 8, 128  # 1024 tokens x 128 gate activations per MLP


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("stacked"), llama="tiny")


@pytest.fixture(scope="module")
def stacked(workdir):
    """The tiny Llama through ``sparsekit.prune(method="wanda", sparsity=0.5, cats=0.5)``."""
    import sparsekit

    out = workdir / "wanda50-cats50"
    report = sparsekit.prune(str(workdir / "tiny"), method="wanda", sparsity=0.5, cats=0.5,
                             calib=str(workdir / "calib.txt"), nsamples=NSAMPLES, seqlen=SEQLEN, device="cpu",
                             output=out, warn=lambda m: None)
    return out, report


def calib_ids(workdir, n=NSAMPLES, seqlen=SEQLEN):
    from sparsekit.hf.data import calibration_windows
    from sparsekit.hf.models import load_tokenizer

    return calibration_windows(str(workdir / "calib.txt"), load_tokenizer(str(workdir / "tiny")),
                               nsamples=n, seqlen=seqlen, seed=0)


def zero_fractions(model, ids) -> dict[str, float]:
    """Each CatsActivation's fraction of zeros over one forward of ``ids`` (counted by the runtime)."""
    with torch.no_grad(), rcats.counting_zeros(model) as zeros:
        model(input_ids=ids, use_cache=False)
        return zeros.fractions()


def mlp_quantile(model, layer: int, ids, k: float) -> float:
    seen = []
    h = model.model.layers[layer].mlp.act_fn.register_forward_hook(lambda m, i, o: seen.append(o.abs().reshape(-1)))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    h.remove()
    return torch.quantile(torch.cat(seen), k).item()


# ----------------------------------------------------------------------------- calibration order
def test_thresholds_are_calibrated_on_the_pruned_and_thresholded_model(workdir, stacked):
    """Layer i's threshold is the 50% quantile of its activations in the *saved* (pruned) model with
    the thresholds of layers < i installed; not that of the dense model, nor of the pruned one without
    thresholds. The weights are those of plain Wanda for layer 0 (which sees the dense inputs either
    way) and differ later (Wanda's statistics there see thresholded inputs)."""
    from safetensors.torch import load_file

    from sparsekit.hf.models import load_model
    from sparsekit.pruning.engine import prune_model
    from sparsekit.pruning.patterns import Pattern

    out, report = stacked
    ids = calib_ids(workdir)
    th = {n: r["threshold"] for n, r in report["cats"]["mlps"].items()}
    assert list(th) == [f"model.layers.{i}.mlp" for i in range(3)]
    pruned, _ = load_model(str(out))  # plain HF load: weights only, no thresholds
    dense, _ = load_model(str(workdir / "tiny"))
    unthresholded = [mlp_quantile(pruned, i, ids, 0.5) for i in range(3)]
    for i in range(3):
        name = f"model.layers.{i}.mlp"
        assert mlp_quantile(pruned, i, ids, 0.5) == pytest.approx(th[name], rel=1e-5)
        assert mlp_quantile(dense, i, ids, 0.5) != pytest.approx(th[name], rel=1e-3)
        if i:
            assert unthresholded[i] != pytest.approx(th[name], rel=1e-4)
        rcats.apply_threshold(pruned.model.layers[i].mlp, th[name])

    plain, _ = load_model(str(workdir / "tiny"))
    prune_model(plain, ids, method="wanda", sparsity=0.5, pattern=Pattern.parse("unstructured"), device="cpu")
    a, b = load_file(out / "model.safetensors"), plain.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if ".layers.0." in k)
    assert any(not torch.equal(a[k], b[k]) for k in a if ".layers.2." in k and k.endswith("proj.weight"))


def test_sparsekit_json_records_both(stacked):
    out, report = stacked
    meta = json.loads((out / "sparsekit.json").read_text())
    assert (meta["method"], meta["pattern"], meta["sparsity"]) == ("wanda", "unstructured", 0.5)
    assert meta["layers"] and all(abs(r["sparsity"] - 0.5) < 1e-6 for r in meta["layers"].values())
    assert meta["cats"]["target"] == 0.5 and set(meta["cats"]["mlps"]) == {f"model.layers.{i}.mlp" for i in range(3)}
    assert meta["cats"] == report["cats"]
    assert report["settings"]["cats"] == 0.5


# ----------------------------------------------------------------------------- acceptance: +-1% per MLP
@pytest.mark.parametrize("method, pattern, sparsity, cats, sample", [
    ("wanda", "unstructured", 0.5, 0.5, None),       # every value: the exact quantile
    ("sparsegpt", "2:4", None, 0.7, 2**14),          # a seeded sample of 16k of the 131k values
    ("magnitude", "unstructured", 0.5, 0.3, 2**14),  # magnitude reads no data; stacked CATS does
    ("cats", "unstructured", 0.5, None, 2**14),      # CATS alone
])
def test_activation_sparsity_on_the_calibration_data_is_within_one_percent(workdir, method, pattern, sparsity,
                                                                          cats, sample):
    """The acceptance check: with the thresholds installed by the runtime, every gated MLP zeroes the
    target fraction of its activations on the calibration windows, +-1%; the engine's report (what
    sparsekit.json records) says the same."""
    from sparsekit.hf.models import load_model
    from sparsekit.pruning.engine import prune_model
    from sparsekit.pruning.patterns import Pattern

    ids = calib_ids(workdir)
    model, _ = load_model(str(workdir / "tiny"))
    report = prune_model(model, ids, method=method, sparsity=0.5 if sparsity is None else sparsity,
                         pattern=Pattern.parse(pattern), device="cpu", cats=cats, cats_sample_size=sample,
                         warn=lambda m: None)
    target = 0.5 if cats is None else cats
    assert len(report["cats"]) == 3
    if method != "cats":
        assert all(abs(r["sparsity"] - 0.5) < 1e-6 for r in report["layers"].values())
    rcats.install_thresholds(model, {n: r["threshold"] for n, r in report["cats"].items()})
    got = zero_fractions(model, ids)
    assert got.keys() == report["cats"].keys()
    for name, r in report["cats"].items():
        assert r["exact"] == (sample is None)
        assert abs(got[name] - target) <= 0.01, (name, got[name])
        assert abs(r["activation_sparsity"] - target) <= 0.01
        assert got[name] == pytest.approx(r["activation_sparsity"], abs=1e-4)


# ----------------------------------------------------------------------------- encode, load, eval
@pytest.mark.filterwarnings("ignore:no CUDA GPU")
def test_encode_keeps_both_and_the_loader_installs_thresholds_on_the_packed_model(workdir, stacked, tmp_path):
    from sparsekit.evaluation.ppl import perplexity
    from sparsekit.packed.encoding import encode
    from sparsekit.runtime.loader import load
    from sparsekit.runtime.sparse_linear import SparseLinear

    out, report = stacked
    rep = encode(out, tmp_path / "packed")
    assert rep["packed_layers"] == 21  # 3 layers x 7 linears, all at 50%
    meta = json.loads((tmp_path / "packed" / "sparsekit.json").read_text())
    assert meta["method"] == "wanda" and meta["cats"] == report["cats"]

    packed, tok = load(str(tmp_path / "packed"), device="cpu", dtype="float32")
    dense_dir, _ = load(str(out), device="cpu", dtype="float32")
    with torch.no_grad():  # encode packs the fp32 checkpoint in fp16: the same rounding for the reference
        for param in dense_dir.parameters():
            param.copy_(param.half().float())
    assert sum(isinstance(m, SparseLinear) for m in packed.modules()) == 21
    for model in (packed, dense_dir):
        acts = rcats.cats_activations(model)
        assert {n: float(a.threshold) for n, a in acts.items()} == pytest.approx(
            {n: r["threshold"] for n, r in report["cats"]["mlps"].items()})
    ids = calib_ids(workdir, n=2)
    with torch.no_grad():
        torch.testing.assert_close(packed(input_ids=ids).logits, dense_dir(input_ids=ids).logits, rtol=1e-4, atol=1e-4)

    text = (workdir / "calib.txt").read_text()
    p = perplexity(packed, tok, text, seqlen=SEQLEN, max_windows=4)
    d = perplexity(dense_dir, tok, text, seqlen=SEQLEN, max_windows=4)
    assert p["ppl"] == pytest.approx(d["ppl"], rel=1e-4)
    act = p["activation_sparsity"]
    assert act["mlps"] == pytest.approx(d["activation_sparsity"]["mlps"], abs=1e-3)
    assert set(act["mlps"]) == set(report["cats"]["mlps"]) and all(0.3 < v < 0.7 for v in act["mlps"].values())
    assert act["mean"] == pytest.approx(sum(act["mlps"].values()) / 3)
    assert not rcats.cats_activations(packed)["model.layers.0.mlp"].values  # counters dropped after the pass


def test_zero_counts_are_the_zeros_output_and_roll_back():
    model = make_model("llama")
    mlp = model.model.layers[0].mlp
    x = torch.randn(3, 5, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        t = float(torch.nn.functional.silu(mlp.gate_proj(x)).abs().quantile(0.4))
        act = rcats.apply_threshold(mlp, t)
        assert act.zeros is None  # not counting outside the block
        with rcats.counting_zeros(model) as zeros:
            want = int((act(mlp.gate_proj(x)) == 0).sum())
            zeros.mark()
            mlp(x)  # counted, then forgotten
            zeros.rollback()
            assert zeros.fractions() == {"model.layers.0.mlp": pytest.approx(want / x[..., :1].numel() / 128)}
        assert act.zeros is None and act.values == 0
        with rcats.counting_zeros(make_model("llama")) as none:
            assert none.fractions() == {}


def test_eval_ppl_reports_activation_sparsity(workdir, stacked):
    out, _ = stacked
    args = ["eval", str(out), "--ppl", "--dataset", str(workdir / "calib.txt"), "--seqlen", "128",
            "--max-windows", "2", "--device", "cpu"]
    res = runner.invoke(app, args + ["--json"])
    assert res.exit_code == 0, res.output
    act = json.loads(res.stdout)["ppl"]["activation_sparsity"]
    assert act["target"] == 0.5 and len(act["mlps"]) == 3 and 0.3 < act["mean"] < 0.7
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "CATS activation sparsity on this text" in res.stdout
    res = runner.invoke(app, ["eval", str(workdir / "tiny"), "--ppl", *args[3:], "--json"])
    assert res.exit_code == 0 and "activation_sparsity" not in json.loads(res.stdout)["ppl"]


# ----------------------------------------------------------------------------- speed plumbing (CPU)
def test_speed_puts_back_the_dense_mlps():
    """eval --speed's dense twin: the original MLP modules back in place, thresholds removed; on the
    CPU (or without the CATS kernel module) no MLP goes onto a kernel."""
    from sparsekit.evaluation.speed import enable_cats, restore_dense_mlps
    from sparsekit.hf.modules import set_submodule

    model = make_model("llama")
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = model(input_ids=ids).logits
        rcats.install_thresholds(model, {f"model.layers.{i}.mlp": 0.05 for i in range(3)})
        originals = {n: model.get_submodule(n) for n in rcats.cats_activations(model)}
        notes: list[str] = []
        assert enable_cats(model, notes) == 0 and notes == []
        assert not torch.allclose(model(input_ids=ids).logits, dense)
        set_submodule(model, "model.layers.1.mlp", torch.nn.Identity())  # as a kernel module would stand in
        assert restore_dense_mlps(model, originals) == 3
        assert all(model.get_submodule(n) is m for n, m in originals.items())
        assert rcats.cats_activations(model) == {}
        torch.testing.assert_close(model(input_ids=ids).logits, dense, rtol=0, atol=0)


# ----------------------------------------------------------------------------- CLI, recipes, refusals
def test_cli_prune_stacked_json_and_tables(workdir):
    args = ["prune", str(workdir / "tiny"), "--method", "sparsegpt", "--pattern", "2:4", "--cats", "0.5",
            "--calib", str(workdir / "calib.txt"), "--nsamples", "2", "--seqlen", "64", "--device", "cpu"]
    res = runner.invoke(app, args + ["-o", str(workdir / "sg24c"), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert (rep["method"], rep["pattern"], rep["cats"]["target"]) == ("sparsegpt", "2:4", 0.5)
    assert rep["overall_sparsity"] == pytest.approx(0.5) and len(rep["cats"]["mlps"]) == 3
    res = runner.invoke(app, args + ["-o", str(workdir / "sg24ct")])
    assert res.exit_code == 0, res.output
    for text in ("sparsity by module type", "CATS thresholds per gated MLP", "calibrated on the pruned weights"):
        assert text in res.stdout


@pytest.mark.parametrize("extra, model, match", [
    (["--method", "cats", "--cats", "0.5"], "tiny", "drop --cats"),
    (["--method", "wanda", "--cats", "0.5"], "gpt2", "gated MLP"),
    (["--method", "wanda", "--cats", "1.0"], "tiny", "out of range"),
    (["--method", "wanda", "--cats", "0.5", "--skip", "*.mlp"], "tiny", "left after --skip"),
])
def test_cli_stacked_refusals_are_one_line(workdir, extra, model, match):
    out = workdir / "refused"
    res = runner.invoke(app, ["prune", str(workdir / model), "--calib", str(workdir / "calib.txt"),
                              "--nsamples", "2", "--seqlen", "64", "--device", "cpu", "-o", str(out), *extra])
    assert res.exit_code == 2, res.output
    assert match in res.stderr and len(res.stderr.strip().splitlines()) == 1 and res.stdout == ""
    assert not out.exists()
    if model == "gpt2":
        assert "drop --cats" in res.stderr


def test_recipes_ask_for_both(tmp_path):
    from sparsekit.pruning.api import default_output
    from sparsekit.pruning.recipes import resolve_settings

    s = resolve_settings("wanda-unstructured50-cats50")
    assert (s.method, s.pattern, s.sparsity, s.cats) == ("wanda", "unstructured", 0.5, 0.5)
    assert s.as_dict()["cats"] == 0.5 and resolve_settings(None).cats is None
    assert resolve_settings("wanda-unstructured50-cats50", cats=0.7).cats == 0.7  # the flag wins
    for text, match in (('method: cats\ncats: 0.5\n', "drop --cats"), ('method: wanda\ncats: half\n', "a number"),
                        ('method: wanda\ncats: true\n', "a number")):
        p = tmp_path / "r.yaml"
        p.write_text(text)
        with pytest.raises(SparsekitError, match=match):
            resolve_settings(p)
    assert str(default_output("m", "wanda", "2:4", 0.5, 0.5)) == "out/m-wanda-2of4-cats50"
    assert resolve_settings(None, method="magnitude", cats=0.3).ignored_calibration(nsamples=4) is None
    res = runner.invoke(app, ["recipes", "--json"])
    listed = {r["name"]: r["cats"] for r in json.loads(res.stdout)}
    assert listed["wanda-unstructured50-cats50"] == 0.5 and listed["wanda-unstructured50"] is None
    assert "+ cats 0.5" in runner.invoke(app, ["recipes"]).stdout


# ----------------------------------------------------------------------------- the demo script
def test_demo_script_smoke(tmp_path, capsys, monkeypatch):
    """scripts/demos/cats.py --smoke: every row on a tiny random Llama on the CPU; the markdown table,
    the commands and the JSON summary come out, the calibration check passes, CATS 0% is the dense
    model, and the packed rows score as their unpacked checkpoints."""
    import runpy
    import sys

    from conftest import REPO

    monkeypatch.setattr(sys, "argv", ["cats.py", "--smoke", "--out", str(tmp_path), "--json", str(tmp_path / "s.json")])
    monkeypatch.syspath_prepend(str(REPO))   # as `python -m scripts.demos.cats` from the repository root
    with pytest.raises(SystemExit) as done:
        runpy.run_module("scripts.demos.cats", run_name="__main__", alter_sys=True)
    printed = capsys.readouterr().out
    assert done.value.code == 0, printed
    summary = json.loads(printed.strip().splitlines()[-1])
    assert json.loads((tmp_path / "s.json").read_text())["ok"] is True
    rows = {r["row"]: r for r in summary["rows"]}
    assert list(rows) == ["dense", "cats0", "cats30", "cats50", "cats70", "wanda50-cats50", "sparsegpt50-cats50",
                          "wanda50-cats50.tcabme", "sparsegpt50-cats50.tcabme"]
    assert rows["cats0"]["ppl"] == pytest.approx(rows["dense"]["ppl"], rel=1e-4)
    for name in ("wanda50-cats50", "sparsegpt50-cats50"):
        assert rows[name + ".tcabme"]["ppl_vs_unpacked"] == pytest.approx(1.0, abs=0.01)
        assert len(rows[name]["eval_activation_sparsity"]["per_mlp"]) == 3
    assert "| row | weights | CATS |" in printed and "--method wanda --sparsity 0.5 --cats 0.5" in printed
    assert "sparsekit encode" in printed and "PASS" in printed
