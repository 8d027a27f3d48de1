"""The 2:4 path of SparseLinear (sparsekit.runtime.sp24): off by default, on only when asked, never
saved, the CPU reference path unchanged, and its torch op against float64 (through the simulator on CPU)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.kernels.common import SIM
from sparsekit.packed.sp24 import to_dense
from sparsekit.pruning.patterns import nm_mask
from sparsekit.runtime.sp24 import enable_sp24, layout_of, sp24_mm
from sparsekit.runtime.sparse_linear import SparseLinear


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    sp, un = nn.Linear(128, 64), nn.Linear(64, 64)
    with torch.no_grad():
        sp.weight.mul_(nm_mask(torch.rand(64, 128, generator=g), 2, 4))
        un.weight[torch.rand(64, 64, generator=g) < 0.5] = 0
    return nn.Sequential(SparseLinear.from_linear(sp), SparseLinear.from_linear(un)), sp.weight.detach().half()


def test_off_by_default_and_on_only_for_eligible_layers(monkeypatch):
    model, w = _model()
    assert [m.form for m in model] == ["tcabme", "tcabme"]
    monkeypatch.setenv("SPARSEKIT_STRICT", "0")
    report = enable_sp24(model)
    assert report["0"] == "sp24" and "neither 2:4 nor dense" in report["1"]
    assert [m.form for m in model] == ["sp24", "tcabme"]
    assert "form=sp24" in repr(model[0])
    assert torch.equal(to_dense(layout_of(model[0])), w)
    assert not any("sp24" in k for k in model.state_dict())      # nothing new on disk
    model[0].use_sp24(None)
    assert model[0].form == "tcabme"


def test_strict_mode_makes_an_ineligible_layer_an_error(monkeypatch):
    model, _ = _model()
    monkeypatch.setenv("SPARSEKIT_STRICT", "1")
    with pytest.raises(SparsekitError, match=r"^1: .*neither 2:4 nor dense.*SPARSEKIT_STRICT"):
        enable_sp24(model)


def test_cpu_forward_is_unchanged(monkeypatch):
    monkeypatch.setenv("SPARSEKIT_STRICT", "0")
    model, _ = _model()
    x = torch.randn(3, 128).half()
    before = model[0](x)
    enable_sp24(model)
    assert torch.equal(model[0](x), before)


def test_a_layer_that_keeps_only_its_layout_computes_the_same_and_has_no_tcabme_form(monkeypatch):
    """``keep_only_sp24`` (prefer=memory): TCA-BME buffers freed, the CPU forward bit-equal to before, the weight
    decoded from the layout, ``packed`` refused in one line, the sparsity still known, the module dense again on
    request; a layer without a layout is refused."""
    from sparsekit.runtime.sp24 import keep_only_sp24

    monkeypatch.setenv("SPARSEKIT_STRICT", "0")
    model, w = _model(2)
    x = torch.randn(3, 128).half()
    before, sparsity = model[0](x), model[0].sparsity
    with pytest.raises(SparsekitError, match="2:4 layout first"):
        keep_only_sp24(model[1])
    enable_sp24(model)
    freed = keep_only_sp24(model[0])
    m = model[0]
    assert freed >= 64 * 128 // 2 * 2 and m.sp24_only and m.values.numel() == m.bitmaps.numel() == 0
    assert torch.equal(m(x), before) and torch.equal(m.dense_weight(), w) and m.sparsity == sparsity
    with pytest.raises(SparsekitError, match="keeps only its 2:4 layout"):
        m.packed
    assert torch.equal(m.to_linear(torch.float16).weight, w) and keep_only_sp24(m) == 0   # (already done)


def test_the_op_matches_float64():
    if not SIM and not torch.cuda.is_available():
        pytest.skip("neither the CUDA simulator nor a GPU")
    dev = "cpu" if SIM else "cuda"
    model, w = _model(1)
    enable_sp24(model[:1])
    m = model[0].to(dev)
    x = torch.randn(2, 128).half()
    y = sp24_mm(x.to(dev), m.sp24_dense, m.sp24_sp, m.sp24_tiles, 64)
    ref = x.double() @ w.double().t()
    assert float((y.cpu().double() - ref).norm() / ref.norm()) < 1e-3


def test_kernel_check_passes_and_a_wrong_kernel_is_one_line(monkeypatch):
    if not SIM and not torch.cuda.is_available():
        pytest.skip("neither the CUDA simulator nor a GPU")
    import sparsekit.runtime.sp24 as mod

    dev = "cpu" if SIM else "cuda"
    mod.forget_checks()
    mod.kernel_check(dev)                                   # the real kernel (simulator on CPU)
    mod.forget_checks()
    monkeypatch.setattr(mod, "sp24_mm", lambda x, d, s, t, m: torch.zeros(x.shape[0], m))
    with pytest.raises(SparsekitError, match=r"^the 2:4 kernel cannot run on .*off by 1") as e:
        mod.kernel_check(dev)
    assert "\n" not in str(e.value)
    mod.forget_checks()


def _hybrid(dense_tiles: set, seed: int) -> SparseLinear:
    """A 128x192 layer (2 x 3 tiles of 64x64): the tiles of ``dense_tiles`` dense, the others 2:4."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(192, 128)
    keep = nm_mask(torch.rand(128, 192, generator=g), 2, 4).bool()
    for i, j in dense_tiles:
        keep[64 * i:64 * i + 64, 64 * j:64 * j + 64] = True
    with torch.no_grad():
        lin.weight.copy_(torch.where(keep, lin.weight, 0.0))
    return SparseLinear.from_linear(lin)


def test_equalized_layouts_of_one_shape_have_one_size_and_compute_the_same(monkeypatch):
    """``fusion.equalize_sp24_layouts``: hybrid layers of one shape with 1, 2 and 3 dense tiles get 2:4 and dense
    buffers of one size (one compiled decoder layer serves them all), an all-2:4 layer keeps its empty dense
    buffer (the kernels tell an all-2:4 weight by it), and the weights the layouts decode to, the CPU forward and
    the kernel's product (simulator or GPU) do not change."""
    from sparsekit.runtime.fusion import equalize_sp24_layouts
    from sparsekit.runtime.sp24 import keep_only_sp24

    monkeypatch.setenv("SPARSEKIT_STRICT", "0")
    model = nn.Sequential(_hybrid({(0, 0)}, 0), _hybrid({(0, 1), (1, 2)}, 1), _hybrid({(0, 0), (1, 1), (1, 2)}, 2),
                          _hybrid(set(), 3))
    assert set(enable_sp24(model).values()) == {"sp24"}
    before = [to_dense(layout_of(m)) for m in model]
    x = torch.randn(3, 192).half()
    outs = [m(x) for m in model]
    sizes = [(m.sp24_dense.numel(), m.sp24_sp.numel()) for m in model]
    assert len(set(sizes[:3])) == 3 and sizes[3][0] == 0
    added = equalize_sp24_layouts(model)
    after = [(m.sp24_dense.numel(), m.sp24_sp.numel()) for m in model]
    assert after[:3] == [(max(s[0] for s in sizes[:3]), max(s[1] for s in sizes[:3]))] * 3
    assert after[3] == sizes[3]                                   # all 2:4: its dense buffer stays empty
    total = sum(4 * (d + s) for d, s in sizes)
    assert added == pytest.approx(sum(4 * (a[0] + a[1] - s[0] - s[1]) for a, s in zip(after, sizes)) / total)
    assert all(torch.equal(to_dense(layout_of(m)), b) for m, b in zip(model, before))
    assert equalize_sp24_layouts(model) == 0.0                    # (already equal)
    for m, y in zip(model, outs):
        keep_only_sp24(m)
        assert torch.equal(m(x), y)                               # the CPU path decodes the padded layout
    if SIM or torch.cuda.is_available():
        dev = "cpu" if SIM else "cuda"
        for m, w in zip(model, before):
            y = sp24_mm(x.to(dev), m.sp24_dense.to(dev), m.sp24_sp.to(dev), m.sp24_tiles.to(dev), 128)
            ref = x.double() @ w.double().t()
            assert float((y.cpu().double() - ref).norm() / ref.norm()) < 1e-3


def test_a_layer_with_only_its_layout_decodes_it_for_cublas_above_its_count(monkeypatch):
    """``keep_only_sp24``: the 2:4 kernel up to DECODE_ABOVE_HYBRID tokens on a layer with dense tiles (its kernel is
    slow at prefill) and DECODE_ABOVE_24 on an all-2:4 one, and above that the layout decoded by the decode kernel
    for cuBLAS: the op ``sp24_dense_mm`` (simulator or GPU) gives the product of F.linear on the decoded weight."""
    from sparsekit.runtime.sp24 import DECODE_ABOVE_24, DECODE_ABOVE_HYBRID, keep_only_sp24, sp24_dense_mm

    if not SIM and not torch.cuda.is_available():
        pytest.skip("neither the CUDA simulator nor a GPU")
    monkeypatch.setenv("SPARSEKIT_STRICT", "0")
    model = nn.Sequential(_hybrid({(1, 2)}, 4), _hybrid(set(), 5))
    enable_sp24(model)
    for m in model:
        keep_only_sp24(m)
    assert DECODE_ABOVE_HYBRID < DECODE_ABOVE_24
    assert model[0].dense_above == DECODE_ABOVE_HYBRID and model[0].sp24_at(DECODE_ABOVE_HYBRID)
    assert not model[0].sp24_at(DECODE_ABOVE_HYBRID + 1)
    assert model[1].dense_above == DECODE_ABOVE_24 and not model[1].sp24_at(DECODE_ABOVE_24 + 1)
    dev = "cpu" if SIM else "cuda"
    x = torch.randn(5, 192).half()
    for m in model:
        w = to_dense(layout_of(m))
        y = sp24_dense_mm(x.to(dev), m.sp24_dense.to(dev), m.sp24_sp.to(dev), m.sp24_tiles.to(dev), 128)
        assert torch.equal(y.cpu(), torch.nn.functional.linear(x.to(dev), w.to(dev)).cpu())
        assert torch.equal(m(x), torch.nn.functional.linear(x, w, m.bias.half()))     # the CPU path: the same


def test_all_24_layers_leave_their_kernel_for_cusparselt_by_size():
    """``decode_above``: a layer on the cuSPARSELt path (``sp24_cslt``) leaves its kernel above CSLT_ABOVE_24 tokens
    (H200: rewrite + cuSPARSELt 1.02-1.08x cuBLAS at 1024 tokens against sp24_ws's 0.88-0.99, and 0.75-0.81 against
    0.54-0.73 at 512 on 12288x4096, 4096x11008 and 4096x4096), weights of CSLT_LARGE or more above
    CSLT_ABOVE_24_LARGE (22016x4096: 0.57 against sp24_ws's 1.00 at 512); the others as before."""
    from types import SimpleNamespace

    from sparsekit.runtime.sp24 import (CSLT_ABOVE_24, CSLT_ABOVE_24_LARGE, CSLT_LARGE, DECODE_ABOVE_24,
                                        DECODE_ABOVE_HYBRID, above_path, decode_above)

    def layer(m, k, cslt, dense_tiles=0):
        return SimpleNamespace(out_features=m, in_features=k, sp24_cslt=cslt, sp24_dense=torch.zeros(dense_tiles))

    assert CSLT_ABOVE_24 < CSLT_ABOVE_24_LARGE and 12288 * 4096 < CSLT_LARGE <= 22016 * 4096
    assert decode_above(layer(22016, 4096, True)) == CSLT_ABOVE_24_LARGE
    assert decode_above(layer(4096, 4096, True)) == decode_above(layer(4096, 11008, True)) == CSLT_ABOVE_24
    assert decode_above(layer(12288, 4096, True)) == CSLT_ABOVE_24
    assert decode_above(layer(22016, 4096, False)) == DECODE_ABOVE_24
    assert decode_above(layer(22016, 4096, False, 4096)) == DECODE_ABOVE_HYBRID
    assert above_path(layer(64, 64, True)) == "cuSPARSELt" and above_path(layer(64, 64, False)) == "decode + cuBLAS"


def test_layers_off_a_gpu_never_take_cusparselt(monkeypatch):
    """On the CPU (and in the simulator) ``cslt_check`` says why not, and a layer that keeps only its all-2:4 layout
    decodes it above its count, as before."""
    from sparsekit.runtime.sp24 import cslt_check, cslt_off, keep_only_sp24

    monkeypatch.setenv("SPARSEKIT_STRICT", "0")
    assert cslt_check("cpu") == "not a CUDA device"
    model = nn.Sequential(_hybrid(set(), 6), _hybrid({(1, 2)}, 7))
    enable_sp24(model)
    assert cslt_off(model[0]) == "not on a CUDA device" and cslt_off(model[1]) == "it has dense tiles"
    keep_only_sp24(model[0])
    assert model[0].sp24_cslt is False
    x = torch.randn(3, 192).half()
    w = to_dense(layout_of(model[0]))
    assert torch.equal(model[0](x), torch.nn.functional.linear(x, w, model[0].bias.half()))
