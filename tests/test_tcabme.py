"""TCA-BME encode/decode: bit-exact round trip, the documented layout, and the storage formula."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparsekit.packed import tcabme
from sparsekit.errors import SparsekitError
from sparsekit.packed.tcabme import TcaBme, decode, encode


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def random_bits(m: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Arbitrary 16-bit patterns (incl. NaN payloads, infs, subnormals, -0.0), none all-zero."""
    raw = torch.randint(-(2**15), 2**15, (m, k), dtype=torch.int32, generator=gen).to(torch.int16)
    raw[raw == 0] = 1
    return raw.view(dtype)


def keep_mask(m: int, k: int, sparsity: float, pattern: str, gen: torch.Generator) -> torch.Tensor:
    """A keep-mask of the given pattern (the definitions of docs/format.md / the patterns module)."""
    score = torch.rand(m, k, generator=gen)
    if pattern == "unstructured":
        n_prune = round(sparsity * m * k)
        mask = torch.ones(m * k, dtype=torch.bool)
        mask[score.reshape(-1).argsort()[:n_prune]] = False
        return mask.reshape(m, k)
    kp = math.ceil(k / 4) * 4
    s = torch.full((m, kp), -1.0)
    s[:, :k] = score
    groups = s.reshape(m, kp // 4, 4)
    top2 = groups.argsort(dim=-1, descending=True)[..., :2]
    nm = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, top2, True).reshape(m, kp)[:, :k]
    if pattern == "2:4":
        return nm
    # hybrid: each 64x64 tile is either dense or 2:4
    gm, gk = math.ceil(m / 64), math.ceil(k / 64)
    dense_tile = torch.rand(gm, gk, generator=gen) >= sparsity
    dense = dense_tile.repeat_interleave(64, 0).repeat_interleave(64, 1)[:m, :k]
    return nm | dense


def check_invariants(p: TcaBme, w: torch.Tensor) -> None:
    m, k = w.shape
    ngt = math.ceil(m / 64) * math.ceil(k / 64)
    nnz = int((bits(w) != 0).sum())
    assert p.shape == (m, k)
    assert p.bitmaps.dtype == torch.uint64 and p.bitmaps.shape == (64 * ngt,)
    assert p.gtile_offsets.dtype == torch.int32 and p.gtile_offsets.shape == (ngt + 1,)
    assert p.strip_offsets.dtype == torch.int32 and p.strip_offsets.shape == (4 * ngt,)
    assert p.values.dtype == w.dtype
    assert p.nnz == nnz
    off = p.gtile_offsets.long()
    assert int(off[0]) == 0 and int(off[-1]) == p.values.numel()
    assert bool((off % 8 == 0).all()) and bool((off.diff() >= 0).all())
    per_gt = tcabme.popcount(p.bitmaps).reshape(ngt, 64).sum(1)
    pad = off.diff() - per_gt
    assert bool((pad >= 0).all()) and bool((pad < 8).all())
    per_strip = tcabme.popcount(p.bitmaps).reshape(ngt, 4, 16).sum(-1)
    so = p.strip_offsets.long().reshape(ngt, 4)
    assert torch.equal(so[:, 0], off[:-1])
    assert torch.equal(so[:, 1:] - so[:, :-1], per_strip[:, :-1])
    # padding values are zeros
    padded = int(pad.sum())
    assert int((bits(p.values) == 0).sum()) >= padded
    # the storage formula of docs/format.md
    assert p.nbytes == 4 * (ngt + 1) + 8 * 64 * ngt + 2 * nnz + 2 * padded + 4 * 4 * ngt + 16


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 200),
    k=st.integers(1, 200),
    sparsity=st.floats(0.0, 1.0),
    pattern=st.sampled_from(["unstructured", "2:4", "hybrid"]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_bit_exact(m, k, sparsity, pattern, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w = random_bits(m, k, dtype, gen)
    w = torch.where(keep_mask(m, k, sparsity, pattern, gen), w, torch.zeros((), dtype=dtype))
    p = encode(w)
    check_invariants(p, w)
    out = decode(p)
    assert out.dtype == dtype and out.shape == (m, k)
    assert torch.equal(bits(out), bits(w))


@pytest.mark.parametrize("sparsity", [0.0, 1.0])
def test_extremes(sparsity):
    w = torch.randn(100, 130, dtype=torch.float16)
    w[w == 0] = 1
    if sparsity == 1.0:
        w.zero_()
    p = encode(w)
    check_invariants(p, w)
    assert torch.equal(bits(decode(p)), bits(w))
    if sparsity == 1.0:
        assert p.values.numel() == 0 and p.nnz == 0


def test_negative_zero_and_nan_survive():
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    w[1, 2] = -0.0
    w[5, 7] = float("nan")
    w[60, 3] = float("-inf")
    p = encode(w)
    assert p.nnz == 3
    assert torch.equal(bits(decode(p)), bits(w))


def test_hand_checked_64x128():
    """Bit positions and value order worked out by hand from docs/format.md."""
    w = torch.zeros(64, 128, dtype=torch.float16)
    entries = {  # (row, col): value
        (0, 0): 1.0,     # g0 s0 t0 b0, bit 0
        (3, 5): 2.0,     # g0 s0 t0 b0, bit 3*8+5 = 29
        (3, 2): 3.0,     # g0 s0 t0 b0, bit 26 (comes before (3, 5))
        (8, 0): 4.0,     # b1 (bottom-left): tile 1, bit 0
        (0, 8): 5.0,     # b2 (top-right): tile 2, bit 0
        (9, 10): 6.0,    # b3 (bottom-right): tile 3, bit 1*8+2 = 10
        (0, 16): 7.0,    # t1: tile 4
        (16, 0): 8.0,    # s1: tile 16
        (63, 63): 9.0,   # s3 t3 b3, r7 c7: tile 63, bit 63
        (0, 64): 10.0,   # GroupTile 1 (row-major: gk=1), tile 64, bit 0
    }
    for (r, c), v in entries.items():
        w[r, c] = v
    p = encode(w)
    expect_bm = torch.zeros(128, dtype=torch.int64)
    expect_bm[0] = (1 << 0) | (1 << 26) | (1 << 29)
    expect_bm[1] = 1
    expect_bm[2] = 1
    expect_bm[3] = 1 << 10
    expect_bm[4] = 1
    expect_bm[16] = 1
    expect_bm[63] = -(2**63)  # bit 63 as int64
    expect_bm[64] = 1
    assert torch.equal(p.bitmaps.view(torch.int64), expect_bm)
    # GroupTile 0: 9 values padded to 16; GroupTile 1: 1 value padded to 8.
    assert p.gtile_offsets.tolist() == [0, 16, 24]
    assert p.values[:9].tolist() == [1.0, 3.0, 2.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    assert p.values[9:16].tolist() == [0.0] * 7
    assert p.values[16:].tolist() == [10.0] + [0.0] * 7
    # strip 0 holds 7 values, strip 1 one, strip 2 none, strip 3 one.
    assert p.strip_offsets.tolist() == [0, 7, 8, 8, 16, 17, 17, 17]
    assert p.nbytes == 4 * 3 + 8 * 128 + 2 * 24 + 4 * 8 + 16


def test_torch_path_matches_numpy_path(monkeypatch):
    """The pure-torch path (used on the GPU) gives the same tensors as the CPU numpy path."""
    gen = torch.Generator().manual_seed(1)
    w = random_bits(150, 90, torch.bfloat16, gen)
    w = torch.where(keep_mask(150, 90, 0.6, "unstructured", gen), w, torch.zeros((), dtype=w.dtype))
    a = encode(w)
    monkeypatch.setattr(tcabme, "NUMPY_ON_CPU", False)
    b = encode(w)
    assert torch.equal(a.bitmaps.view(torch.int64), b.bitmaps.view(torch.int64))
    assert torch.equal(bits(a.values), bits(b.values))
    assert torch.equal(a.gtile_offsets, b.gtile_offsets) and torch.equal(a.strip_offsets, b.strip_offsets)
    assert torch.equal(bits(decode(a)), bits(w))


def test_transposed_view_input():
    w = torch.randn(70, 130, dtype=torch.float16)
    w[w.abs() < 0.5] = 0
    wt = w.t()  # a non-contiguous [out, in] view, as for GPT-2 Conv1D
    assert torch.equal(bits(decode(encode(wt))), bits(wt))


def test_tensors_round_trip_and_to():
    w = torch.randn(65, 64, dtype=torch.float16)
    w[w.abs() < 1] = 0
    p = encode(w)
    t = p.tensors("model.layers.0.mlp.up_proj")
    assert sorted(t) == sorted(f"model.layers.0.mlp.up_proj.tcabme.{f}" for f in tcabme.FIELDS)
    q = TcaBme.from_tensors(t, "model.layers.0.mlp.up_proj").to("cpu")
    assert q.shape == (65, 64)
    assert torch.equal(bits(decode(q)), bits(w))


@pytest.mark.parametrize("bad, message", [
    (torch.zeros(4, 4, 4, dtype=torch.float16), r"packs 2-D linear weights, got shape \(4, 4, 4\)"),
    (torch.zeros(8, 8), "stores fp16 or bf16 weights, got torch.float32: cast"),
    (torch.zeros(8, 8, dtype=torch.int8), "stores fp16 or bf16 weights, got torch.int8: cast"),
    (torch.zeros(0, 8, dtype=torch.float16), r"cannot pack an empty weight of shape \(0, 8\)"),
])
def test_bad_input_is_one_clear_error(bad, message):
    with pytest.raises(SparsekitError, match=message):
        encode(bad)


def test_corrupt_offsets_detected():
    w = torch.randn(64, 64, dtype=torch.float16)
    p = encode(w)
    p.gtile_offsets[1] += 8
    with pytest.raises(SparsekitError, match="corrupt TCA-BME weight: GroupTile offsets do not match .* re-encode"):
        decode(p)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(2)
    w = random_bits(300, 200, torch.float16, gen)
    w = torch.where(keep_mask(300, 200, 0.5, "2:4", gen), w, torch.zeros((), dtype=w.dtype))
    a = encode(w)
    b = encode(w.cuda())
    assert b.values.is_cuda and b.bitmaps.is_cuda
    assert torch.equal(bits(b.values).cpu(), bits(a.values))
    assert torch.equal(b.bitmaps.cpu().view(torch.int64), a.bitmaps.view(torch.int64))
    assert torch.equal(bits(decode(a.to("cuda"))).cpu(), bits(w))


def test_worked_example_in_docs():
    """The 64x64 example of docs/format.md, tensor for tensor."""
    w = torch.zeros(64, 64, dtype=torch.float16)
    for (r, c), v in {(0, 0): 1, (0, 3): 2, (2, 1): 3, (8, 0): 4, (5, 12): 5, (15, 15): 6,
                      (1, 20): 7, (16, 0): 8, (63, 40): 9}.items():
        w[r, c] = v
    p = encode(w)
    expect = [0] * 64
    expect[0], expect[1], expect[2], expect[3] = 0x20009, 0x1, 0x100000000000, 0x8000000000000000
    expect[4], expect[16], expect[59] = 0x1000, 0x1, 0x100000000000000
    got = [int(x) & (2**64 - 1) for x in p.bitmaps.view(torch.int64).tolist()]
    assert got == expect
    assert p.values.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9] + [0] * 7
    assert p.gtile_offsets.tolist() == [0, 16] and p.strip_offsets.tolist() == [0, 7, 8, 8]
    assert p.nbytes == 584
