"""spmm_v3 (issue 21) against a float64 reference, under Numba's CUDA simulator when there is no GPU.

Covers the kernel's source as written: the decode done once per strip and reused for every
8-token block, ldmatrix B fragments from the shared X slice (the emulation exchanges the lanes'
row addresses, so a wrong address is a wrong fragment), X slices shared by a block's strip rows,
K groups and their shared-memory reduction, token chunks over blockIdx.y, rows past N, M/K
padding, padding strip rows. Masks: random 50% / 70%, 2:4, hybrid (64x64 tiles dense or 2:4), and
kept -0.0 values (stored as values, so they shift every later offset). Outputs are poisoned
with NaN first. scripts/checks/gpu_v3.py runs the same checks at full size on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from sparsekit.kernels import spmm_v3, tcabme_matmul
from sparsekit.kernels.common import SIM
from sparsekit.packed.tcabme import decode, encode

DEV = "cpu" if SIM else "cuda"
if not SIM and not torch.cuda.is_available():  # pragma: no cover - conftest sets the simulator
    pytest.skip("neither the CUDA simulator nor a GPU", allow_module_level=True)


def _keep_24(m, k, g):
    """2:4 along K: two random survivors in every 4 consecutive weights of a row."""
    order = torch.rand(m, k // 4, 4, generator=g).argsort(-1)
    return (order < 2).reshape(m, k)


def _mask(kind, m, k, g):
    if kind == "2:4":
        return _keep_24(m, k, g)
    if kind == "hybrid":   # 64x64 tiles, alternately dense and 2:4 (k and m multiples of 64)
        keep = _keep_24(m, k, g)
        for tm in range(0, m, 64):
            for tk in range(0, k, 64):
                if (tm + tk) // 64 % 2 == 0:
                    keep[tm:tm + 64, tk:tk + 64] = True
        return keep
    return torch.rand(m, k, generator=g) >= kind     # unstructured: kind is the sparsity


def _weight(m, k, kind, seed, negzeros=0):
    g = torch.Generator().manual_seed(seed)
    keep = _mask(kind, m, k, g)
    w = torch.where(keep, torch.randn(m, k, generator=g), torch.zeros(()))
    if negzeros:   # some kept weights are -0.0: stored as values (the codec is bit-exact)
        rows, cols = keep.nonzero(as_tuple=True)
        pick = torch.randperm(rows.numel(), generator=g)[:negzeros]
        w[rows[pick], cols[pick]] = -0.0
    return w.half(), g


def _rel_err(m, k, n, kind, seed=0, negzeros=0, **knobs):
    w, g = _weight(m, k, kind, seed, negzeros)
    x = torch.randn(n, k, generator=g).half()
    p = encode(w)
    if negzeros:
        assert torch.equal(decode(p).view(torch.int16), w.view(torch.int16))   # -0.0 kept bit-exact
    out = torch.full((n, m), float("nan"), dtype=torch.float16, device=DEV)   # poisoned
    y = tcabme_matmul(x.to(DEV), p.to(DEV), out=out, kernel="v3", **knobs)
    assert y is out
    assert not torch.isnan(y).any(), "some outputs were never written"
    ref = x.double() @ w.double().t()
    return ((y.cpu().double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize(
    "m,k,n,kind,knobs",
    [
        (16, 64, 1, 0.5, {}),                                   # the default plan: one strip, one step
        (36, 130, 5, 0.7, dict(wr=2, ks=2)),                    # M and K padding, 2 K groups (2 and 1 steps)
        (40, 192, 13, 0.5, dict(nt=8, wr=4, ks=1, stages=3)),   # 2 token chunks (blockIdx.y), ring wraps
        (40, 64, 33, 0.0, dict(wr=8)),                          # dense; 8 strip rows over 4 (padding rows)
        (32, 128, 8, "2:4", dict(wr=2, ks=1)),                  # 2 steps on one warp: the ring wraps
        (64, 128, 16, "hybrid", dict(wr=4, ks=2)),              # dense and 2:4 GroupTiles
        (16, 64, 64, 0.5, {}),                                 # 8 mma blocks per decode
        (16, 64, 128, 0.7, dict(nt=64)),                        # 128 tokens: 2 chunks of 8 blocks
        (16, 2112, 3, 0.5, dict(ks=1, stages=3)),               # 33 steps: offsets reloaded at step 32
    ],
)
def test_v3_matches_float64_reference(m, k, n, kind, knobs):
    err = _rel_err(m, k, n, kind, **knobs)
    assert err < 1e-3, f"relative error {err:.2e}"   # fp16 output rounding is ~2e-4


def test_v3_kept_negative_zeros_take_value_slots():
    err = _rel_err(48, 96, 9, 0.5, seed=3, negzeros=40, wr=4, ks=2)
    assert err < 1e-3, f"relative error {err:.2e}"


def test_v3_planted_popc_bug_fails(monkeypatch):
    # the offset popc over the bits below the lane's AND its own first bit: every value after
    # a lane's first set bit comes from the wrong slot
    monkeypatch.setattr(spmm_v3, "DECODE_BUG", 1)
    err = _rel_err(16, 64, 8, 0.5, wr=1, ks=1)
    assert err > 0.1, f"the planted bug went unnoticed (relative error {err:.2e})"
