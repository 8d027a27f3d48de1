"""Learned masks (``prune --learn-mask``) and tile allocation, on a tiny Llama on the CPU.

Checks the definitions: every tile of a hybrid layer is dense or valid 2:4 and the overall sparsity
is on target; learning lowers the calibration loss below the one-shot mask's at equal sparsity; a
resumed run is bit-identical to the uninterrupted one; global allocation meets its global target;
encode's default rule packs a 35% hybrid layer.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.errors import SparsekitError
from sparsekit.pruning.api import prune
from sparsekit.pruning.learn.allocation import select_tiles
from sparsekit.pruning.learn.choices import CHOICES, choice_index
from sparsekit.pruning.learn.schedule import noise_scale, temperature
from sparsekit.pruning.patterns import n_sparse_tiles, nm_mask
from tiny_models import save_tiny, write_corpus

TILE = 8
COMMON = dict(nsamples=8, seqlen=64, device="cpu", overwrite=True, warn=lambda m: None)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny ops: threads only add synchronization
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("learn")
    save_tiny("llama", d / "tiny")
    write_corpus(d / "calib.txt")
    return d


def _prune(work, out, **kw):
    return prune(str(work / "tiny"), calib=str(work / "calib.txt"), output=work / out, **{**COMMON, **kw})


@pytest.fixture(scope="module")
def learned(work):
    rep = _prune(work, "learned", method="wanda", pattern=f"hybrid:{TILE}", sparsity=0.35, seed=3,
                 learn=dict(steps=24, lr=0.3, batch_size=4, checkpoint_every=12))
    return rep


def _linears(path):
    meta = json.loads((path / "sparsekit.json").read_text())
    w = load_file(str(path / "model.safetensors"))
    return meta, {n: w[f"{n}.weight"].float() for n in meta["layers"]}


def _tile_kinds(w: torch.Tensor, tile: int) -> tuple[int, int]:
    """(dense tiles, 2:4 tiles) of ``w``; fails on a tile that is neither."""
    r, c = w.shape
    nz = (w != 0).reshape(r // tile, tile, c // tile, tile).permute(0, 2, 1, 3)
    dense = nz.all(-1).all(-1)
    per_group = nz.reshape(*nz.shape[:3], tile // 4, 4).sum(-1)
    two_four = (per_group == 2).all(-1).all(-1)
    assert bool((dense | two_four).all()), "a tile is neither dense nor 2:4"
    return int(dense.sum()), int(two_four.sum())


def _overall(layers: dict[str, torch.Tensor]) -> float:
    return sum(int((w == 0).sum()) for w in layers.values()) / sum(w.numel() for w in layers.values())


def _calib_loss(work, path) -> float:
    from sparsekit.evaluation.ppl import perplexity_of_windows
    from sparsekit.hf.data import calibration_windows
    from sparsekit.hf.models import load_model

    model, tok = load_model(str(path), device="cpu", dtype=torch.float32)
    ids = calibration_windows(str(work / "calib.txt"), tok, nsamples=8, seqlen=64, seed=3)
    return perplexity_of_windows(model, ids)["nll"]


def test_choices_and_tile_selection():
    scores = torch.rand(8, 16)
    idx = choice_index(nm_mask(scores, 2, 4))
    assert torch.equal((CHOICES[idx].reshape(8, 16) > 0), nm_mask(scores, 2, 4))
    pref = {"a": torch.randn(4, 4), "b": torch.randn(2, 8) + 3}
    for alloc in ("layer", "global"):
        sparse, thr = select_tiles(pref, 0.3, alloc)
        if alloc == "layer":
            assert all(int(sparse[n].sum()) == n_sparse_tiles(16, 0.3) for n in pref)
        else:
            assert sum(int(s.sum()) for s in sparse.values()) == n_sparse_tiles(32, 0.3)
        for n in pref:  # the threshold separates chosen from unchosen tiles
            assert bool((pref[n][sparse[n]] > thr[n]).all()) and bool((pref[n][~sparse[n]] < thr[n]).all())
    assert temperature(0, 10, (1.0, 0.1)) == 1.0 and math.isclose(temperature(9, 10, (1.0, 0.1)), 0.1)
    assert noise_scale(0, 10, (1.0, 0.0)) == 1.0 and noise_scale(9, 10, (1.0, 0.0)) == 0.0


@pytest.mark.parametrize("tile", [0, 8])
def test_mask_bank_layout(tile):
    """The flat bank (tile-major for hybrid) maps back to each linear's own [R, C] layout."""
    from sparsekit.pruning.learn.choices import MaskBank, apply_tiles, expand_tiles

    shapes = {"a": (16, 32), "b": (8, 24 if not tile else 16)}
    bank = MaskBank(shapes, tile)
    choice = {n: torch.randint(0, 6, (r, c // 4)) for n, (r, c) in shapes.items()}
    values = torch.cat([CHOICES[bank.to_bank(n, choice[n])] for n in shapes])
    ind = torch.cat([torch.rand(r // tile, c // tile).round().reshape(-1) for r, c in shapes.values()]) if tile else None
    if tile:
        values = apply_tiles(values, ind, tile)
    for n, (r, c) in shapes.items():
        want = CHOICES[choice[n]].reshape(r, c)
        if tile:
            t = expand_tiles(bank.tile_view(n, ind), tile)
            want = 1 - t * (1 - want)
        assert torch.equal(bank.element_mask(n, values), want)


def test_heldout_windows_come_from_unseen_text(work):
    from sparsekit.hf.data import calibration_text, tokenize
    from sparsekit.hf.models import open_tokenizer
    from sparsekit.pruning.learn.data import learning_windows

    tok = open_tokenizer(str(work / "tiny"))
    ids = tokenize(tok, calibration_text(str(work / "calib.txt")))
    w = learning_windows(str(work / "calib.txt"), tok, 16, 32, 0, 2)
    cut = int(ids.numel() * (1 - 2 / 16))
    all_windows = ids.unfold(0, 32, 1)  # every window of the stream, by start
    starts = [int(((all_windows == row).all(1)).nonzero()[0]) for row in w]
    assert all(s + 32 <= cut for s in starts[:14]) and all(s >= cut for s in starts[14:])


def test_learned_hybrid_tiles_and_sparsity(work, learned):
    meta, layers = _linears(work / "learned")
    for w in layers.values():
        _tile_kinds(w, TILE)
    assert abs(_overall(layers) - 0.35) < 0.005
    lm = meta["learning"]
    assert lm["steps"] == 24 and lm["init"] == "wanda" and lm["allocation"] == "layer"
    assert lm["loss"]["steps"] == 24 and len(lm["loss"]["curve"]) == lm["loss"]["curve_points"]
    assert lm["temperature_schedule"]["temperature"]["start"] > lm["temperature_schedule"]["temperature"]["end"]
    assert (lm["noise"], lm["prior"]) == ([0.5, 0.0], 3.0)   # hybrid's own defaults, as recorded


def test_learned_mask_beats_one_shot(work, learned):
    cl = learned["learning"]["calibration_loss"]
    assert cl["learned_mask"] < cl["init"]
    _prune(work, "oneshot", method="wanda", pattern=f"hybrid:{TILE}", sparsity=0.35, seed=3)
    _, one = _linears(work / "oneshot")
    assert abs(_overall(one) - _overall(_linears(work / "learned")[1])) < 1e-3  # equal sparsity
    assert _calib_loss(work, work / "learned") < _calib_loss(work, work / "oneshot")


def test_zero_steps_is_the_one_shot_prune(work):
    """The layer loop learning starts from gives exactly the engine's one-shot SparseGPT hybrid."""
    _prune(work, "eng", method="sparsegpt", pattern=f"hybrid:{TILE}", sparsity=0.25)
    rep = _prune(work, "zero", method="sparsegpt", pattern=f"hybrid:{TILE}", sparsity=0.25, learn=dict(steps=0))
    assert rep["learning"]["steps"] == 0
    a, b = load_file(str(work / "eng" / "model.safetensors")), load_file(str(work / "zero" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_is_bit_identical(work, learned):
    ckpt = work / "learned-checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000012.pt"]
    rep = _prune(work, "resumed", method="wanda", pattern=f"hybrid:{TILE}", sparsity=0.35, seed=3,
                 learn=dict(steps=24, lr=0.3, batch_size=4, checkpoint_every=12, resume=True, checkpoint_dir=str(ckpt)))
    assert rep["learning"]["resumed_from"].endswith("step-000012.pt")
    a, b = load_file(str(work / "learned" / "model.safetensors")), load_file(str(work / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert rep["learning"]["loss"] == learned["learning"]["loss"]
    with pytest.raises(SparsekitError, match="another run"):  # a different run refuses the checkpoint
        _prune(work, "other", method="wanda", pattern=f"hybrid:{TILE}", sparsity=0.35, seed=4,
               learn=dict(steps=24, lr=0.3, batch_size=4, resume=True, checkpoint_dir=str(ckpt)))


def test_global_allocation_meets_global_target(work):
    rep = _prune(work, "global", method="wanda", pattern=f"hybrid:{TILE}", sparsity=0.3, allocation="global")
    meta, layers = _linears(work / "global")
    for w in layers.values():
        _tile_kinds(w, TILE)
    assert abs(_overall(layers) - 0.3) < 0.005
    assert meta["learning"]["allocation"] == "global" and meta["learning"]["steps"] == 0
    per = sorted(float((w == 0).float().mean()) for w in layers.values())
    assert per[-1] - per[0] > 0.05  # linears differ: the ranking is global
    assert rep["settings"]["allocation"] == "global"
    # SparseGPT with the same global ranking: its sweep picks 2:4 inside the tiles the ranking chose
    _prune(work, "global-sgpt", method="sparsegpt", pattern=f"hybrid:{TILE}", sparsity=0.3, allocation="global")
    _, sg = _linears(work / "global-sgpt")
    assert sum(_tile_kinds(w, TILE)[1] for w in sg.values()) == sum(_tile_kinds(w, TILE)[1] for w in layers.values())
    assert abs(_overall(sg) - 0.3) < 0.005
    # learning from the global allocation keeps the global target
    rep = _prune(work, "global-learned", method="wanda", pattern=f"hybrid:{TILE}", sparsity=0.3, allocation="global",
                 learn=dict(steps=3, batch_size=2, distill=True))
    assert rep["learning"]["distill"] and math.isfinite(rep["learning"]["loss"]["last"])
    _, layers = _linears(work / "global-learned")
    assert abs(_overall(layers) - 0.3) < 0.005


def test_pattern_defaults_fill_only_what_is_unset():
    from sparsekit.pruning.learn import LearnConfig
    from sparsekit.pruning.patterns import Pattern

    c24, chy = (LearnConfig().for_pattern(Pattern.parse(p)) for p in ("2:4", "hybrid"))
    assert (c24.noise, c24.prior) == ((1.0, 0.0), 4.0) and (chy.noise, chy.prior) == ((0.5, 0.0), 3.0)
    mine = LearnConfig(noise=(0.2, 0.1), prior=2.0).for_pattern(Pattern.parse("2:4"))
    assert (mine.noise, mine.prior) == ((0.2, 0.1), 2.0)
    with pytest.raises(SparsekitError, match="noise schedule"):
        LearnConfig(noise=(-1.0, 0.0))


def test_learned_2of4_with_sparsegpt_update(work):
    said = []
    rep = _prune(work, "l24", method="sparsegpt", pattern="2:4", learn=dict(steps=3, batch_size=2, weight_update=True),
                 warn=said.append)
    assert rep["learning"]["weight_update"] is True
    assert (rep["learning"]["noise"], rep["learning"]["prior"]) == ([1.0, 0.0], 4.0)   # 2:4's own defaults
    assert sum("weight update after --learn-mask" in m for m in said) == 1   # said once, in one line
    assert all("\n" not in m for m in said)
    _, layers = _linears(work / "l24")
    dense = load_file(str(work / "tiny" / "model.safetensors"))
    changed = 0
    for n, w in layers.items():
        g = (w != 0).reshape(w.shape[0], -1, 4).sum(-1)
        assert bool((g == 2).all())
        d = dense[f"{n}.weight"].float()
        changed += int(((w != d) & (w != 0)).sum())
    assert changed > 0  # the kept weights were updated


def test_encode_default_packs_35pct_hybrid(work, learned):
    from sparsekit.packed.encoding import encode

    rep = encode(work / "learned", work / "learned.tcabme", overwrite=True)
    assert rep["packed_layers"] == rep["layers"] > 0
    assert all("dense bytes" in i["reason"] for i in rep["per_layer"].values())
    assert rep["ratio"] < 0.8


def test_cli_learn_mask_and_refusals(work):
    runner = CliRunner()
    base = ["prune", str(work / "tiny"), "--calib", str(work / "calib.txt"), "--nsamples", "4", "--seqlen", "64",
            "--device", "cpu", "--overwrite"]
    res = runner.invoke(app, base + ["--pattern", f"hybrid:{TILE}", "--sparsity", "0.25", "--learn-mask", "--steps", "2",
                                     "--learn-batch", "2", "-o", str(work / "cli"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["learning"]["steps"] == 2
    for extra, msg in ((["--learn-mask"], "hybrid"), (["--pattern", "2:4", "--allocation", "global"], "hybrid"),
                       (["--pattern", "hybrid", "--allocation", "row"], "allocation"), (["--resume"], "--learn-mask")):
        res = runner.invoke(app, base + extra + ["-o", str(work / "bad")])
        assert res.exit_code == 2 and msg in res.output, res.output


def test_demo_script_smoke(tmp_path):
    """scripts/demos/learn_masks.py end to end on a tiny random model (its --smoke mode), run as the
    README says: `python -m scripts.demos.learn_masks` from the repository root."""
    import subprocess
    import sys
    from pathlib import Path

    res = subprocess.run([sys.executable, "-m", "scripts.demos.learn_masks", "--smoke", "--sparsities", "0.35",
                          "--out", str(tmp_path / "w"), "--json", str(tmp_path / "r.json")],
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    rows = {r["row"]: r for r in rep["rows"]}
    assert {"dense", "learned hybrid 0.35", "learned 2:4", "2:4 sparsegpt", "one-shot hybrid wanda 0.35",
            "one-shot hybrid sparsegpt 0.35", "unstructured sparsegpt 0.35"} == set(rows)
    assert abs(rows["learned hybrid 0.35"]["overall_sparsity"] - 0.35) < 0.005
    assert all(math.isfinite(r["ppl"]) for r in rows.values())
    assert "| learned hybrid 0.35 |" in res.stdout


def test_allocation_in_recipes(tmp_path):
    from sparsekit.pruning.recipes import resolve_settings

    p = tmp_path / "r.yaml"
    p.write_text('method: sparsegpt\npattern: "hybrid"\nsparsity: 0.35\nallocation: global\n')
    assert resolve_settings(p).allocation == "global"
    assert resolve_settings(p, allocation="layer").allocation == "layer"  # a flag overrides the recipe
    assert resolve_settings().allocation == "layer"
    with pytest.raises(SparsekitError, match="hybrid"):
        resolve_settings(p, pattern="2:4")
