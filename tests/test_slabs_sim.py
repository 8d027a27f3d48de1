"""X slabs made by the caller (``sparsekit.runtime.slabs``, issues 21 and 22): the warp-specialized kernels take
them instead of rewriting X themselves, with the same products; the compiled form lays out the same bytes; a
``SparseLinear`` passes them exactly where its kernel will read them. Runs under ``NUMBA_ENABLE_CUDASIM=1``
(small sizes) or on a GPU."""
from __future__ import annotations

import pytest
import torch

from sparsekit.kernels import matmul, sp24_ws
from sparsekit.kernels.common import SIM
from sparsekit.kernels.io import padded
from sparsekit.kernels.sp24 import sp24_matmul
from sparsekit.kernels.spmm_ws import tcabme_ws_matmul
from sparsekit.packed import sp24
from sparsekit.packed.tcabme import encode
from sparsekit.runtime import slabs as slabs_mod
from tests.test_sp24_sim import _weight as _weight24
from tests.test_spmm_rows_sim import _weight

DEV = "cpu" if SIM else "cuda"
pytestmark = pytest.mark.warpgroup_sim   # conftest: the switch interval of the warpgroup kernels


def _call(layer, x):
    """What ``SparseLinear.forward`` runs on a GPU at N <= dense_above (its CUDA branch, here on any device)."""
    from sparsekit.runtime.sparse_linear import tcabme_mm

    return tcabme_mm(x, layer.bitmaps, layer.values, layer.gtile_offsets, layer.strip_offsets, layer.out_features,
                     True, slabs_mod.tcabme_slabs(layer, x))


@pytest.mark.parametrize("n,k,nt", [(3, 130, 8), (20, 256, 16), (40, 64, 32)])
def test_compiled_layout_is_the_bytes_of_x_slabs(monkeypatch, n, k, nt):
    """Inside a compiled step the slabs are a padded, permuted fp16 copy; its bytes are ``x_slabs``'s (K not a
    multiple of 64, tokens not a multiple of the tile: zeros there)."""
    x = torch.randn(n, k).half()
    eager = slabs_mod.slabs(x, nt)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = slabs_mod.slabs(x, nt)
    assert traced.dtype == torch.float16 and eager.dtype == torch.int64 and traced.shape[1] == nt * 64
    assert torch.equal(traced.view(torch.int64), eager)
    assert torch.equal(eager, sp24_ws.x_slabs(padded(x, -(-k // 64) * 64), nt))


def test_sp24_ws_takes_the_callers_slabs_and_refuses_slabs_that_do_not_fit():
    g = torch.Generator().manual_seed(21)
    w = _weight24(64, 192, "2:4", g)
    x = torch.randn(11, 192, generator=g).half().to(DEV)
    lay = sp24.transcode(w).to(DEV)
    kw = dict(kernel="ws", groups=1, strips=1, tokens=8, splits=2)
    want = sp24_matmul(x, lay, **kw)
    given = sp24_matmul(x, lay, slabs=sp24_ws.x_slabs(x, 8), **kw)
    assert torch.equal(given, want)
    ref = x.cpu().double() @ w.double().t()
    assert float((given.cpu().double() - ref).norm() / ref.norm()) < 1e-3
    with pytest.raises(ValueError, match="slabs"):
        sp24_matmul(x, lay, slabs=sp24_ws.x_slabs(x, 16), **kw)      # another tile width (the same bytes here)


def test_spmm_ws_takes_the_callers_slabs():
    w, g = _weight(64, 200, 0.5, 22)
    x = torch.randn(9, 200, generator=g).half().to(DEV)
    pw = encode(w.to(DEV))
    want = tcabme_ws_matmul(x, pw, tokens=16)
    given = tcabme_ws_matmul(x, pw, tokens=16, slabs=slabs_mod.slabs(x, 16))
    assert torch.equal(given, want)
    with pytest.raises(ValueError, match="slabs"):
        tcabme_ws_matmul(x, pw, tokens=16, slabs=slabs_mod.slabs(x, 8))


def _layer_on_the_kernels(monkeypatch, seed: int, n: int):
    """A 50% ``SparseLinear`` [64, 200] on the bundled kernels (the simulator's here), ``n`` tokens of X, its
    float64 product, and the tile widths of every ``x_slabs`` rewrite from then on."""
    from sparsekit.runtime import sparse_linear
    from sparsekit.runtime.sparse_linear import SparseLinear

    w, g = _weight(64, 200, 0.5, seed)
    x = torch.randn(n, 200, generator=g).half().to(DEV)
    monkeypatch.setattr(sparse_linear, "kernel", lambda: matmul.tcabme_matmul)
    made: list[int] = []
    real = sp24_ws.x_slabs
    monkeypatch.setattr(sp24_ws, "x_slabs", lambda *a: made.append(a[1]) or real(*a))
    return SparseLinear(encode(w)).to(DEV), x, x.cpu().double() @ w.double().t(), made


def test_sparse_linear_passes_slabs_only_where_its_kernel_reads_them(monkeypatch):
    """``tcabme_slabs`` asks the kernels which one will run (``matmul.slab_tokens``): with spmm_ws chosen
    (``SPARSEKIT_KERNEL=ws``) X is rewritten once, by the caller, and the product is the same; with spmm_warp
    no slabs are made."""
    layer, x, ref, made = _layer_on_the_kernels(monkeypatch, 23, 5)
    for choice, rewrites in (("ws", [8]), ("warp", [])):
        monkeypatch.setenv("SPARSEKIT_KERNEL", choice)
        matmul.reset_kernel_choice()
        made.clear()
        assert matmul.slab_tokens(torch.device(DEV), 64, 200, 5) == (8 if choice == "ws" else 0)
        y = _call(layer, x)
        assert made == rewrites, choice
        assert float((y.cpu().double() - ref).norm() / ref.norm()) < 1e-3
    matmul.reset_kernel_choice()


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_compiled_call_makes_the_slabs_in_its_own_graph(monkeypatch, dynamic):
    """Under ``torch.compile`` (one graph, no break) the slabs are the traced fp16 copy, never ``x_slabs``'s
    rewrite, and the product is right: the layout Inductor would write is the one spmm_ws reads. With a symbolic
    batch size (``dynamic``: what torch's automatic dynamic shapes make of the second batch size) the step is
    specialised on it where the kernels choose a tile width (session 23: the compile failed with
    "SymNodeVariable() is not a constant")."""
    layer, x, ref, made = _layer_on_the_kernels(monkeypatch, 24 + dynamic, 6)
    monkeypatch.setenv("SPARSEKIT_KERNEL", "ws")
    matmul.reset_kernel_choice()
    torch._dynamo.reset()
    try:
        y = torch.compile(lambda t: _call(layer, t), backend="aot_eager", fullgraph=True, dynamic=dynamic)(x)
    finally:
        matmul.reset_kernel_choice()
        torch._dynamo.reset()
    assert made == []
    assert float((y.cpu().double() - ref).norm() / ref.norm()) < 1e-3


def test_an_eager_kernel_call_takes_the_function_not_the_op(monkeypatch):
    """Eager calls (prefill, CUDA-graph capture without compile) run the op's function directly: the custom op's
    dispatch costs ~20-60 us a call for nothing there; the product is the same."""
    from sparsekit.runtime import sparse_linear

    layer, x, ref, made = _layer_on_the_kernels(monkeypatch, 26, 5)
    monkeypatch.setenv("SPARSEKIT_KERNEL", "ws")
    matmul.reset_kernel_choice()
    through_op = []
    real = sparse_linear.tcabme_mm
    monkeypatch.setattr(sparse_linear, "tcabme_mm", lambda *a: through_op.append(1) or real(*a))
    try:
        y = layer.kernel_forward(x)
    finally:
        matmul.reset_kernel_choice()
    assert through_op == [] and made == [8]
    assert float((y.cpu().double() - ref).norm() / ref.norm()) < 1e-3
