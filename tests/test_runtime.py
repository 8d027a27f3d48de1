"""Runtime on the CPU: SparseLinear, load_packed, static-cache greedy decoding, speed report output.

The reference for every check is the dense pruned model itself: a model whose packed linears were
replaced by SparseLinear must compute the same function (fp32 activations; the weights are made
fp16-representable first, so packing loses nothing). GPU-only checks skip without CUDA.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.hf.modules import find_decoder_layers, find_linears, weight_out_in
from tests import tiny_models

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pruned_tiny(arch: str = "llama", seed: int = 0) -> nn.Module:
    """A tiny model with fp16-representable weights and 50% of each decoder linear row zeroed."""
    model = tiny_models.make_model(arch, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
        stack_name, stack = find_decoder_layers(model)
        for mod in find_linears(stack, prefix=stack_name).values():
            w = weight_out_in(mod)
            k = w.shape[1] // 2
            thr = w.abs().kthvalue(k, dim=1, keepdim=True).values
            w.masked_fill_(w.abs() <= thr, 0.0)
    return model.eval()


def write_pruned(model, path):
    from sparsekit.hf.checkpoint import build_metadata, save_pruned

    stack_name, stack = find_decoder_layers(model)
    layers = {}
    for name, mod in find_linears(stack, prefix=stack_name).items():
        w = weight_out_in(mod)
        layers[name] = {"sparsity": float((w == 0).float().mean()), "shape": list(w.shape),
                        "kind": "linear" if isinstance(mod, nn.Linear) else "conv1d"}
    meta = build_metadata(model="tiny", method="magnitude", pattern="unstructured", sparsity=0.5,
                          calibration={}, skip=[], layers=layers, elapsed_s=0.0)
    return save_pruned(model, tiny_models.make_tokenizer(), path, meta)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 11, 200], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])


# --- SparseLinear -----------------------------------------------------------------------------
def test_sparse_linear_counts_its_nonzeros_on_first_use_only(monkeypatch):
    """Building a SparseLinear counts nothing (on a GPU the popcount syncs the device, once per layer of a load:
    ~0.1 s of the demo's); ``nnz`` counts once, when asked."""
    from sparsekit.packed.tcabme import TcaBme, encode
    from sparsekit.runtime.sparse_linear import SparseLinear

    w = torch.where(torch.rand(70, 130) > 0.6, torch.randn(70, 130), torch.zeros(())).half()
    packed = encode(w)
    counted = []
    real = TcaBme.nnz.fget
    monkeypatch.setattr(TcaBme, "nnz", property(lambda self: counted.append(1) or real(self)))
    sl = SparseLinear.from_packed(packed)
    assert counted == []
    assert sl.nnz == int((w != 0).sum()) and sl.nnz == int((w != 0).sum()) and counted == [1]


def test_sparse_linear_matches_linear_any_leading_dims():
    from sparsekit.runtime.sparse_linear import SparseLinear

    torch.manual_seed(0)
    lin = nn.Linear(130, 70)  # not multiples of 64: padding must be invisible
    with torch.no_grad():
        lin.weight.copy_(lin.weight.half().float() * (torch.rand_like(lin.weight) > 0.6))
        lin.bias.copy_(lin.bias.half().float())
    sl = SparseLinear.from_linear(lin)
    assert (sl.in_features, sl.out_features) == (130, 70)
    assert sl.nnz == int((lin.weight != 0).sum())
    for shape in ((130,), (3, 130), (2, 5, 130)):
        x = torch.randn(shape)
        torch.testing.assert_close(sl(x), lin(x), rtol=1e-5, atol=1e-6)
    back = sl.to_linear()
    assert torch.equal(back.weight.float(), lin.weight) and torch.equal(back.bias, lin.bias)


@pytest.mark.parametrize("shape,sparsity", [((70, 130), 0.5), ((64, 64), 0.0), ((64, 64), 1.0), ((200, 300), 0.7)])
def test_decode_dense_is_bit_exact(shape, sparsity):
    """The sync-free GPU decode (prefill path) rebuilds exactly the encoded bits, -0.0 included."""
    from sparsekit.packed.tcabme import decode_dense
    from sparsekit.packed.tcabme import encode

    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=g).half()
    w[torch.rand(shape, generator=g) < sparsity] = 0.0
    w[torch.rand(shape, generator=g) < 0.05] = -0.0
    out = decode_dense(encode(w))
    assert out.shape == w.shape and torch.equal(out.view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_sparsify_logits_match_dense_pruned(arch):
    from sparsekit.runtime.sparse_linear import SparseLinear
    from sparsekit.runtime.swap import densify, sparsify

    dense = pruned_tiny(arch)
    sparse = copy.deepcopy(dense)
    swapped = sparsify(sparse)
    n_linear = len(find_linears(find_decoder_layers(dense)[1]))
    assert len(swapped) == n_linear and all(isinstance(sparse.get_submodule(n), SparseLinear) for n in swapped)
    ids = IDS % dense.config.vocab_size
    ref = logits(dense, ids)
    torch.testing.assert_close(logits(sparse, ids), ref, rtol=1e-5, atol=1e-5)
    densify(sparse)
    assert not any(isinstance(m, SparseLinear) for m in sparse.modules())
    torch.testing.assert_close(logits(sparse, ids), ref, rtol=1e-5, atol=1e-5)


def test_sparsify_leaves_dense_layers_alone():
    from sparsekit.runtime.swap import sparsify

    model = tiny_models.make_model("llama")  # nothing pruned: no layer reaches 30% zeros
    assert sparsify(model, min_sparsity=0.3) == []
    assert sparsify(model) == []  # by bytes: packing a dense layer only costs


def test_sparsify_packs_a_25pct_hybrid_layer_by_default():
    """The default rule (packed bytes <= 0.95x dense, as `encode`): a 25% hybrid layer is packed."""
    from sparsekit.hf.modules import find_decoder_layers, find_linears, set_weight_out_in, weight_out_in
    from sparsekit.pruning.patterns import hybrid_mask
    from sparsekit.runtime.swap import sparsify

    model = tiny_models.make_model("llama")
    prefix, stack = find_decoder_layers(model)
    linears = find_linears(stack, prefix=prefix)
    for mod in linears.values():
        w = weight_out_in(mod)
        set_weight_out_in(mod, w.masked_fill(~hybrid_mask(w.abs().float(), 0.25, 16), 0))
    assert sorted(sparsify(model)) == sorted(linears)


def test_no_gpu_notice_said_once(monkeypatch):
    from sparsekit.runtime import sparse_linear

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sparse_linear, "notices_shown", set())
    lin = nn.Linear(64, 64)
    with torch.no_grad():
        lin.weight[:, ::2] = 0
    sl = sparse_linear.SparseLinear.from_linear(lin)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sl(torch.randn(2, 64))
        sl(torch.randn(3, 64))
        sparse_linear.SparseLinear.from_linear(lin)(torch.randn(1, 64))
    msgs = [str(w.message) for w in caught if "reference path" in str(w.message)]
    assert msgs == [sparse_linear.NO_GPU_NOTICE]
    assert msgs[0].startswith("no CUDA GPU: sparse layers run the reference path")


# --- static-cache greedy decoding -------------------------------------------------------------
def test_static_cache_greedy_matches_hf_generate():
    from sparsekit.runtime.decoder import GreedyDecoder
    from sparsekit.runtime.swap import sparsify

    model = pruned_tiny("llama")
    sparsify(model)
    ids = IDS[:, :6]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    dec = GreedyDecoder(model, batch_size=2, max_len=6 + 8, use_graph=False)
    out = dec.generate(ids, 8)
    assert torch.equal(out, ref)
    assert torch.equal(dec.generate(ids, 8), ref)  # the cache resets between prompts
    dec.step()  # the 14th cache slot is still free
    with pytest.raises(SparsekitError, match="cache is full"):
        dec.step()


def test_decoder_attention_never_takes_cudnn_and_leaves_the_choice_as_it_was():
    """Prefill and decode steps run attention without cuDNN's backend (its first call compiles kernels at run time:
    issue 20), whatever the process had chosen; outside the decoder the choice is as before."""
    from sparsekit.runtime.decoder import GreedyDecoder

    model = pruned_tiny("llama")
    seen = []

    def spy(module, args, kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))

    hook = model.model.layers[0].self_attn.register_forward_pre_hook(spy, with_kwargs=True)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        GreedyDecoder(model, batch_size=2, max_len=12, use_graph=False).generate(IDS[:, :6], 3)
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        hook.remove()
        torch.backends.cuda.enable_cudnn_sdp(before)
    assert seen == [(False, True)] * 3          # the prefill and two steps


@pytest.mark.parametrize("fuse", [False, True])
def test_compiled_decode_step_matches_and_compiles_once(monkeypatch, fuse):
    """Regional compilation: one compiled decoder layer serves every layer (the packed value
    counts differ per layer), the sparse matmul traces as one op (fullgraph), same tokens;
    with q/k/v and gate/up merged (fuse_projections) the logits stay the same too."""
    from sparsekit.runtime import decoder
    from sparsekit.runtime.decoder import GreedyDecoder
    from sparsekit.runtime.fusion import FusedProjection, equalize_packed_sizes, fuse_projections
    from sparsekit.runtime.sparse_linear import SparseLinear
    from sparsekit.runtime.swap import sparsify

    monkeypatch.setattr(decoder, "COMPILE_OPTIONS", {"backend": "aot_eager", "fullgraph": True})
    decoder.reset_compiled_layer()
    model = pruned_tiny("llama")
    sparsify(model)
    ids = IDS[:, :6]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    if fuse:
        ref_logits = logits(model, IDS)
        assert fuse_projections(model) == 2 * tiny_models.LAYERS
        fused = [m for m in model.modules() if isinstance(m, FusedProjection)]
        assert all(isinstance(m.fused, SparseLinear) for m in fused)
        torch.testing.assert_close(logits(model, IDS), ref_logits, rtol=1e-5, atol=1e-5)
        assert all(m._last is None for m in fused)  # no activations kept after a forward
    equalize_packed_sizes(model)  # the fusion step's job: the decoder leaves the model as it is
    sizes = {n: b.shape for n, b in model.named_buffers()}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    dec = GreedyDecoder(model, batch_size=2, max_len=12, use_graph=False, compile=True)
    assert torch.equal(dec.generate(ids, 6), ref)
    assert dec.compile and dec.notes == []
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"  # the stack is restored
    assert {n: b.shape for n, b in model.named_buffers()} == sizes  # no buffer was re-padded
    torch._dynamo.reset()
    decoder.reset_compiled_layer()


def test_a_compiled_step_that_breaks_is_an_error_when_strict_and_a_note_otherwise(monkeypatch):
    """No silent fallback: a decode step whose compiled layer call fails raises under SPARSEKIT_STRICT
    (the tests' default) and, without it, decodes uncompiled with one note saying so."""
    from sparsekit.runtime import decoder
    from sparsekit.runtime.decoder import GreedyDecoder

    def planted(graph_module, example_inputs):   # a compiler backend that breaks (public seam: COMPILE_OPTIONS)
        raise TypeError("planted break in the decoder-layer call")

    monkeypatch.setattr(decoder, "COMPILE_OPTIONS", {"backend": planted, "fullgraph": False})
    decoder.reset_compiled_layer()
    model = pruned_tiny("llama")
    ids = IDS[:, :6]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        with pytest.raises(SparsekitError, match="torch.compile of the decode step failed.*planted"):
            GreedyDecoder(model, batch_size=2, max_len=12, use_graph=False, compile=True).generate(ids, 4)
        monkeypatch.setenv("SPARSEKIT_STRICT", "0")
        dec = GreedyDecoder(model, batch_size=2, max_len=12, use_graph=False, compile=True)
        assert torch.equal(dec.generate(ids, 4), ref)
        assert not dec.compile and len(dec.notes) == 1 and "planted" in dec.notes[0]
        assert "decoding without it" in dec.notes[0]
    finally:
        decoder.reset_compiled_layer()


def test_a_compiled_step_out_of_variants_is_an_error_when_strict_and_a_note_otherwise(monkeypatch):
    """No silent fallback past torch's recompile limit (which torch itself answers by running the layer uncompiled
    with a log line): layers whose packed sizes were not equalized each need their own variant; with room for one,
    the second layer raises under SPARSEKIT_STRICT and, without it, the step decodes uncompiled with one note that
    says why. Equalized, the same stack decodes compiled, in that one variant, with no note."""
    from sparsekit.runtime import decoder
    from sparsekit.runtime.decoder import GreedyDecoder
    from sparsekit.runtime.fusion import equalize_packed_sizes
    from sparsekit.runtime.swap import sparsify

    monkeypatch.setattr(decoder, "COMPILE_OPTIONS", {"backend": "aot_eager", "fullgraph": False})   # as shipped
    monkeypatch.setattr(decoder, "raise_recompile_limit", lambda at_least: None)
    model = pruned_tiny("llama")
    sparsify(model)
    ids = IDS[:, :6]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        with torch._dynamo.config.patch(recompile_limit=1):      # (monkeypatch's undo would delete the setting)
            for strict in ("1", "0"):
                torch._dynamo.reset()
                decoder.reset_compiled_layer()
                monkeypatch.setenv("SPARSEKIT_STRICT", strict)
                dec = GreedyDecoder(model, batch_size=2, max_len=12, use_graph=False, compile=True)
                if strict == "1":
                    with pytest.raises(SparsekitError, match="more than torch's 1 variants: layers of one shape"):
                        dec.generate(ids, 4)
                    continue
                assert torch.equal(dec.generate(ids, 4), ref)
                assert not dec.compile and len(dec.notes) == 1 and "more than torch's 1 variants" in dec.notes[0]
            torch._dynamo.reset()
            decoder.reset_compiled_layer()
            equalize_packed_sizes(model)
            dec = GreedyDecoder(model, batch_size=2, max_len=12, use_graph=False, compile=True)
            assert torch.equal(dec.generate(ids, 4), ref) and dec.compile and dec.notes == []
    finally:
        torch._dynamo.reset()
        decoder.reset_compiled_layer()


# --- load_packed ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def packed_llama(tmp_path_factory):
    from sparsekit.packed import encoding as packing
    root = tmp_path_factory.mktemp("rt")
    dense = pruned_tiny("llama")
    write_pruned(dense, root / "pruned")
    packing.encode(root / "pruned", root / "packed")
    return dense, root / "packed"


def test_load_packed_logits_and_generate_match_dense(packed_llama):
    from sparsekit.runtime.loader import load_packed
    from sparsekit.runtime.sparse_linear import SparseLinear

    dense, packed_dir = packed_llama
    model = load_packed(packed_dir, device="cpu", dtype=torch.float32)
    assert not model.training
    sparse_names = {n for n, m in model.named_modules() if isinstance(m, SparseLinear)}
    assert sparse_names == set(find_linears(*reversed(find_decoder_layers(dense))))
    assert not any(p.device.type == "meta" for p in model.parameters())
    torch.testing.assert_close(logits(model, IDS), logits(dense, IDS), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(model.generate(IDS, **kw), dense.generate(IDS, **kw))


def test_load_leaves_no_tensor_storage_in_reference_cycles(packed_llama):
    """`generate` freezes the loaded objects without a collection first (cli.common.long_lived): that is
    sound only while what a load leaves in reference cycles holds no tensor memory. Plain tensors and parameters
    count; tensor subclasses do not (an earlier test's compiled step can drop its fake tensors, which hold no
    memory, into the garbage while this load runs: seen once in CI)."""
    import gc

    from sparsekit.runtime.loader import load

    gc.collect()
    gc.disable()
    try:
        model = load(str(packed_llama[1]), "cpu")
        gc.set_debug(gc.DEBUG_SAVEALL)
        found = gc.collect()
        held = [o for o in gc.garbage if type(o) in (torch.Tensor, nn.Parameter) and o.device.type != "meta"
                and o.untyped_storage().nbytes() > 0]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert found > 0 and model is not None    # there are cycles (functions, tuples); none holds a tensor's bytes
    assert held == []


def test_load_packed_errors(tmp_path, packed_llama):
    from sparsekit.runtime.loader import load_packed

    with pytest.raises(SparsekitError, match="no packed model"):
        load_packed(tmp_path / "missing", device="cpu")
    (tmp_path / "plain").mkdir()
    with pytest.raises(SparsekitError, match="not a packed TCA-BME directory"):
        load_packed(tmp_path / "plain", device="cpu")
    _, packed_dir = packed_llama
    if not torch.cuda.is_available():
        with pytest.raises(SparsekitError, match="no CUDA GPU"):
            load_packed(packed_dir, device="cuda")


def test_load_packed_corrupt_shard(tmp_path, packed_llama):
    import shutil

    from sparsekit.runtime.loader import load_packed

    _, packed_dir = packed_llama
    bad = tmp_path / "bad"
    shutil.copytree(packed_dir, bad)
    shard = sorted(bad.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(SparsekitError, match=rf"shard {shard.name} is truncated or corrupt: .* re-run `sparsekit encode`"):
        load_packed(bad, device="cpu")


# --- speed report output ----------------------------------------------------------------------
def fake_report():
    rows = []
    for b in (1, 8, 16, 32):
        p = {"prefill_tok_s": 900.0 * b, "decode_tok_s": 150.0 * b, "ms_per_token": 6.5, "peak_mem_gib": 1.0}
        d = {"prefill_tok_s": 1000.0 * b, "decode_tok_s": 100.0 * b, "ms_per_token": 10.0, "peak_mem_gib": 2.0}
        rows.append({"batch_size": b, "packed": p, "dense": d,
                     "ratio": {"prefill_tok_s": 0.9, "decode_tok_s": 1.5}})
    return {"model": "out/x.tcabme", "gpu": "Fake GPU", "dtype": "float16", "prompt_len": 128,
            "new_tokens": 64, "cuda_graphs": True, "rows": rows}


def test_plot_speed_writes_png(tmp_path):
    from sparsekit.cli.render import plot_speed

    out = plot_speed(fake_report(), tmp_path / "speed.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(SparsekitError, match="does not exist"):
        plot_speed(fake_report(), tmp_path / "nope" / "speed.png")


def test_speed_table_has_a_row_per_batch():
    from rich.console import Console

    from sparsekit.cli.render import speed_table

    table = speed_table(fake_report())
    assert table.row_count == 4
    console = Console(width=250, record=True)
    console.print(table)
    text = console.export_text()
    assert "1.50" in text and "Fake GPU" in text


def test_speed_table_fits_80_columns_without_splitting_a_number():
    from rich.console import Console

    from sparsekit.cli.render import speed_table

    report = fake_report()
    for row in report["rows"]:  # the widest figures a 7B prefill or a demo decode at batch 64 reach
        row["packed"]["prefill_tok_s"] *= 300.0
        row["dense"]["decode_tok_s"] *= 25.0
    console = Console(width=80, record=True)
    console.print(speed_table(report))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    body = [line.split() for line in lines if line.strip().split(" ")[0] in ("1", "8", "16", "32")]
    assert [cells[0] for cells in body] == ["1", "8", "16", "32"]
    assert all(len(cells) == 9 for cells in body)  # every number whole on its row: none wrapped


def test_the_dense_layers_note_names_each_shape_once():
    from sparsekit.evaluation.speed import dense_layers_note

    groups = [{"shape": [576, 576], "form": "dense", "timings": [{"n": 1, "speedup": 0.72}]},
              {"shape": [960, 576], "form": "dense", "timings": [{"n": 1, "speedup": 0.87}]},
              {"shape": [576, 1536], "form": "sparse up to N=1, dense copy above", "timings": [{"n": 1, "speedup": 1.1}]}]
    plan = {"groups": groups, "dense_layers": {f"l{i}": "slower" for i in range(60)}}
    note = dense_layers_note(plan, 90)
    assert note.startswith("60 of 90 sparse layers run dense")
    assert note.count("576x576") == 1 and note.count("960x576") == 1 and "576x1536" not in note
    assert note.count("slower") == 1 and "0.72x" in note and "0.87x" in note


def test_measure_speed_without_gpu_is_a_clear_error(tmp_path, monkeypatch):
    from sparsekit.evaluation.speed import measure_speed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SparsekitError, match="needs a CUDA GPU"):
        measure_speed(tmp_path)


# --- GPU only ---------------------------------------------------------------------------------
@needs_gpu
def test_cuda_graph_tokens_equal_eager():
    from sparsekit.runtime.decoder import GreedyDecoder
    from sparsekit.runtime.swap import sparsify

    model = pruned_tiny("llama").to(device="cuda", dtype=torch.float16)
    sparsify(model)
    ids = IDS[:, :6].cuda()
    eager = GreedyDecoder(model, 2, 20, use_graph=False).generate(ids, 12)
    graph = GreedyDecoder(model, 2, 20, use_graph=True).generate(ids, 12)
    assert torch.equal(eager, graph)


def test_cpu_reference_path_is_bit_equal_to_dense_layers_with_bias():
    """fp16 on the CPU: Linear fuses its bias (one rounding) and Conv1D is addmm on [in, out]; the
    reference path must compute the very same op, not matmul-then-add (two roundings)."""
    from transformers.pytorch_utils import Conv1D

    from sparsekit.runtime.sparse_linear import SparseLinear

    torch.manual_seed(0)
    x = torch.randn(3, 40, 64).half()
    lin = nn.Linear(64, 192).half()
    conv = Conv1D(192, 64).half()
    with torch.no_grad():
        for mod in (lin, conv):
            mod.weight.normal_(0, 1).mul_(torch.rand_like(mod.weight.float()).ge(0.5).half())
            mod.bias.normal_(0, 1)
        for mod in (lin, conv):
            sparse = SparseLinear.from_linear(mod)
            assert torch.equal(sparse(x), mod(x)), type(mod).__name__


def test_load_packed_gpt_neox_renamed_lm_head(tmp_path):
    """GPT-NeoX checkpoints store lm_head as embed_out.weight (transformers renames it on load)."""
    from sparsekit.packed import encoding as packing
    from sparsekit.runtime.loader import load_packed

    dense = pruned_tiny("gpt_neox")
    write_pruned(dense, tmp_path / "pruned")
    packing.encode(tmp_path / "pruned", tmp_path / "packed")
    model = load_packed(tmp_path / "packed", device="cpu", dtype=torch.float32)
    ids = IDS % dense.config.vocab_size
    torch.testing.assert_close(logits(model, ids), logits(dense, ids), rtol=1e-5, atol=1e-5)


def test_model_bytes_counts_tied_weights_once_and_sparsify_reports_progress():
    from sparsekit.runtime.timing import model_bytes
    from sparsekit.runtime.swap import sparsify

    lin = nn.Linear(8, 4, bias=False)
    tied = nn.ModuleDict({"a": lin, "b": lin})
    assert model_bytes(tied) == 8 * 4 * 4
    model = pruned_tiny("llama")
    calls = []
    swapped = sparsify(model, progress=lambda *a: calls.append(a))
    assert calls[-1] == ("sparsify", len(calls), len(calls)) and len(swapped) == len(calls)



def test_skeletons_run_no_weight_initialiser(tmp_path, monkeypatch):
    """Every weight of a skeleton is loaded afterwards, so building one runs none of torch's initialisers
    (``hf.compat.no_weight_init``): the packed loader's skeleton and the streamed pruner's."""
    from transformers import LlamaConfig

    from sparsekit.hf.compat import meta_skeleton
    from sparsekit.runtime.loader import build_skeleton

    def ran(*a, **k):
        raise AssertionError("a weight initialiser ran")

    for name in ("kaiming_uniform_", "normal_", "uniform_", "zeros_", "ones_"):
        monkeypatch.setattr(torch.nn.init, name, ran)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    cfg.save_pretrained(tmp_path)
    for model in (meta_skeleton(cfg, torch.float16), build_skeleton(tmp_path, torch.float16)[0]):
        assert {p.device.type for p in model.parameters()} == {"meta"}
        assert model.model.rotary_emb.inv_freq.device.type == "cpu"   # buffers built in __init__ stay real
