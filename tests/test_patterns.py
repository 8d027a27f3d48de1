"""Sparsity patterns: parsing, validation, and the invariants of the masks they select."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekit.errors import SparsekitError
from sparsekit.pruning.patterns import (
    Pattern,
    expand_tiles,
    hybrid_mask,
    hybrid_sparse_tiles,
    n_pruned,
    n_sparse_tiles,
    nm_mask,
    select_mask,
    tile_sums,
    unstructured_mask,
)


# ----------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    "text, kind, n, m, tile",
    [
        ("unstructured", "unstructured", 0, 0, 0),
        ("2:4", "nm", 2, 4, 0),
        ("4:8", "nm", 4, 8, 0),
        ("1:4", "nm", 1, 4, 0),
        ("3:16", "nm", 3, 16, 0),
        ("hybrid", "hybrid", 2, 4, 64),
        ("hybrid:32", "hybrid", 2, 4, 32),
        (" Hybrid:128 ", "hybrid", 2, 4, 128),
    ],
)
def test_parse_and_round_trip(text, kind, n, m, tile):
    p = Pattern.parse(text)
    assert (p.kind, p.n, p.m, p.tile) == (kind, n, m, tile)
    assert Pattern.parse(str(p)) == p
    assert Pattern.parse(p) is p
    assert str(Pattern.parse("hybrid:64")) == "hybrid"


@pytest.mark.parametrize("bad, message", [
    ("", "unknown sparsity pattern ''"), ("2:2", "bad N:M pattern '2:2': need 1 <= N < M"),
    ("4:2", "bad N:M pattern '4:2'"), ("0:4", "bad N:M pattern '0:4'"), ("2-4", "unknown sparsity pattern '2-4'"),
    ("hybrid:6", "bad hybrid tile size in 'hybrid:6': the tile must be a positive multiple of 4"),
    ("hybrid:0", "bad hybrid tile size in 'hybrid:0'"), ("hybrid:x", "unknown sparsity pattern 'hybrid:x'"),
    ("dense2", "unknown sparsity pattern 'dense2'"), ("2:4:8", "unknown sparsity pattern '2:4:8'"),
])
def test_parse_rejects(bad, message):
    with pytest.raises(SparsekitError, match=message):
        Pattern.parse(bad)


def test_resolve_sparsity():
    u, nm, nm48, h = (Pattern.parse(x) for x in ("unstructured", "2:4", "1:4", "hybrid"))
    assert u.resolve_sparsity(None) == 0.5
    assert u.resolve_sparsity(0) == 0.0 and u.resolve_sparsity(0.9) == 0.9
    assert nm.resolve_sparsity(None) == 0.5 and nm.resolve_sparsity(0.5) == 0.5
    assert nm48.resolve_sparsity(None) == 0.75
    assert h.resolve_sparsity(None) == 0.25 and h.resolve_sparsity(0.5) == 0.5 and h.resolve_sparsity(0) == 0
    for p, s, message in [(u, 1.0, r"sparsity 1 is out of range: use a value in \[0, 1\)"),
                          (u, -0.1, "sparsity -0.1 is out of range"), (u, float("nan"), "finite number .* got nan"),
                          (u, "abc", "must be a number, got 'abc'"), (u, True, "must be a number, got True"),
                          (nm, 0.6, "pattern 2:4 fixes the sparsity at 0.5, got 0.6"),
                          (nm48, 0.5, "pattern 1:4 fixes the sparsity at 0.75, got 0.5"),
                          (h, 0.51, r"sparsity 0.51 is out of range for pattern hybrid: use a value in \[0, 0.5\]"),
                          (h, -0.01, "sparsity -0.01 is out of range for pattern hybrid")]:
        with pytest.raises(SparsekitError, match=message):
            p.resolve_sparsity(s)


def test_check_shape():
    Pattern.parse("2:4").check_shape(3, 8)
    Pattern.parse("unstructured").check_shape(3, 7)
    Pattern.parse("hybrid:8").check_shape(16, 24)
    with pytest.raises(SparsekitError, match="divisible by 8"):
        Pattern.parse("4:8").check_shape(4, 12)
    with pytest.raises(SparsekitError, match="tile size"):
        Pattern.parse("hybrid:8").check_shape(12, 16)


def test_n_pruned_is_floor_of_decimal_ratio():
    assert n_pruned(100, 0.29) == 29  # 100 * 0.29 == 28.999999999999996 in binary
    assert n_pruned(10, 0.5) == 5 and n_pruned(11, 0.5) == 5 and n_pruned(7, 0.0) == 0
    assert n_pruned(3, 0.99) == 2
    assert all(n_pruned(n, k / n) == k for n in range(1, 60) for k in range(n))


# ----------------------------------------------------------------------------- unstructured
def test_unstructured_exact_counts_even_with_ties():
    g = torch.Generator().manual_seed(0)
    tied = torch.randint(0, 3, (7, 20), generator=g).float()  # massive ties
    for s in (0.0, 0.1, 0.29, 0.5, 0.73, 0.95):
        rows = unstructured_mask(tied, s, "row")
        assert ((~rows).sum(1) == n_pruned(20, s)).all()
        layer = unstructured_mask(tied, s, "layer")
        assert (~layer).sum() == n_pruned(140, s)
        # nothing pruned scores above anything kept
        if 0 < n_pruned(140, s) < 140:
            assert tied[~layer].max() <= tied[layer].min()
        for r in range(7):
            if 0 < n_pruned(20, s) < 20:
                assert tied[r][~rows[r]].max() <= tied[r][rows[r]].min()


# ----------------------------------------------------------------------------- N:M
@pytest.mark.parametrize("n, m", [(2, 4), (4, 8), (1, 4), (3, 8), (1, 2)])
def test_nm_invariants(n, m):
    g = torch.Generator().manual_seed(n * 10 + m)
    w = torch.randn(12, 8 * m, generator=g)
    keep = nm_mask(w.abs(), n, m)
    groups = keep.reshape(12, -1, m)
    assert (groups.sum(-1) == n).all()  # no zero weights -> exactly N kept per group
    # the kept ones are the N largest of each group
    a = w.abs().reshape(12, -1, m)
    kept_min = torch.where(groups, a, torch.inf).amin(-1)
    dropped_max = torch.where(~groups, a, -torch.inf).amax(-1)
    assert (kept_min > dropped_max).all()
    # with zeros already present, every group still ends with at least M-N zeros
    w2 = w.clone()
    w2[torch.rand(w.shape, generator=g) < 0.4] = 0
    pruned = w2 * nm_mask(w2.abs(), n, m)
    assert ((pruned.reshape(12, -1, m) == 0).sum(-1) >= m - n).all()


def test_nm_groups_are_consecutive_inputs_of_one_row():
    # scores that increase along the input dim: 2:4 keeps the last two of every group of four
    s = torch.arange(16.0).repeat(3, 1)
    keep = nm_mask(s, 2, 4)
    assert keep[0].tolist() == [False, False, True, True] * 4
    assert (keep == keep[0]).all()


def test_nm_rejects_bad_width():
    with pytest.raises(SparsekitError, match="2:4 needs in_features divisible by 4, got 10"):
        nm_mask(torch.rand(4, 10), 2, 4)


# ----------------------------------------------------------------------------- hybrid
def _tile_kinds(keep, t):
    """For each tile: 'dense' (all kept) or '2:4' (exactly 2 kept per group of 4); else 'bad'."""
    r, c = keep.shape
    kinds = {}
    for i, j in itertools.product(range(r // t), range(c // t)):
        tile = keep[i * t : (i + 1) * t, j * t : (j + 1) * t]
        if tile.all():
            kinds[i, j] = "dense"
        elif (tile.reshape(t, t // 4, 4).sum(-1) == 2).all():
            kinds[i, j] = "2:4"
        else:
            kinds[i, j] = "bad"
    return kinds


@pytest.mark.parametrize("s", [0.0, 0.1, 0.25, 1 / 3, 0.5])
def test_hybrid_invariants(s):
    t = 8
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(24, 32, generator=g) * torch.rand(24, 1, generator=g)  # tiles differ in scale
    keep = hybrid_mask(scores, s, t)
    kinds = _tile_kinds(keep, t)
    n_tiles = len(kinds)
    assert "bad" not in kinds.values()
    n_sparse = list(kinds.values()).count("2:4")
    assert n_sparse == n_sparse_tiles(n_tiles, s) == round(s / 0.5 * n_tiles)
    # the chosen tiles are those whose 2:4 pruning removes the least score
    removed = tile_sums(scores * ~nm_mask(scores, 2, 4), t)
    chosen = torch.tensor([[kinds[i, j] == "2:4" for j in range(4)] for i in range(3)])
    assert torch.equal(chosen, hybrid_sparse_tiles(scores, s, t))
    if 0 < n_sparse < n_tiles:
        assert removed[chosen].max() <= removed[~chosen].min()


def test_expand_tiles():
    tiles = torch.tensor([[True, False], [False, True]])
    e = expand_tiles(tiles, 2)
    assert e.shape == (4, 4) and e[:2, :2].all() and not e[:2, 2:].any() and e[2:, 2:].all()


def test_select_mask_dispatch():
    s = torch.rand(8, 16)
    assert torch.equal(select_mask(s, Pattern.parse("2:4"), 0.5), nm_mask(s, 2, 4))
    assert torch.equal(select_mask(s, Pattern.parse("unstructured"), 0.3, "layer"), unstructured_mask(s, 0.3, "layer"))
    assert torch.equal(select_mask(s, Pattern.parse("hybrid:8"), 0.25), hybrid_mask(s, 0.25, 8))


# ----------------------------------------------------------------------------- properties
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    groups=st.integers(1, 6),
    nm=st.sampled_from([(1, 2), (2, 4), (1, 4), (3, 4), (4, 8), (2, 8)]),
    levels=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_nm_mask_property(rows, groups, nm, levels, seed):
    n, m = nm
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (rows, groups * m), generator=g).float()  # few levels: many ties
    keep = nm_mask(scores, n, m).reshape(rows, groups, m)
    assert (keep.sum(-1) == n).all()
    s = scores.reshape(rows, groups, m)
    assert (torch.where(keep, s, torch.inf).amin(-1) >= torch.where(~keep, s, -torch.inf).amax(-1)).all()


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 7),
    cols=st.integers(1, 30),
    sparsity=st.floats(0, 0.999),
    group=st.sampled_from(["row", "layer"]),
    seed=st.integers(0, 2**16),
)
def test_unstructured_mask_property(rows, cols, sparsity, group, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (rows, cols), generator=g).float()
    keep = unstructured_mask(scores, sparsity, group)
    if group == "row":
        assert ((~keep).sum(1) == n_pruned(cols, sparsity)).all()
        lo = torch.where(keep, scores, torch.inf).amin(1)
        hi = torch.where(~keep, scores, -torch.inf).amax(1)
        assert (lo >= hi).all()
    else:
        assert (~keep).sum() == n_pruned(rows * cols, sparsity)
        if keep.any() and (~keep).any():
            assert scores[keep].min() >= scores[~keep].max()
