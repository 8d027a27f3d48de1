"""TCA-BME kernels against a float64 reference, under Numba's CUDA simulator when there is no GPU.

What the simulator covers: the whole source of both kernels as written (stage rings and their slot/phase
bookkeeping, SMBD decode and its popcount indexing, the m16n8k16 fragment layout through an exact emulation of the mma contract,
the CUDA-core variant, split-K partials with the last-block reduction and counter reset, M/K
padding, token chunking). What it cannot cover: the inline PTX itself (mma.sync, cvt, 16-byte
loads) and warp-synchronous timing; scripts/checks/gpu_kernels.py checks those on a GPU. Sizes are
tiny because the simulator runs every thread in Python.
"""
from __future__ import annotations

import pytest
import torch

from sparsekit.kernels import kernels_available, reference_matmul, tcabme_matmul
from sparsekit.kernels.common import SIM
from sparsekit.packed.tcabme import encode

DEV = "cpu" if SIM else "cuda"
if not SIM and not torch.cuda.is_available():  # pragma: no cover - conftest sets the simulator
    pytest.skip("neither the CUDA simulator nor a GPU", allow_module_level=True)


def _case(m, k, n, sparsity, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k, generator=g).half()
    w[torch.rand(m, k, generator=g) < sparsity] = 0
    x = torch.randn(n, k, generator=g).half()
    return w, x


def _check(m, k, n, sparsity, seed=0, **tuning):
    w, x = _case(m, k, n, sparsity, seed)
    p = encode(w).to(DEV)
    out = torch.full((n, m), float("nan"), dtype=torch.float16, device=DEV)   # poisoned
    y = tcabme_matmul(x.to(DEV), p, out=out, **tuning)
    assert y is out
    ref = x.double() @ w.double().t()
    assert not torch.isnan(y).any(), "some outputs were never written"
    err = (y.cpu().double() - ref).norm() / ref.norm()
    assert err < 1e-3, f"relative error {err:.2e}"   # fp16 output rounding is ~2e-4


@pytest.mark.parametrize(
    "m,k,n,sparsity,tuning",
    [
        # spmm.py (GroupTile-row blocks, split-K across blocks): N > 16, or forced
        (128, 128, 16, 0.5, dict(splits=2, warp_kernel=False)),  # tensor cores, 2 x 2 GroupTiles, split-K
        (64, 64, 3, 0.5, dict(cuda_core_max_n=0, warp_kernel=False)),  # tensor cores, N padded to 8
        (100, 72, 3, 0.7, dict(splits=2, cuda_core_max_n=8, warp_kernel=False)),  # CUDA cores, padding, split-K
        (64, 128, 1, 0.0, dict(cuda_core_max_n=8, warp_kernel=False)),  # dense GroupTiles
        (64, 320, 9, 0.5, dict(splits=1, warp_kernel=False)),  # 5 steps: the stage ring wraps around
        # spmm_warp.py (one strip row per block, split-K across its warps): the default
        (16, 64, 1, 0.5, {}),                               # one strip, one step
        (100, 200, 3, 0.7, dict(warps=3, stages=2)),        # M and K padding, warps with 2 and 1 steps
        (48, 320, 9, 0.5, dict(warps=2, stages=3)),         # 3 steps on warp 0: the ring wraps; 2 mma blocks
        (32, 192, 16, 0.0, dict(warps=1, stages=2)),        # dense strips (the widest value copies)
        (32, 128, 24, 0.5, dict(warps=2)),                  # 3 mma blocks
        # two strips per warp-step (the default on tall weights)
        (100, 200, 3, 0.7, dict(strips=2, warps=3)),        # 7 strip rows: the last block's 2nd strip is padding
        (48, 320, 9, 0.5, dict(strips=2, warps=2, stages=3)),  # ring wraps; strips 2+3 end at the GroupTile end
        (64, 128, 16, 0.0, dict(strips=2, warps=1)),        # dense: the widest value copies (2 strips)
        # a whole GroupTile row (four strips) per warp-step: two packed scans
        (100, 200, 3, 0.7, dict(strips=4, warps=3)),        # 2 blocks, the second one's strips 3+4 are padding
        (128, 320, 9, 0.5, dict(strips=4, warps=2, stages=3)),  # ring wraps, 2 mma blocks
        (64, 128, 16, 0.0, dict(strips=4, warps=1)),        # dense: the widest value copies (17 per lane)
    ],
)
def test_kernel_matches_float64_reference(m, k, n, sparsity, tuning):
    _check(m, k, n, sparsity, **tuning)


def test_split_k_counter_resets_between_calls():
    # the arrival counters must be back at zero after a split-K call, or the next call's
    # last-block election (and so its output) is wrong
    _check(64, 128, 2, 0.6, seed=1, splits=2, cuda_core_max_n=0, warp_kernel=False)
    _check(64, 128, 2, 0.6, seed=2, splits=2, cuda_core_max_n=0, warp_kernel=False)


@pytest.mark.parametrize("kernel", [True, False])
def test_more_than_64_tokens_are_chunked(kernel):
    _check(16 if kernel else 64, 64, 66, 0.5, seed=3, warp_kernel=kernel)


def test_empty_weight_gives_zeros():
    w = torch.zeros(64, 64, dtype=torch.float16)
    x = torch.randn(2, 64).half()
    y = tcabme_matmul(x.to(DEV), encode(w).to(DEV))
    assert torch.equal(y.cpu(), torch.zeros(2, 64, dtype=torch.float16))


def test_reference_matmul_is_decode_then_matmul():
    w, x = _case(70, 90, 5, 0.5, 4)
    y = reference_matmul(x, encode(w))
    ref = x.double() @ w.double().t()
    assert y.dtype == torch.float16 and y.shape == (5, 70)
    assert (y.double() - ref).norm() / ref.norm() < 1e-3


def test_bad_inputs_are_rejected():
    w, x = _case(64, 64, 2, 0.5, 5)
    p = encode(w).to(DEV)
    with pytest.raises(ValueError):
        tcabme_matmul(x.float().to(DEV), p)
    with pytest.raises(ValueError):
        tcabme_matmul(x[:, :32].contiguous().to(DEV), p)
    with pytest.raises(ValueError):
        tcabme_matmul(x.to(DEV), p, out=torch.empty(2, 63, dtype=torch.float16, device=DEV))


@pytest.mark.skipif(not SIM, reason="simulator only")
def test_kernels_unavailable_under_simulator():
    assert kernels_available() is False


def test_padded_values_tail_is_ignored():
    # the runtime pads every layer's values buffer to one length (CUDA-graph buffer reuse); the
    # kernel reads values only through the offsets, so a tail of garbage must not matter
    w, x = _case(64, 128, 2, 0.5, 6)
    p = encode(w)
    p.values = torch.cat([p.values, torch.full((5,), float("nan"), dtype=torch.float16)])
    ref = x.double() @ w.double().t()
    for tuning in (dict(cuda_core_max_n=0, warp_kernel=False), {}):   # both kernels
        y = tcabme_matmul(x.to(DEV), p.to(DEV), **tuning)
        assert (y.cpu().double() - ref).norm() / ref.norm() < 1e-3


@pytest.mark.parametrize("m,k,sparsity,dtype", [
    (64, 128, 0.5, torch.float16),    # 2 GroupTiles, random pattern
    (100, 72, 0.7, torch.bfloat16),   # M and K padding, bf16 bit patterns
    (64, 64, 0.0, torch.float16),     # dense tiles: every lane reads its 32 values
])
def test_decode_kernel_is_bit_exact(m, k, sparsity, dtype):
    """kernels/decode.py (the prefill path) rebuilds exactly what tcabme.decode does."""
    from sparsekit.kernels.decode import tcabme_decode
    from sparsekit.packed.tcabme import decode

    g = torch.Generator().manual_seed(7)
    w = torch.randn(m, k, generator=g).to(dtype)
    w[torch.rand(m, k, generator=g) < sparsity] = 0
    w[0, :8] = 0
    w[1, 3] = -0.0                    # a stored -0.0 stays -0.0
    w[m - 1, k - 1] = 2.5             # the last element of the padded grid's last real row
    p = encode(w).to(DEV)
    d = tcabme_decode(p)
    assert d.shape == (m, k) and d.dtype == dtype
    assert torch.equal(d.cpu().view(torch.int16), decode(encode(w)).view(torch.int16))
    assert torch.equal(d.cpu().view(torch.int16), w.view(torch.int16))
    # into a given (poisoned, oversized) scratch buffer: the same weight, a view of it
    from sparsekit.kernels.decode import padded_numel

    buf = torch.full((padded_numel(p) + 100,), float("nan"), dtype=dtype, device=DEV)
    d2 = tcabme_decode(p, out=buf)
    assert d2.data_ptr() == buf.data_ptr() and torch.equal(d2.cpu().view(torch.int16), w.view(torch.int16))
    with pytest.raises(ValueError, match="at least"):
        tcabme_decode(p, out=buf[:10])


@pytest.mark.parametrize("offset,tail", [(0, 0), (3, 0), (1, 5), (6, 1)])
def test_decode_kernel_reads_values_at_any_offset(offset, tail):
    """The decode kernel copies each GroupTile's values by 16-byte pieces of their storage: values that start
    ``offset`` halves into a larger storage, with ``tail`` halves after them, decode bit-exactly (odd
    storage ends included: the word-by-word tail reads the last value alone at offset 3, tail 0)."""
    from sparsekit.kernels.decode import tcabme_decode

    g = torch.Generator().manual_seed(11)
    w = torch.randn(128, 192, generator=g).half()
    w = torch.where(torch.rand(128, 192, generator=g) < 0.6, torch.zeros_like(w), w)
    w[64:, 128:] = torch.rand(64, 64, generator=g).half() + 0.5   # the last GroupTile dense: no padding after
    p = encode(w)                                                   # its last value, the storage's last half
    n = p.values.numel()
    store = torch.full((offset + n + tail,), float("nan"), dtype=torch.float16)
    store[offset:offset + n] = p.values
    q = p.to(DEV)
    q.values = store.to(DEV)[offset:offset + n]
    assert q.values.storage_offset() == offset
    d = tcabme_decode(q)
    assert torch.equal(d.cpu().view(torch.int16), w.view(torch.int16))
