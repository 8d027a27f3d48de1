"""runtime.dispatch: the per-group choice between the sparse kernel and dense, from timings."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.runtime import dispatch
from sparsekit.runtime.sparse_linear import SparseLinear


def rows(pairs):
    return [{"n": n, "sparse_ms": s, "dense_ms": d} for n, s, d in pairs]


def test_crossover_is_the_last_count_of_the_first_winning_run():
    assert dispatch.crossover(rows([(1, 5, 10), (8, 6, 10), (16, 9, 10), (32, 12, 10), (64, 5, 10)])) == 16
    assert dispatch.crossover(rows([(1, 11, 10), (8, 5, 10)])) == 0          # loses at N=1: never sparse
    assert dispatch.crossover(rows([(1, 9.9, 10)])) == 0                     # within the noise margin
    assert dispatch.crossover(rows([(1, 5, 10), (2, 5, 10)])) == 2


def sparse_model(seed=0):
    g = torch.Generator().manual_seed(seed)

    def lin(o, i):
        m = nn.Linear(i, o, bias=False)
        w = torch.randn(o, i, generator=g)
        m.weight.data = torch.where(torch.rand(o, i, generator=g) < 0.5, torch.zeros_like(w), w)
        return SparseLinear.from_linear(m)

    return nn.ModuleDict({"a": lin(64, 128), "b": lin(64, 128), "c": lin(128, 64)})


def fake_timings(monkeypatch, table, calls=None):
    """``table[(out, in)] = [(n, sparse_ms, dense_ms), ...]`` instead of GPU timings; ``calls`` hears
    each token count timed."""
    def timed(mods, dense, n):
        if calls is not None:
            calls.append(n)
        return next((s, d) for k, s, d in table[(mods[0].out_features, mods[0].in_features)] if k == n)

    monkeypatch.setattr(dispatch, "kernels_usable", lambda mods: True)
    monkeypatch.setattr(dispatch, "time_group", timed)


def test_speed_runs_losing_groups_dense_and_keeps_copies_for_the_rest(monkeypatch):
    model = sparse_model()
    ref = {k: m.dense_weight(torch.float32) for k, m in model.items()}
    fake_timings(monkeypatch, {(64, 128): [(1, 1.0, 2.0), (8, 1.5, 2.0), (16, 3.0, 2.0)],
                               (128, 64): [(1, 3.0, 2.0), (8, 3.0, 2.0), (16, 3.0, 2.0)]})
    rep = dispatch.plan_dispatch(model, prefer="speed", token_counts=(1, 8, 16), cache=False)
    assert isinstance(model["c"], nn.Linear) and not isinstance(model["c"], SparseLinear)
    assert torch.equal(model["c"].weight.float(), ref["c"])                  # the same weight, dense
    assert list(rep["dense_layers"]) == ["c"] and "slower at every token count" in rep["dense_layers"]["c"]
    for k in ("a", "b"):
        assert isinstance(model[k], SparseLinear) and model[k].dense_above == 8
        assert torch.equal(model[k].dense_copy.float(), ref[k])
    assert rep["dense_copy_bytes"] == 2 * 64 * 128 * 2
    assert {tuple(g["shape"]): g["sparse_max_n"] for g in rep["groups"]} == {(64, 128): 8, (128, 64): 0}
    # timed up to the first count where dense wins, not beyond (each count compiles a kernel variant)
    assert {tuple(g["shape"]): [t["n"] for t in g["timings"]] for g in rep["groups"]} == {(64, 128): [1, 8, 16], (128, 64): [1]}


def test_memory_keeps_every_layer_packed_and_no_copies(monkeypatch):
    model = sparse_model()
    fake_timings(monkeypatch, {(64, 128): [(1, 1.0, 2.0), (8, 3.0, 2.0)], (128, 64): [(1, 3.0, 2.0), (8, 3.0, 2.0)]})
    rep = dispatch.plan_dispatch(model, prefer="memory", token_counts=(1, 8), cache=False)
    assert all(isinstance(m, SparseLinear) and m.dense_copy is None for m in model.values())
    assert model["a"].dense_above == model["c"].dense_above == SparseLinear.dense_above   # unchanged
    assert {tuple(g["shape"]): g["sparse_max_n"] for g in rep["groups"]} == {(64, 128): 1, (128, 64): 0}
    assert rep["dense_layers"] == {} and rep["dense_copy_bytes"] == 0


def test_without_usable_kernels_nothing_changes():
    model = sparse_model()
    rep = dispatch.plan_dispatch(model)      # CPU: no GPU kernels
    assert "skipped" in rep and all(isinstance(m, SparseLinear) for m in model.values())


def test_prefer_is_checked():
    with pytest.raises(SparsekitError, match="prefer"):
        dispatch.plan_dispatch(sparse_model(), prefer="fast")


def test_a_dense_copy_is_not_in_the_state_dict_and_counts_its_bytes():
    m = sparse_model()["a"]
    keys = set(m.state_dict())
    m.keep_dense_copy()
    assert set(m.state_dict()) == keys and m.dense_copy_bytes() == 64 * 128 * 2


def test_the_loader_checks_prefer(tmp_path):
    from sparsekit.runtime.loader import open_model

    with pytest.raises(SparsekitError, match="prefer must be one of speed, memory, got 'fastest'"):
        open_model(tmp_path / "missing", torch.device("cpu"), torch.float32, prefer="fastest")


def test_timings_are_cached_per_gpu_and_software_and_reused(monkeypatch, tmp_path):
    """The second load takes every group's timings from the cache (no kernel timed) and plans the same;
    a damaged cache file is measured over; an unwritable cache is said in the report, never silent."""
    from sparsekit.runtime import dispatch_cache

    table = {(64, 128): [(1, 1.0, 2.0), (8, 3.0, 2.0)], (128, 64): [(1, 3.0, 2.0), (8, 3.0, 2.0)]}
    calls = []
    fake_timings(monkeypatch, table, calls)
    path = tmp_path / "cache" / "gpu.json"
    monkeypatch.setattr(dispatch_cache, "cache_file", lambda device: path)

    first = dispatch.plan_dispatch(sparse_model(), prefer="speed", token_counts=(1, 8))
    assert calls == [1, 8, 1] and first["cache"] == {"path": str(path), "groups_from_cache": 0}
    calls.clear()
    model = sparse_model()
    second = dispatch.plan_dispatch(model, prefer="speed", token_counts=(1, 8))
    assert calls == [] and second["cache"]["groups_from_cache"] == 2
    assert second["groups"] == first["groups"] and second["dense_layers"] == first["dense_layers"]
    assert isinstance(model["c"], nn.Linear) and model["a"].dense_above == 1
    assert dispatch.plan_dispatch(sparse_model(), token_counts=(1, 8, 16))["cache"]["groups_from_cache"] == 0  # other counts

    path.write_text("{not json")
    calls.clear()
    again = dispatch.plan_dispatch(sparse_model(), prefer="speed", token_counts=(1, 8))
    assert calls == [1, 8, 1] and again["groups"] == first["groups"]

    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setattr(dispatch_cache, "cache_file", lambda device: blocked / "gpu.json")
    rep = dispatch.plan_dispatch(sparse_model(), prefer="speed", token_counts=(1, 8))
    assert "could not be cached" in rep["cache"]["error"] and rep["groups"] == first["groups"]


def sp24_model(seed=0):
    """Three 2:4 layers (two 64x128, one 128x64) and one unstructured 64x128, with their encode-time census."""
    from sparsekit.packed.sp24 import tile_census
    from sparsekit.pruning.patterns import nm_mask

    g = torch.Generator().manual_seed(seed)

    def lin(o, i, two_four=True):
        w = torch.randn(o, i, generator=g)
        keep = nm_mask(torch.rand(o, i, generator=g), 2, 4) if two_four else torch.rand(o, i, generator=g) < 0.5
        m = nn.Linear(i, o, bias=False)
        m.weight.data = torch.where(keep, w, torch.zeros(()))
        sl = SparseLinear.from_linear(m)
        sl.tile_census = tile_census(m.weight.data)
        sl.pattern = "2:4" if two_four else "unstructured"
        return sl

    return nn.ModuleDict({"a": lin(64, 128), "b": lin(64, 128), "c": lin(128, 64), "u": lin(64, 128, False)})


def test_2of4_layers_get_the_2of4_kernel_where_it_beats_tcabme(monkeypatch):
    """Issue 22: with prefer=speed a layer whose recorded census is all 2:4 tiles gets its layout and its
    group is timed on the 2:4 kernel too; it runs that kernel up to the last count of the first run where
    it beats TCA-BME, TCA-BME above while that beats dense. A group where it never wins gives the layout
    back; an unstructured layer never gets one (census, not a scan)."""
    model = sp24_model()
    ref = {k: m.dense_weight(torch.float32) for k, m in model.items()}
    fake_timings(monkeypatch, {(64, 128): [(1, 1.0, 2.0), (8, 1.5, 2.0), (16, 1.8, 2.0), (32, 3.0, 2.0)],
                               (128, 64): [(1, 1.0, 2.0), (8, 1.5, 2.0), (16, 3.0, 2.0), (32, 3.0, 2.0)]})
    sp24_ms = {(64, 128): {1: 0.5, 8: 1.2, 16: 1.9, 32: 2.5}, (128, 64): {1: 1.1, 8: 1.6, 16: 3.0, 32: 3.0}}
    timed = []
    monkeypatch.setattr(dispatch, "time_sp24", lambda mods, n: timed.append(n) or
                        sp24_ms[(mods[0].out_features, mods[0].in_features)][n])   # a pass, like time_group
    rep = dispatch.plan_dispatch(model, prefer="speed", token_counts=(1, 8, 16, 32), cache=False, sp24=True)
    by = {(tuple(g["shape"]), g["layers"]): g for g in rep["groups"]}
    ab, c, u = by[((64, 128), 2)], by[((128, 64), 1)], by[((64, 128), 1)]
    assert ab["sp24_max_n"] == 8 and ab["sparse_max_n"] == 16          # 2:4 to 8, TCA-BME to 16 (1.8 < 2.0)
    assert ab["form"] == "2:4 kernel up to N=8, TCA-BME up to N=16, dense copy above"
    for k in ("a", "b"):
        assert model[k].form == "sp24" and model[k].sp24_max_n == 8 and model[k].dense_above == 16
    assert c["sp24_max_n"] == 0 and model["c"].form == "tcabme" and model["c"].sp24_bytes() == 0   # layout given back
    assert "sp24_max_n" not in u and model["u"].form == "tcabme"
    assert rep["sp24_layout_bytes"] == model["a"].sp24_bytes() + model["b"].sp24_bytes() > 0
    for k in ("a", "b", "c", "u"):
        assert torch.equal(model[k].dense_weight(torch.float32), ref[k])


def test_prefer_memory_and_sp24_off_make_no_layout(monkeypatch):
    for kw in (dict(prefer="memory", sp24=True), dict(prefer="speed", sp24=False), dict(prefer="speed")):
        model = sp24_model()
        fake_timings(monkeypatch, {(64, 128): [(1, 1.0, 2.0), (8, 3.0, 2.0)], (128, 64): [(1, 1.0, 2.0), (8, 3.0, 2.0)]})
        monkeypatch.setattr(dispatch, "time_sp24", lambda mods, n: pytest.fail("timed the 2:4 kernel"))
        rep = dispatch.plan_dispatch(model, token_counts=(1, 8), cache=False, **kw)
        assert all(m.form == "tcabme" for m in model.values() if isinstance(m, SparseLinear))
        assert rep["sp24_layout_bytes"] == 0
        if kw == dict(prefer="speed"):          # opt-in for now: said in one note
            assert "3 2:4/hybrid layers stay on the TCA-BME kernel" in rep["sp24_note"] and "SPARSEKIT_SP24=1" in rep["sp24_note"]


def test_2of4_layers_without_a_census_are_named_once(monkeypatch):
    model = sp24_model()
    for m in model.values():
        m.tile_census = None
    fake_timings(monkeypatch, {(64, 128): [(1, 3.0, 2.0)], (128, 64): [(1, 3.0, 2.0)]})
    rep = dispatch.plan_dispatch(model, prefer="speed", token_counts=(1,), cache=False, sp24=True)
    assert "3 2:4 layers carry no tile census" in rep["sp24_note"] and "re-encode" in rep["sp24_note"]


def test_a_2of4_kernel_that_fails_its_self_test_is_one_note_and_tcabme_stays(monkeypatch):
    from sparsekit.runtime import sp24 as rt_sp24

    def broken(model, only=None):
        raise SparsekitError("the 2:4 kernel cannot run on cuda:0 (mma.sp: illegal instruction): leave the layers on TCA-BME")

    monkeypatch.setattr(rt_sp24, "enable_sp24", broken)
    monkeypatch.setenv("SPARSEKIT_STRICT", "0")        # a user's run: one note, no error
    model = sp24_model()
    fake_timings(monkeypatch, {(64, 128): [(1, 1.0, 2.0)], (128, 64): [(1, 1.0, 2.0)]})
    monkeypatch.setenv("SPARSEKIT_SP24", "1")
    rep = dispatch.plan_dispatch(model, prefer="speed", token_counts=(1,), cache=False)
    assert "cannot run" in rep["sp24_note"] and all(m.form == "tcabme" for m in model.values())
    monkeypatch.setenv("SPARSEKIT_STRICT", "1")
    with pytest.raises(SparsekitError, match="cannot run"):
        dispatch.plan_dispatch(sp24_model(), prefer="speed", token_counts=(1,), cache=False)


def test_the_crossover_counts_the_kernel_each_token_count_really_runs(monkeypatch):
    """2:4 wins at N=1, TCA-BME at N=8; at N=16 only the 2:4 kernel beats dense: the layer runs 2:4 up to 1,
    TCA-BME up to 8, 2:4 again from 16 (the warpgroup kernel's shape), and dense only above 16. Had the 2:4
    kernel lost to dense at 16 too, the layer would go dense above 8."""
    model = sp24_model()
    fake_timings(monkeypatch, {(64, 128): [(1, 1.0, 2.0), (8, 1.5, 2.0), (16, 2.5, 2.0), (32, 3.0, 2.0)],
                               (128, 64): [(1, 3.0, 2.0), (8, 3.0, 2.0), (16, 3.0, 2.0), (32, 3.0, 2.0)]})
    sp = {1: 0.5, 8: 1.8, 16: 1.9, 32: 2.5}
    monkeypatch.setattr(dispatch, "time_sp24", lambda mods, n: sp[n])
    rep = dispatch.plan_dispatch(model, prefer="speed", token_counts=(1, 8, 16, 32), cache=False, sp24=True)
    ab = next(g for g in rep["groups"] if g["layers"] == 2)
    assert (ab["sp24_max_n"], ab["sp24_from_n"], ab["sparse_max_n"]) == (1, 16, 16)
    assert ab["form"] == "2:4 kernel up to N=1, TCA-BME up to N=8, 2:4 kernel from N=16 up to N=16, dense copy above"
    a = model["a"]
    assert (a.sp24_max_n, a.sp24_from_n, a.dense_above) == (1, 16, 16)
    assert [n for n in (1, 2, 8, 12, 16, 17, 32) if a.sp24_at(n)] == [1, 16]


def test_a_2of4_kernel_that_never_beats_dense_past_tcabme_adds_no_upper_range(monkeypatch):
    model = sp24_model()
    fake_timings(monkeypatch, {(64, 128): [(1, 1.0, 2.0), (8, 1.5, 2.0), (16, 2.5, 2.0)],
                               (128, 64): [(1, 3.0, 2.0), (8, 3.0, 2.0), (16, 3.0, 2.0)]})
    sp = {1: 0.5, 8: 1.8, 16: 2.1}
    monkeypatch.setattr(dispatch, "time_sp24", lambda mods, n: sp[n])
    rep = dispatch.plan_dispatch(model, prefer="speed", token_counts=(1, 8, 16), cache=False, sp24=True)
    ab = next(g for g in rep["groups"] if g["layers"] == 2)
    assert (ab["sp24_max_n"], ab["sp24_from_n"], ab["sparse_max_n"]) == (1, 0, 8)
    assert model["a"].sp24_max_n == 1 and model["a"].sp24_from_n == 0 and model["a"].dense_above == 8


def test_the_dispatch_cache_is_per_kernel_choice(monkeypatch, tmp_path):
    """Timings measured with one TCA-BME kernel (SPARSEKIT_KERNEL) never decide for another."""
    from types import SimpleNamespace

    from sparsekit.kernels import matmul
    from sparsekit.runtime import dispatch_cache

    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(dispatch_cache.torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name="GPU", multi_processor_count=132))
    files = set()
    for choice in ("default", "warp", "ws"):
        monkeypatch.setenv("SPARSEKIT_KERNEL", choice)
        matmul.reset_kernel_choice()
        files.add(dispatch_cache.cache_file(None))
        files.add(dispatch_cache.cache_file(None))
    matmul.reset_kernel_choice()
    assert len(files) == 3
