"""`sparsekit eval --speed` on the CPU: the paired, interleaved timing (dense round, packed round, ...),
the ratio as the median of the paired rounds' ratios, the dense twin beside the packed model, the
sequential fallback and its one note, and one compile per batch specialisation (not per batch size).

The GPU is faked: ``speed_runs.GreedyDecoder`` records what is run on which model, ``speed_runs.time_ms`` returns
scripted milliseconds, and the ``torch.cuda`` calls the measurement makes are stubs.
"""
from __future__ import annotations

import re
import statistics
import sys

import pytest
import torch
from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.evaluation import speed, speed_runs, speed_twin
from sparsekit.runtime.sparse_linear import SparseLinear
from tests.test_runtime import IDS, pruned_tiny

GIB = 2**30


def label_of(model: nn.Module) -> str:
    return "packed" if any(isinstance(m, SparseLinear) for m in model.modules()) else "dense"


class Rig:
    """The fake GPU: a log of (model, op) and scripted timings per (op, model)."""

    def __init__(self, monkeypatch, free_gib: float = 70.0, total_gib: float = 80.0):
        self.log: list[tuple[str, str]] = []
        self.timed: list[tuple[str, str]] = []
        self.first_timed: int | None = None  # where in the log the first timed call began
        self.script: dict[tuple[str, str], list[float]] = {}
        self.models: dict[str, list[nn.Module]] = {"packed": [], "dense": []}
        rig = self

        class FakeDecoder:
            def __init__(self, model, batch_size, max_len, *, use_graph=None, compile=False, strict=None):
                self.label, self.use_graph, self.compile = label_of(model), use_graph, compile
                self.graph, self.notes = None, []
                rig.models[self.label].append(model)
                rig.log.append((self.label, "build"))

            def prefill(self, ids):
                rig.log.append((self.label, "prefill"))

            def capture(self):
                self.graph = object()
                rig.log.append((self.label, "capture"))

            def step(self):
                if self.use_graph and self.graph is None:
                    self.capture()
                rig.log.append((self.label, "step"))

        def fake_time_ms(fn, **kw):
            start = len(rig.log)
            if rig.first_timed is None:
                rig.first_timed = start
            fn()
            ops = rig.log[start:]
            assert ops and len({label for label, _ in ops}) == 1, ops  # one model per timed call
            label, kind = ops[0][0], ("prefill" if ops == [(ops[0][0], "prefill")] else "decode")
            rig.timed.append((kind, label))
            script = rig.script.get((kind, label))
            return script.pop(0) if script else (17.0 if kind == "prefill" else 64.0)

        monkeypatch.setattr(speed_runs, "GreedyDecoder", FakeDecoder)
        monkeypatch.setattr(speed_runs, "time_ms", fake_time_ms)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        for name in ("memory_allocated", "max_memory_allocated", "memory_reserved"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: 0)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (int(free_gib * GIB), int(total_gib * GIB)))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Fake GPU")
        monkeypatch.setattr(speed, "start_compile_workers", lambda: rig.log.append(("-", "workers")))


@pytest.fixture
def packed_model():
    from sparsekit.runtime.fusion import prepare_for_decode
    from sparsekit.runtime.swap import sparsify

    model = pruned_tiny("llama")
    assert sparsify(model)
    prepare_for_decode(model, fuse_norms=True, fuse_proj=True, equalize=True)
    return model


def fake_measure_speed(monkeypatch, model, **kw):
    """``measure_speed`` on ``model`` (CPU), the loader and the dispatch plan stubbed."""
    monkeypatch.setattr(speed, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(speed, "open_measured", lambda model_dir, device, dtype, notes: model)
    monkeypatch.setattr(speed, "prepare_for_decode", lambda *a, **k: {})
    monkeypatch.setattr(speed, "plan_dispatch", lambda m, prefer, token_counts: {
        "prefer": prefer, "groups": [], "dense_layers": {}, "dense_copy_bytes": 0, "cache": {}})
    return speed.measure_speed("tiny", **kw)


# --- the paired rounds ---------------------------------------------------------------------------
def test_rounds_interleave_dense_and_packed_after_every_warm_up(monkeypatch, packed_model):
    from sparsekit.runtime.swap import densify
    import copy

    rig = Rig(monkeypatch)
    dense = copy.deepcopy(packed_model)
    densify(dense)
    r = speed.measure_pair(packed_model, dense, 4, prompt_len=8, new_tokens=4, repeats=3, prefill_rounds=3,
                           prefill_runs=2)
    want = [("decode", w) for _ in range(3) for w in ("dense", "packed")]
    want += [("prefill", w) for _ in range(3) for w in ("dense", "packed", "packed", "dense")]   # ABBA in a round
    assert rig.timed == want
    # every build, capture and untimed step comes before the first timed call
    setup = rig.log[:rig.first_timed]
    assert {op for _, op in rig.log[rig.first_timed:]} == {"prefill", "step"}  # nothing built or captured later
    for which in ("packed", "dense"):
        assert (which, "build") in setup and (which, "capture") in setup
        assert setup.count((which, "step")) == speed_runs.DECODE_WARMUP_STEPS
    assert len(r["paired"]["prefill_x"]) == 3 * 2 and len(r["paired"]["decode_x"]) == 3


def test_the_ratio_is_the_median_of_the_paired_runs(monkeypatch, packed_model):
    """Hand-computed: 3 prefill rounds of 2 runs a model, in the order dense, packed, packed, dense. Dense runs
    10, 12 | 11, 20 | 30, 14 ms, packed 12, 11 | 10, 10.5 | 13, 40 ms -> each run over the other model's run
    beside it: 10/12, 12/11, 11/10, 20/10.5, 30/13, 14/40 -> median (12/11 + 11/10) / 2 (the rounds' fastest
    paired would say 14/13, fastest over fastest 1.0, the medians of all runs 13/11.5). Decode loops of 4 steps:
    dense 2.0 / 2.1 / 2.4, packed 2.2 / 1.0 / 3.0 ms a step -> ratios 0.909, 2.1, 0.8 -> median 2.0/2.2 (the
    medians' ratio would be 2.1/2.2)."""
    rig = Rig(monkeypatch)
    rig.script = {("prefill", "dense"): [10, 12, 11, 20, 30, 14], ("prefill", "packed"): [12, 11, 10, 10.5, 13, 40],
                  ("decode", "dense"): [8.0, 8.4, 9.6], ("decode", "packed"): [8.8, 4.0, 12.0]}
    r = speed.measure_pair(packed_model, speed.dense_twin(packed_model), 2, prompt_len=8, new_tokens=4, repeats=3,
                           prefill_rounds=3, prefill_runs=2)
    assert r["paired"]["prefill_run_ms"] == {"dense": [[10, 12], [11, 20], [30, 14]],
                                             "packed": [[12, 11], [10, 10.5], [13, 40]]}
    assert r["paired"]["prefill_x"] == pytest.approx([10 / 12, 12 / 11, 11 / 10, 20 / 10.5, 30 / 13, 14 / 40])
    assert r["ratio"]["prefill_tok_s"] == pytest.approx((12 / 11 + 11 / 10) / 2)
    assert r["ratio"]["decode_tok_s"] == pytest.approx(2.0 / 2.2)
    assert r["paired"]["decode_x"] == pytest.approx([2.0 / 2.2, 2.1 / 1.0, 2.4 / 3.0])
    p, d = r["packed"], r["dense"]
    assert (p["prefill_ms"], d["prefill_ms"]) == (10, 10)  # the fastest run of all rounds
    assert (p["prefill_ms_median"], d["prefill_ms_median"]) == (11.5, 13)
    assert p["prefill_tok_s"] == pytest.approx(2 * 8 / 0.010)
    assert (p["ms_per_token"], d["ms_per_token"]) == pytest.approx((2.2, 2.1))
    assert d["decode_tok_s"] == pytest.approx(2 / 0.0021)
    assert statistics.median(speed_runs.paired_ratios([4, 6, 9], [2, 6, 10])) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="as many dense as packed"):
        speed_runs.paired_ratios([1.0, 2.0], [1.0])


def test_median_interval_is_the_order_statistics_of_the_binomial_ranks():
    """21 values: ranks 6 and 16 (1-based), the textbook distribution-free ~95% interval of the median (it
    covers a continuous law's median with probability sum(C(21, k), k = 6..15) / 2^21 = 0.973); 5 values: the
    whole range."""
    xs = [float(v) for v in range(21, 0, -1)]  # 21 .. 1, unsorted on purpose
    assert speed_runs.median_interval(xs) == (6.0, 16.0)
    assert speed_runs.median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)
    assert speed_runs.median_interval([7.0]) == (7.0, 7.0)
    assert speed_runs.median_is_sure([1.0] * 21) and not speed_runs.median_is_sure(xs)
    # within +-2% of the median: the 6th and 16th of 21 values 0.99 .. 1.01 apart by 0.001
    assert speed_runs.median_is_sure([0.99 + 0.001 * i for i in range(21)])
    with pytest.raises(ValueError, match="at least one"):
        speed_runs.median_interval([])


@pytest.mark.parametrize("noisy", [False, True])
def test_prefill_rounds_go_on_while_the_median_is_unsure(monkeypatch, packed_model, noisy):
    """Steady pairs stop at ``prefill_rounds``; pairs that swing +-25% go on to ``max_prefill_rounds``, and the
    report's interval of the median is the one :func:`median_interval` gives for all the pairs taken."""
    rig = Rig(monkeypatch)
    swing = [8.0, 12.0] * 20 if noisy else [10.0] * 40
    rig.script = {("prefill", "dense"): [10.0] * 40, ("prefill", "packed"): list(swing)}
    r = speed.measure_pair(packed_model, speed.dense_twin(packed_model), 2, prompt_len=8, new_tokens=4, repeats=1,
                           prefill_rounds=3, prefill_runs=2, max_prefill_rounds=9)
    rounds = 9 if noisy else 3
    assert len(r["paired"]["prefill_run_ms"]["dense"]) == rounds and len(r["paired"]["prefill_x"]) == 2 * rounds
    assert [k for k, _ in rig.timed].count("prefill") == 4 * rounds
    want = [10.0 / v for v in swing[:2 * rounds]]
    assert r["paired"]["prefill_x"] == pytest.approx(want)
    assert r["ratio_interval"]["prefill_tok_s"] == pytest.approx(list(speed_runs.median_interval(want)))


def test_measure_speed_pairs_the_packed_model_with_a_dense_twin(monkeypatch, packed_model):
    rig = Rig(monkeypatch, free_gib=70)
    n_sparse = sum(isinstance(m, SparseLinear) for m in packed_model.modules())
    rep = fake_measure_speed(monkeypatch, packed_model, batch_sizes=(1, 4), prompt_len=8, new_tokens=4,
                             repeats=2, prefill_rounds=3, prefill_runs=2)
    assert rep["measurement"] == "interleaved" and (rep["prefill_rounds"], rep["prefill_runs"]) == (3, 2)
    assert not any("one after the other" in n for n in rep["notes"])
    # the packed model kept its SparseLinear layers while the twin ran dense, beside it
    assert sum(isinstance(m, SparseLinear) for m in packed_model.modules()) == n_sparse
    assert rig.models["dense"] and all(m is not packed_model for m in rig.models["dense"])
    for row in rep["rows"]:
        assert row["interleaved"] and set(row["ratio"]) == {"prefill_tok_s", "decode_tok_s"}
        assert len(row["paired"]["prefill_x"]) == 3 * 2 and len(row["paired"]["decode_x"]) == 2
        for which in ("packed", "dense"):
            assert {"prefill_ms", "prefill_ms_median", "prefill_tok_s", "ms_per_token", "decode_tok_s",
                    "peak_mem_gib", "compiled"} <= set(row[which])
    assert {"load_s", "dispatch_s", "twin_s", "capture_s", "decode_s", "prefill_s", "measure_s"} <= set(rep["phases_s"])
    kinds = [k for k, _ in rig.timed]  # per batch size: decode rounds, then prefill rounds
    assert kinds == (["decode"] * 4 + ["prefill"] * 12) * 2


def test_sequential_fallback_says_so_in_one_note(monkeypatch, packed_model):
    """Too little free GPU memory for the dense twin beside the packed model: packed at every batch
    size, then dense (the model densified in place), and one line in the notes says so and why."""
    rig = Rig(monkeypatch, free_gib=1.0)
    rep = fake_measure_speed(monkeypatch, packed_model, batch_sizes=(1, 4), prompt_len=8, new_tokens=4, repeats=2)
    assert rep["measurement"] == "sequential" and rep["prefill_rounds"] is None
    said = [n for n in rep["notes"] if "one after the other" in n]
    assert len(said) == 1 and "\n" not in said[0]
    assert said[0].startswith("packed and dense measured one after the other, not interleaved: the dense twin")
    assert "1.00 GiB is free" in said[0] and "10% headroom" in said[0]
    labels = [label for _, label in rig.timed]
    first_dense = labels.index("dense")
    assert set(labels[:first_dense]) == {"packed"} and set(labels[first_dense:]) == {"dense"}
    assert all(not row["interleaved"] and "paired" not in row for row in rep["rows"])
    assert all(row["ratio"]["prefill_tok_s"] == pytest.approx(row["packed"]["prefill_tok_s"] / row["dense"]["prefill_tok_s"])
               for row in rep["rows"])


def test_pairing_obstacle_weighs_the_twin_caches_and_headroom(monkeypatch, packed_model):
    twin = speed_twin.twin_bytes(packed_model)
    assert twin == sum(m.out_features * m.in_features * 4 for m in packed_model.modules() if isinstance(m, SparseLinear))
    kv, act = speed_twin.working_bytes(packed_model, 32, 128, 193)
    cfg = packed_model.config
    assert kv == 2 * cfg.num_hidden_layers * 32 * 193 * cfg.num_key_value_heads * (cfg.hidden_size // 4) * 4
    need = twin + 2 * kv + act + 0.10 * 80 * GIB
    for free, fits in ((need + 1, True), (need - GIB, False)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, f=free: (int(f), 80 * GIB))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
        why = speed.pairing_obstacle(packed_model, batch_sizes=(1, 32), prompt_len=128, new_tokens=64, device="cuda")
        assert (why is None) == fits, why


# --- the dense twin ------------------------------------------------------------------------------
def test_dense_twin_shares_the_dense_tensors_and_leaves_the_packed_model_alone(packed_model):
    import copy

    from sparsekit.runtime.swap import densify

    sparse = [m for m in packed_model.modules() if isinstance(m, SparseLinear)]
    sparse[0].keep_dense_copy()
    packed_model.half()  # dense copies are fp16: the twin uses one where its dtype is fp16 too
    ref = copy.deepcopy(packed_model)
    densify(ref)
    twin = speed.dense_twin(packed_model)
    assert not any(isinstance(m, SparseLinear) for m in twin.modules())
    assert [m for m in packed_model.modules() if isinstance(m, SparseLinear)] == sparse  # untouched
    assert twin.model.embed_tokens.weight is packed_model.model.embed_tokens.weight  # shared, not copied
    assert twin.lm_head.weight is packed_model.lm_head.weight
    dense_copies = {m.dense_copy.data_ptr() for m in sparse if m.dense_copy is not None}
    assert len(dense_copies) == 1
    assert dense_copies <= {p.data_ptr() for p in twin.parameters()}  # the dispatch copy serves as the weight
    assert speed_twin.twin_bytes(packed_model) == sum(m.out_features * m.in_features * 2 for m in sparse[1:])
    with torch.no_grad():
        torch.testing.assert_close(twin(IDS).logits, ref(IDS).logits, rtol=0, atol=0)


def test_dense_twin_of_a_loaded_packed_directory(tmp_path):
    """Through the loader, fused as eval --speed fuses: the twin computes what the model densified in
    place computes, bit for bit, and generates the same tokens."""
    import copy

    from sparsekit.packed import encoding as packing
    from sparsekit.runtime.fusion import prepare_for_decode
    from sparsekit.runtime.loader import load_packed
    from sparsekit.runtime.swap import densify
    from tests.test_runtime import write_pruned

    write_pruned(pruned_tiny("llama"), tmp_path / "pruned")
    packing.encode(tmp_path / "pruned", tmp_path / "packed")
    model = load_packed(tmp_path / "packed", device="cpu", dtype=torch.float32)
    prepare_for_decode(model, fuse_norms=True, fuse_proj=True, equalize=True)
    ref = copy.deepcopy(model)
    densify(ref)
    twin = speed.dense_twin(model)
    assert any(isinstance(m, SparseLinear) for m in model.modules())
    assert not any(isinstance(m, SparseLinear) for m in twin.modules())
    kw = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        torch.testing.assert_close(twin(IDS).logits, ref(IDS).logits, rtol=0, atol=0)
        assert torch.equal(twin.generate(IDS, **kw), ref.generate(IDS, **kw))


def test_dense_twin_puts_back_the_original_cats_mlps_without_thresholds():
    """CATS: the twin gets copies of the original MLPs (the packed model keeps its kernel stand-in and
    its thresholds), with no CatsActivation: the dense model's logits exactly."""
    from tiny_models import make_model

    from sparsekit.hf.modules import set_submodule
    from sparsekit.runtime import cats as rcats

    model = make_model("llama")
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = model(input_ids=ids).logits
    rcats.install_thresholds(model, {f"model.layers.{i}.mlp": 0.05 for i in range(3)})
    originals = {n: model.get_submodule(n) for n in rcats.cats_activations(model)}
    stand_in = nn.Identity()
    set_submodule(model, "model.layers.1.mlp", stand_in)  # as a CATS kernel module would stand in
    twin = speed.dense_twin(model, originals, cats_kernels=1, fuse_proj=False)
    assert model.get_submodule("model.layers.1.mlp") is stand_in and len(rcats.cats_activations(model)) == 2
    assert rcats.cats_activations(twin) == {}
    assert all(twin.get_submodule(n) is not m for n, m in originals.items())
    with torch.no_grad():
        torch.testing.assert_close(twin(input_ids=ids).logits, dense, rtol=0, atol=0)
    fused = speed.dense_twin(model, originals, cats_kernels=1, fuse_proj=True)
    assert hasattr(fused.get_submodule("model.layers.1.mlp"), "fused_gate_up")
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, dense, rtol=1e-5, atol=1e-5)


# --- compiles per batch size ---------------------------------------------------------------------
def compiles_per_run(monkeypatch, runs, new_tokens: int, steps: int) -> list[int]:
    """The graphs Dynamo hands to the backend for each ``(model, batch size)`` of ``runs``, in order: a
    compiled ``GreedyDecoder`` prefills 6 tokens and takes ``steps`` steps (a backend that only counts)."""
    from sparsekit.runtime import decoder
    from sparsekit.runtime.decoder import GreedyDecoder

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(len(example_inputs))
        return gm.forward

    monkeypatch.setattr(decoder, "COMPILE_OPTIONS", {"backend": counting, "fullgraph": False})
    decoder.reset_compiled_layer()
    torch._dynamo.reset()
    try:
        counts = []
        for model, b in runs:
            before = len(graphs)
            dec = GreedyDecoder(model, b, new_tokens, use_graph=False, compile=True)
            dec.prefill(torch.randint(0, 300, (b, 6), generator=torch.Generator().manual_seed(b)))
            for _ in range(steps):
                dec.step()
            assert dec.compile and dec.notes == []
            counts.append(len(graphs) - before)
        return counts
    finally:
        torch._dynamo.reset()
        decoder.reset_compiled_layer()


def test_the_compiled_step_compiles_twice_per_model_not_per_batch_size(monkeypatch, packed_model):
    """Batch 1 (specialised) and one dynamic-batch graph for every batch size from 2 up: batch sizes
    1, 8, 16, 32 compile 2 graphs per model, 4 for a packed model and its dense twin."""
    twin = speed.dense_twin(packed_model)
    runs = [(model, b) for model in (packed_model, twin) for b in (1, 8, 16, 32)]
    assert compiles_per_run(monkeypatch, runs, 12, 2) == [1, 1, 0, 0] * 2


def test_a_packed_model_left_with_no_sparse_layer_shares_the_twins_compiled_graphs(monkeypatch, packed_model):
    """Issue 20: the demo's plan runs every layer dense (small weights, untimed), so the packed model has the
    twin's modules and tensors: the twin replays the packed model's graphs, 2 compiles for both, not 4."""
    from sparsekit.runtime.dispatch import plan_dispatch

    packed_model.half()    # the plan's dense layers are fp16, as the model is on a GPU
    rep = plan_dispatch(packed_model, prefer="speed", cache=False)
    assert rep["untimed"]["layers"] > 0 and not any(isinstance(m, SparseLinear) for m in packed_model.modules())
    twin = speed.dense_twin(packed_model)
    runs = [(model, b) for b in (1, 4) for model in (packed_model, twin)]   # measure_pair's order
    assert compiles_per_run(monkeypatch, runs, 10, 1) == [1, 0, 1, 0]


def test_measure_speed_says_the_untimed_layers_in_one_note_and_keeps_each_batch_seconds(monkeypatch, packed_model):
    Rig(monkeypatch)
    untimed = {"below_elements": 2**21, "layers": 6, "shapes": [[64, 32]],
               "note": "6 sparse layers run dense without timing"}
    monkeypatch.setattr(speed, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(speed, "open_measured", lambda model_dir, device, dtype, notes: packed_model)
    monkeypatch.setattr(speed, "prepare_for_decode", lambda *a, **k: {})
    monkeypatch.setattr(speed, "plan_dispatch", lambda m, prefer, token_counts: {
        "prefer": prefer, "groups": [{"shape": [64, 32], "layers": 6, "form": "dense", "timings": [], "untimed": True}],
        "dense_layers": {f"l{i}": "not timed" for i in range(6)}, "dense_copy_bytes": 0, "untimed": untimed})
    rep = speed.measure_speed("tiny", batch_sizes=(1, 4), prompt_len=8, new_tokens=4, repeats=2, prefill_rounds=2,
                              prefill_runs=1)
    assert [n for n in rep["notes"] if "run dense" in n] == [untimed["note"]]   # no timed-dense line besides
    for row in rep["rows"]:
        assert set(row["seconds"]) == {"capture", "decode", "prefill"}
    assert rep["phases_s"]["capture_s"] == pytest.approx(sum(r["seconds"]["capture"] for r in rep["rows"]))


# --- Inductor's compile workers (issue 20: the cold start) ----------------------------------------
def test_compile_workers_start_before_the_model_loads_when_compiling(monkeypatch, packed_model):
    """torch starts its compile worker processes at the first compile and compiles its Triton kernels one by
    one until they are up: measure_speed starts them first, before the load, and only when it compiles."""
    for compile_ in (True, False):
        rig = Rig(monkeypatch)
        loaded = []
        monkeypatch.setattr(speed, "open_measured", lambda *a: (loaded.append(len(rig.log)), packed_model)[1])
        monkeypatch.setattr(speed, "resolve_device", lambda device: torch.device("cuda"))
        monkeypatch.setattr(speed, "prepare_for_decode", lambda *a, **k: {})
        monkeypatch.setattr(speed, "plan_dispatch", lambda m, prefer, token_counts: {
            "prefer": prefer, "groups": [], "dense_layers": {}, "dense_copy_bytes": 0, "cache": {}})
        rep = speed.measure_speed("tiny", batch_sizes=(1,), prompt_len=8, new_tokens=4, repeats=1, prefill_rounds=1,
                                  prefill_runs=1, compile=compile_)
        started = [i for i, op in enumerate(rig.log) if op == ("-", "workers")]
        assert started == ([0] if compile_ else []) and loaded == [len(started)]
        assert not any("compile workers" in n for n in rep["notes"])


def test_compile_workers_that_cannot_start_are_said_in_one_note(monkeypatch, packed_model):
    Rig(monkeypatch)

    def fails():
        raise RuntimeError("torch 9.0 has no torch._inductor.async_compile.maybe_warm_pool: update it")

    monkeypatch.setattr(speed, "start_compile_workers", fails)
    monkeypatch.setenv("SPARSEKIT_STRICT", "0")   # the tests' default is strict
    rep = fake_measure_speed(monkeypatch, packed_model, batch_sizes=(1,), prompt_len=8, new_tokens=4, repeats=1,
                             prefill_rounds=1, prefill_runs=1)
    said = [n for n in rep["notes"] if "compile workers" in n]
    assert len(said) == 1 and "\n" not in said[0] and "RuntimeError: torch 9.0 has no" in said[0]
    assert rep["compiled"]   # a slower cold start, the same measurement
    monkeypatch.setenv("SPARSEKIT_STRICT", "1")
    with pytest.raises(SparsekitError, match="SPARSEKIT_STRICT"):
        fake_measure_speed(monkeypatch, packed_model, batch_sizes=(1,), prompt_len=8, new_tokens=4, repeats=1,
                           prefill_rounds=1, prefill_runs=1)


def test_start_compile_workers_finds_inductors_call_or_says_to_update_torch_compat(monkeypatch):
    import types

    from sparsekit.torch_compat import start_compile_workers

    monkeypatch.setenv("TORCH_WARM_POOL", "0")   # the call made, no process started
    assert start_compile_workers() is None
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", types.ModuleType("torch._inductor.async_compile"))
    said = f"torch {re.escape(torch.__version__)} has no .*: update sparsekit.torch_compat"
    with pytest.raises(RuntimeError, match=said):
        start_compile_workers()


# --- the table -----------------------------------------------------------------------------------
@pytest.mark.parametrize("measurement", ["interleaved", "sequential"])
def test_speed_table_with_its_caption_fits_80_columns(measurement):
    from rich.console import Console

    from sparsekit.cli.render import speed_table
    from tests.test_runtime import fake_report

    report = fake_report()
    report.update(measurement=measurement, prefill_rounds=7, prefill_runs=3, repeats=3, sparse_layers=120, cats_mlps=30,
                  cats_kernel_mlps=0, weights_gib={"packed": 0.2512, "dense": 0.2512},
                  dispatch={"prefer": "speed", "dense_copy_bytes": 2**28, "groups": [{}], "dense_layers": {"a": 1}})
    for row in report["rows"]:
        row["packed"]["prefill_tok_s"] *= 300.0
        row["dense"]["decode_tok_s"] *= 25.0
    console = Console(width=80, record=True)
    console.print(speed_table(report))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    body = [line.split() for line in text.splitlines() if line.strip().split(" ")[0] in ("1", "8", "16", "32")]
    assert [cells[0] for cells in body] == ["1", "8", "16", "32"] and all(len(c) == 9 for c in body)
    if measurement == "interleaved":
        assert "x: packed/dense, median of 21 prefill pairs and 3 decode rounds, interleaved" in text  # one line
        for row, n in zip(report["rows"], (42, 21, 21, 30)):   # rounds added where the median was unsure
            row["paired"] = {"prefill_x": [1.0] * n}
        console = Console(width=80, record=True)
        console.print(speed_table(report))
        assert "median of 21-42 prefill pairs and 3 decode rounds" in console.export_text()
    else:
        assert "x: packed/dense, each alone, one model after the other (see the warning)" in text
