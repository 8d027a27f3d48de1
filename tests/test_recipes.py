"""Recipes: every shipped file is valid, they cover every method x pattern, bad keys fail clearly,
and explicit settings override the recipe."""
from __future__ import annotations

from pathlib import Path

import pytest

from sparsekit.errors import SparsekitError
from sparsekit.pruning.methods import METHODS
from sparsekit.pruning.recipes import DEFAULTS, load_recipe, resolve_settings
from sparsekit.pruning.settings import PruneSettings

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
PATTERN_OF_TAG = {"unstructured50": ("unstructured", 0.5), "2of4": ("2:4", 0.5), "4of8": ("4:8", 0.5),
                  "hybrid": ("hybrid", 0.25)}
# the issue-23 combinations: -owl (allocation), -dsnot (refine), -admm (update) after the pattern tag
COMBINATIONS = {"wanda-unstructured70-owl", "sparsegpt-unstructured70-owl", "admm-unstructured70-owl",
                "wanda-unstructured50-dsnot", "wanda-2of4-dsnot", "wanda-unstructured50-admm",
                "sparsegpt-2of4-dsnot-admm"}


def test_shipped_recipes_cover_every_method_and_pattern():
    names = {p.stem for p in RECIPES.glob("*.yaml")}
    assert names == ({f"{m}-{t}" for m in METHODS if m != "cats" for t in PATTERN_OF_TAG}
                     | {"cats-unstructured50", "wanda-unstructured50-cats50"} | COMBINATIONS)


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipe_is_valid_and_named_after_its_content(path):
    s = resolve_settings(path)
    method, tag, *extras = path.stem.split("-")
    cats = next((e[4:] for e in extras if e.startswith("cats")), "")  # stacked CATS: -cats<percent>
    assert s.method == method
    assert (s.pattern, s.sparsity) == ({**PATTERN_OF_TAG, "unstructured70": ("unstructured", 0.7)})[tag]
    assert s.cats == (int(cats) / 100 if cats else None)
    assert s.allocation == ("owl" if "owl" in extras else "layer")
    assert s.refine == ("dsnot" if "dsnot" in extras else None)
    assert s.update == ("admm" if "admm" in extras else None)
    if "owl" in extras:
        assert (s.owl_lambda, s.owl_m, s.owl_windows) == (0.08, 5.0, 16)  # the paper's lambda and M
    assert "lm_head" in s.skip


def _write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_flags_override_the_recipe_and_recipe_overrides_defaults(tmp_path):
    p = _write(tmp_path, 'method: sparsegpt\npattern: "4:8"\ncalibration: {nsamples: 16, seed: 3}\n'
                         "skip: [lm_head, '*.down_proj']\nsparsegpt: {damp: 0.05}\n")
    s = resolve_settings(p)
    assert (s.method, s.pattern, s.nsamples, s.seed, s.damp) == ("sparsegpt", "4:8", 16, 3, 0.05)
    assert s.seqlen == DEFAULTS["seqlen"] and s.skip == ["lm_head", "*.down_proj"]
    s = resolve_settings(p, method="wanda", pattern="unstructured", sparsity=0.7, nsamples=8, skip=["lm_head"])
    assert (s.method, s.pattern, s.sparsity, s.nsamples, s.seed) == ("wanda", "unstructured", 0.7, 8, 3)
    assert s.skip == ["lm_head"]
    assert resolve_settings(p, seed=None).seed == 3  # None means "not given"


def test_pattern_flag_nm_over_a_recipe_with_a_sparsity(tmp_path):
    p = _write(tmp_path, 'method: magnitude\npattern: "hybrid:64"\nsparsity: 0.25\n')
    s = resolve_settings(p, pattern="2:4")  # was: "2:4 fixes the sparsity at 0.5, got 0.25: drop --sparsity"
    assert (s.pattern, s.sparsity) == ("2:4", 0.5)
    assert resolve_settings(p, pattern="unstructured").sparsity == 0.25  # a valid recipe value is kept
    with pytest.raises(SparsekitError, match="fixes the sparsity"):
        resolve_settings(p, pattern="2:4", sparsity=0.3)  # an explicit conflicting flag is still an error


def test_null_dataset_in_a_recipe_means_the_default(tmp_path):
    assert resolve_settings(_write(tmp_path, "calibration: {dataset: null}\n")).dataset == "wikitext2"


def test_skip_given_as_one_string_is_one_pattern():
    assert resolve_settings(skip="lm_head").skip == ["lm_head"]  # was ['l', 'm', '_', ...]
    assert resolve_settings(skip=("lm_head", "*.0.*")).skip == ["lm_head", "*.0.*"]


@pytest.mark.parametrize("text,match", [
    ("method: wanda\nsparsty: 0.5\n", "sparsty"),
    ("method: wanda\ncalibration: {nsample: 4}\n", "nsample"),
    ("method: wanda\npattern: 2:4\n", "quote"),
    ("method: prune-harder\n", "unknown method"),
    ("- wanda\n", "mapping"),
    ("method: [wanda\n", "not valid YAML"),
    ("pattern: unstructured\nsparsity: 1.5\n", "out of range"),
    ("calibration: {nsamples: 0}\n", "nsamples"),
    ("calibration: {seed: abc}\n", "seed must be an integer"),
    ("sparsegpt: {damp: lots}\n", "damp must be a number"),
    ("sparsity: half\n", "sparsity"),
    ("calibration: {seed: 99999999999999999999999}\n", "seed .* out of range"),
])
def test_bad_recipes_fail_with_a_clear_message(tmp_path, text, match):
    with pytest.raises(SparsekitError, match=match):
        resolve_settings(_write(tmp_path, text))



@pytest.mark.parametrize("text,match", [
    ("calibration: {nsamples: 2.5}\n", r"nsamples must be an integer, got 2\.5"),
    ("calibration: {seqlen: 64.5}\n", r"seqlen must be an integer, got 64\.5"),
    ("calibration: {seed: 1.5}\n", r"seed must be an integer, got 1\.5"),
    ("sparsegpt: {blocksize: 12.5}\n", r"blocksize must be an integer, got 12\.5"),
    ("calibration: {nsamples: true}\n", "nsamples must be an integer, got True"),
    ("sparsity: true\n", "sparsity must be a number, got True"),
    ("sparsegpt: {damp: true}\n", "damp must be a number, got True"),
    ("", "sets nothing"),
    ("description: only words\n", "sets nothing"),
    ("{}\n", "sets nothing"),
])
def test_recipe_values_are_taken_as_written_or_refused(tmp_path, text, match):
    """Issue 25 item 8: nsamples 2.5 silently became 2, an empty recipe ran on the defaults without a
    word, and sparsity: true said "sparsity 1 is out of range"."""
    with pytest.raises(SparsekitError, match=match):
        resolve_settings(_write(tmp_path, text))


def test_whole_floats_are_integers(tmp_path):
    s = resolve_settings(_write(tmp_path, "calibration: {nsamples: 64.0, seqlen: 128}\n"))
    assert (s.nsamples, s.seqlen) == (64, 128) and isinstance(s.nsamples, int)

def test_missing_recipe_file():
    with pytest.raises(SparsekitError, match="not found"):
        load_recipe("recipes/does-not-exist.yaml")


def test_skip_adds_to_the_lm_head_exclusion():
    """--skip '*.q_proj' must not silently start pruning lm_head (or fail on a tied head)."""
    assert resolve_settings(skip=["*.q_proj"]).skip == ["lm_head", "*.q_proj"]
    assert resolve_settings(skip=[]).skip == ["lm_head"]
    assert resolve_settings(skip=["*.q_proj"], prune_lm_head=True).skip == ["*.q_proj"]
    assert resolve_settings(prune_lm_head=True).skip == []


def test_settings_are_typed_and_report_in_the_defaults_order(tmp_path):
    s = resolve_settings()
    assert isinstance(s, PruneSettings) and s.recipe is None
    assert s.as_dict() == {**DEFAULTS, "sparsity": 0.5}  # the report's "settings": no recipe key without one
    assert list(s.as_dict()) == list(DEFAULTS)
    p = _write(tmp_path, "method: magnitude\n")
    d = resolve_settings(p).as_dict()
    assert list(d) == [*DEFAULTS, "recipe"] and d["recipe"] == str(p) and d["method"] == "magnitude"
