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


def fake_timings(monkeypatch, table, calls=None, untimed_below=0):
    """``table[(out, in)] = [(n, sparse_ms, dense_ms), ...]`` instead of GPU timings; ``calls`` hears
    each token count timed. ``untimed_below``: the small-weight rule's bound (0: these tiny test layers
    are timed like 7B ones)."""
    def timed(mods, dense, n):
        if calls is not None:
            calls.append(n)
        return next((s, d) for k, s, d in table[(mods[0].out_features, mods[0].in_features)] if k == n)

    monkeypatch.setattr(dispatch, "kernels_usable", lambda mods: True)
    monkeypatch.setattr(dispatch, "time_group", timed)
    monkeypatch.setattr(dispatch, "UNTIMED_BELOW", untimed_below)


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
    rep = dispatch.plan_dispatch(model, time_small=True)      # CPU: no GPU kernels
    assert "skipped" in rep and all(isinstance(m, SparseLinear) for m in model.values())


def big_and_small_model():
    """``sparse_model`` plus a 128x128 layer: with ``UNTIMED_BELOW`` at 128 * 128, two small groups and one timed."""
    model = sparse_model()
    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(128, 128, bias=True)
    lin.weight.data = torch.where(torch.rand(128, 128, generator=g) < 0.5, 0.0, torch.randn(128, 128, generator=g))
    model["d"] = SparseLinear.from_linear(lin)
    return model


def test_small_weights_run_dense_untimed_without_touching_the_kernels(monkeypatch):
    """Issue 20: under prefer=speed a group of fewer than UNTIMED_BELOW weights is neither compiled nor
    timed: its layers become nn.Linear (the same weights, bit for bit, decoded without the kernels), the
    report marks the groups untimed and says so in one line; bigger groups are timed as before."""
    from sparsekit.runtime import sparse_linear

    model = big_and_small_model()
    ref = {k: m.dense_weight(torch.float32) for k, m in model.items()}
    calls = []
    fake_timings(monkeypatch, {(128, 128): [(1, 1.0, 2.0), (8, 3.0, 2.0)]}, calls, untimed_below=128 * 128)
    monkeypatch.setattr(sparse_linear, "kernel", lambda: pytest.fail("the kernels were touched"))
    rep = dispatch.plan_dispatch(model, prefer="speed", token_counts=(1, 8), cache=False)
    assert calls == [1, 8]                                               # only the 128x128 group was timed
    for k in ("a", "b", "c"):
        assert type(model[k]) is nn.Linear and model[k].weight.dtype == torch.float16
        assert torch.equal(model[k].weight.float(), ref[k].half().float())
        assert rep["dense_layers"][k].startswith("not timed: fewer than 2^14 weights")
    assert isinstance(model["d"], SparseLinear) and model["d"].dense_above == 1 and "d" not in rep["dense_layers"]
    untimed = rep["untimed"]
    assert {k: untimed[k] for k in ("below_elements", "layers", "shapes")} == {
        "below_elements": 128 * 128, "layers": 3, "shapes": [[64, 128], [128, 64]]}
    note = untimed["note"]
    assert "\n" not in note and note.startswith("3 sparse layers run dense without timing the sparse kernel")
    assert "64x128, 128x64" in note and "2^14" in note and "SPARSEKIT_TIME_SMALL=1" in note
    by_shape = {tuple(g["shape"]): g for g in rep["groups"]}
    small = by_shape[(64, 128)]
    assert small["untimed"] and small["timings"] == [] and small["layers"] == 2
    assert small["form"] == "dense" and "untimed" not in by_shape[(128, 128)]


def test_a_plan_of_small_weights_only_runs_no_self_test_and_reads_no_cache(monkeypatch):
    """All groups small (the demo model's case): every layer dense, no kernel check, no dispatch cache
    looked up; without usable kernels the small groups still go dense and the rest keep the reference path."""
    from sparsekit.runtime import dispatch_cache, sparse_linear

    monkeypatch.setattr(dispatch, "kernels_usable", lambda mods: pytest.fail("kernel check for small layers"))
    monkeypatch.setattr(dispatch_cache, "cache_file", lambda device: pytest.fail("cache looked up"))
    monkeypatch.setattr(sparse_linear, "kernel", lambda: pytest.fail("the kernels were touched"))
    model = sparse_model()
    rep = dispatch.plan_dispatch(model, prefer="speed", token_counts=(1, 8))
    assert not any(isinstance(m, SparseLinear) for m in model.values()) and len(rep["dense_layers"]) == 3
    assert "skipped" not in rep and "cache" not in rep and rep["untimed"]["layers"] == 3

    monkeypatch.setattr(dispatch, "UNTIMED_BELOW", 128 * 128)
    monkeypatch.setattr(dispatch, "kernels_usable", lambda mods: False)
    model = big_and_small_model()
    rep = dispatch.plan_dispatch(model, prefer="speed", token_counts=(1, 8))
    assert rep["skipped"] == "no usable GPU kernels: the other sparse layers keep the reference path"
    assert isinstance(model["d"], SparseLinear) and all(type(model[k]) is nn.Linear for k in ("a", "b", "c"))


def test_time_small_and_prefer_memory_time_every_group(monkeypatch):
    """SPARSEKIT_TIME_SMALL=1 (or time_small=True) times small weights as before; prefer=memory never
    changes a layer, so it times them too (its report says where dense would win)."""
    table = {(64, 128): [(1, 1.0, 2.0), (8, 3.0, 2.0)], (128, 64): [(1, 3.0, 2.0)]}
    cases = (("1", {"prefer": "speed"}), ("0", {"prefer": "speed", "time_small": True}), ("", {"prefer": "memory"}))
    for env, kw in cases:
        calls = []
        fake_timings(monkeypatch, table, calls, untimed_below=dispatch.UNTIMED_BELOW)
        monkeypatch.setenv("SPARSEKIT_TIME_SMALL", env)
        model = sparse_model()
        rep = dispatch.plan_dispatch(model, token_counts=(1, 8), cache=False, **kw)
        assert calls == [1, 8, 1] and "untimed" not in rep and isinstance(model["a"], SparseLinear), (env, kw)
    monkeypatch.setenv("SPARSEKIT_TIME_SMALL", "yes")
    with pytest.raises(SparsekitError, match="SPARSEKIT_TIME_SMALL='yes'"):
        dispatch.plan_dispatch(sparse_model(), token_counts=(1, 8), cache=False)


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


def test_the_loader_checks_the_kernels_only_where_the_plan_leaves_sparse_layers(monkeypatch, tmp_path):
    """A plan that runs every layer dense (the demo's: small weights, untimed) leaves nothing for the kernels'
    load-time self-test (a numba compile on a fresh machine) to check; one that keeps a sparse layer is
    checked once, as is a load without a plan; check_kernels=False leaves the check to the caller."""
    from types import SimpleNamespace

    from sparsekit.runtime import loader

    class OnGpu(nn.ModuleDict):
        def to(self, *args, **kwargs):   # stays on the CPU; make_ready sees a CUDA device
            return self

    def all_dense(model, prefer):
        for k in list(model):
            model[k] = model[k].to_linear(torch.float16, use_kernels=False)
        return {}

    checks = []
    monkeypatch.setattr(loader, "kernel", lambda: checks.append(1))
    cuda = SimpleNamespace(type="cuda")
    for plan, prefer, check, want in ((all_dense, "speed", True, 0), (lambda model, prefer: {}, "speed", True, 1),
                                      (all_dense, None, True, 1), (all_dense, None, False, 0)):
        checks.clear()
        monkeypatch.setattr(loader, "plan_dispatch", plan)
        model = loader.make_ready(OnGpu(sparse_model()), tmp_path, cuda, prefer=prefer, check_kernels=check)
        assert len(checks) == want, (prefer, check)
        assert any(isinstance(m, SparseLinear) for m in model.values()) == (plan is not all_dense or prefer is None)


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
    assert "2 of 4 sparse layers run the 2:4 kernel" in dispatch.sp24_runs_note(rep, 4)
    assert "beside the packed weights" in dispatch.sp24_runs_note(rep, 4)
    for k in ("a", "b", "c", "u"):
        assert torch.equal(model[k].dense_weight(torch.float32), ref[k])


def test_sp24_off_makes_no_layout(monkeypatch):
    for kw in (dict(prefer="memory", sp24=False), dict(prefer="speed", sp24=False), dict(prefer="speed")):
        model = sp24_model()
        fake_timings(monkeypatch, {(64, 128): [(1, 1.0, 2.0), (8, 3.0, 2.0)], (128, 64): [(1, 1.0, 2.0), (8, 3.0, 2.0)]})
        monkeypatch.setattr(dispatch, "time_sp24", lambda mods, n: pytest.fail("timed the 2:4 kernel"))
        rep = dispatch.plan_dispatch(model, token_counts=(1, 8), cache=False, **kw)
        assert all(m.form == "tcabme" for m in model.values() if isinstance(m, SparseLinear))
        assert rep["sp24_layout_bytes"] == 0
        if kw == dict(prefer="speed"):          # opt-in for now: said in one note
            assert "3 2:4/hybrid layers stay on the TCA-BME kernel" in rep["sp24_note"] and "SPARSEKIT_SP24=1" in rep["sp24_note"]


def test_prefer_memory_keeps_one_form_the_2of4_layout_where_it_wins_at_every_count(monkeypatch):
    """Issue 22 item 1: with prefer=memory a 2:4 group whose kernel took less time than TCA-BME over the counts timed
    keeps only its 2:4 layout (TCA-BME buffers freed, the same weight, the model smaller than with both forms), even
    where it lost at one count; a group where it took longer keeps TCA-BME and gives the layout back; no dense copy."""
    from sparsekit.runtime.sp24 import DECODE_ABOVE_24
    from sparsekit.runtime.timing import model_bytes

    model = sp24_model()
    ref = {k: m.dense_weight(torch.float32) for k, m in model.items()}
    before = model_bytes(model)
    fake_timings(monkeypatch, {(64, 128): [(1, 1.0, 2.0), (8, 1.5, 2.0)], (128, 64): [(1, 1.0, 2.0), (8, 1.5, 2.0)]})
    sp24_ms = {(64, 128): {1: 1.1, 8: 1.2}, (128, 64): {1: 0.9, 8: 1.7}}   # 2.3 < 2.5; 2.6 > 2.5
    monkeypatch.setattr(dispatch, "time_sp24", lambda mods, n: sp24_ms[(mods[0].out_features, mods[0].in_features)][n])
    rep = dispatch.plan_dispatch(model, prefer="memory", token_counts=(1, 8), cache=False, sp24=True)
    by = {(tuple(g["shape"]), g["layers"]): g for g in rep["groups"]}
    assert by[((64, 128), 2)]["form"].startswith(f"2:4 kernel up to N={DECODE_ABOVE_24}, decode + cuBLAS above "
                                                 "(0.92x TCA-BME's time at N=1-8")
    assert by[((128, 64), 1)]["form"].startswith("sparse (TCA-BME, 0.96x the 2:4 kernel's time at N=1-8")
    for k in ("a", "b"):
        m = model[k]
        assert m.sp24_only and m.form == "sp24" and m.values.numel() == m.bitmaps.numel() == 0
        assert m.sp24_at(1) and m.sp24_at(DECODE_ABOVE_24) and not m.sp24_at(DECODE_ABOVE_24 + 1)
        assert m.dense_copy is None
    assert model["c"].form == "tcabme" and not model["c"].sp24_only and model["c"].sp24_bytes() == 0
    assert model["u"].form == "tcabme" and not model["u"].sp24_only
    for k in ("a", "b", "c", "u"):
        assert torch.equal(model[k].dense_weight(torch.float32), ref[k])
    assert rep["tcabme_freed_bytes"] > 0 and rep["sp24_layout_bytes"] == model["a"].sp24_bytes() * 2
    assert model_bytes(model) == before - rep["tcabme_freed_bytes"] + rep["sp24_layout_bytes"]
    assert rep["dense_copy_bytes"] == 0 and rep["dense_layers"] == {}
    assert dispatch.sp24_runs_note(rep, 4).startswith("2 of 4 sparse layers run the 2:4 kernel (2:4 layouts: ")
    assert "their only form: TCA-BME freed" in dispatch.sp24_runs_note(rep, 4)


def test_prefer_memory_keeps_the_2of4_layout_a_little_slower_at_decode_where_cusparselt_takes_prefill(monkeypatch):
    """A group whose 2:4 kernel took up to CSLT_FORM_SLACK times TCA-BME's time keeps only its layout where cuSPARSELt
    can take its prefill (``cslt_off`` finds no reason: 1.02-1.28x cuBLAS from 1024 tokens on an H200, against
    TCA-BME's decode + cuBLAS), and TCA-BME where it cannot; past the slack TCA-BME either way."""
    from sparsekit.runtime import sp24
    from sparsekit.runtime.sp24 import CSLT_ABOVE_24, CSLT_FORM_SLACK

    assert 1.0 < CSLT_FORM_SLACK < 1.05
    for cslt, ms8, kept in ((True, 1.65, True), (False, 1.65, False), (True, 1.8, False)):   # 2.55 / 2.7 against 2.5
        model = sp24_model()
        fake_timings(monkeypatch, {(64, 128): [(1, 1.0, 2.0), (8, 1.5, 2.0)], (128, 64): [(1, 1.0, 2.0), (8, 1.5, 2.0)]})
        monkeypatch.setattr(dispatch, "time_sp24", lambda mods, n, ms8=ms8: {1: 0.9, 8: ms8}[n])
        monkeypatch.setattr(sp24, "cslt_off", (lambda m: None) if cslt else (lambda m: "not on a CUDA device"))
        rep = dispatch.plan_dispatch(model, prefer="memory", token_counts=(1, 8), cache=False, sp24=True)
        g = next(g for g in rep["groups"] if tuple(g["shape"]) == (128, 64) and g["layers"] == 1)
        assert model["c"].sp24_only is kept, (cslt, ms8, g["form"])
        if kept:
            assert g["form"].startswith(f"2:4 kernel up to N={CSLT_ABOVE_24}, cuSPARSELt above (1.02x TCA-BME's time")
        else:
            assert g["form"].startswith("sparse (TCA-BME, ")


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
