"""spmm_rows (issue 21, runtime v3: a GroupTile row per block, the X slice shared by its 4 warps, K split
across blocks) against a float64 reference, under Numba's CUDA simulator when there is no GPU.

Covers the kernel's source as written: the block-wide cp.async ring (X slice, each warp's strip values
from the 16-byte floor of their start, bitmaps, the stage header with the start mod 8), the decode once
per strip and step, ldmatrix B fragments (the emulation exchanges the lanes' row addresses), the window
of 32 step offsets per lane and its reload, the rotated start, token chunks and rows past N, M/K padding,
split-K partials with the last-block sum and the counter reset. Masks: random 50% / 70%, 2:4, dense,
strips of mixed kinds (all-zero, dense, 50%, 2:4 side by side), kept -0.0 values. Outputs are poisoned
with NaN first. scripts/checks/gpu_rows.py runs the same checks at full size on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from sparsekit.kernels import tcabme_matmul
from sparsekit.kernels.common import SIM
from sparsekit.packed.tcabme import TcaBme, decode, encode

DEV = "cpu" if SIM else "cuda"
if not SIM and not torch.cuda.is_available():  # pragma: no cover - conftest sets the simulator
    pytest.skip("neither the CUDA simulator nor a GPU", allow_module_level=True)


def _keep(kind, m, k, g):
    """Boolean mask of kept weights."""
    if kind == "2:4":    # two random survivors in every 4 consecutive weights of a row (K padded to 4)
        k4 = -(-k // 4) * 4
        return (torch.rand(m, k4 // 4, 4, generator=g).argsort(-1) < 2).reshape(m, k4)[:, :k]
    if kind == "strips":  # 16-row strips of all-zero, dense, 50%, 2:4, 70% sparse, in turn (shifted per tile row)
        kinds = (0.0, 1.0, 0.5, "2:4", 0.3)
        return torch.cat([_keep(kinds[(s + s // 4) % 5], 16, k, g) for s in range(-(-m // 16))], 0)[:m]
    return torch.rand(m, k, generator=g) < kind   # kind: the share of kept weights


def _weight(m, k, kind, seed, negzeros=0):
    """fp16 [m, k] with pruned weights +0.0 (torch.where, so nothing else is zero) and ``negzeros`` kept
    weights set to -0.0 (stored as values: they shift every later offset)."""
    g = torch.Generator().manual_seed(seed)
    keep = _keep(kind, m, k, g)
    w = torch.where(keep, torch.randn(m, k, generator=g), torch.zeros(()))
    if negzeros:
        rows, cols = keep.nonzero(as_tuple=True)
        pick = torch.randperm(rows.numel(), generator=g)[:negzeros]
        w[rows[pick], cols[pick]] = -0.0
    return w.half(), g


def _rel_err(p, w, x, **knobs):
    m, n = w.shape[0], x.shape[0]
    out = torch.full((n, m), float("nan"), dtype=torch.float16, device=DEV)   # poisoned
    y = tcabme_matmul(x.to(DEV), p.to(DEV), out=out, kernel="rows", **knobs)
    assert y is out
    assert not torch.isnan(y).any(), "some outputs were never written"
    ref = x.double() @ w.double().t()
    return ((y.cpu().double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize(
    "m,k,n,kind,knobs",
    [
        (64, 64, 1, 0.5, {}),                                  # one tile row, one step, one token
        (100, 200, 7, 0.3, {}),                                # M and K padding (70% pruned), 2 row blocks
        (64, 192, 9, 0.5, dict(splits=3)),                     # 2 mma blocks; 3 splits of one column each
        (130, 130, 9, "2:4", dict(tokens=8, stages=2)),        # 2 token chunks, 3 row blocks (rotated starts)
        (64, 320, 33, "strips", dict(tokens=32, stages=3)),    # zero/dense/50%/2:4/70% strips; ring wraps; 2 chunks
        (48, 136, 64, 1.0, {}),                                # dense strips (the widest value copies)
        (16, 64, 70, 0.5, dict(tokens=64)),                    # 2 chunks of 64, the last one 6 rows
    ],
)
def test_rows_kernel_matches_float64(m, k, n, kind, knobs):
    w, g = _weight(m, k, kind, seed=m + n)
    x = torch.randn(n, k, generator=g).half()
    assert _rel_err(encode(w), w, x, **knobs) < 1e-3        # fp16 output rounding is ~2e-4


def test_negative_zeros_are_kept_and_shift_the_offsets():
    w, g = _weight(64, 192, 0.5, seed=3, negzeros=300)
    p = encode(w)
    assert torch.equal(decode(p).view(torch.int16), w.view(torch.int16))   # -0.0 kept bit-exact
    assert p.nnz == int((w.view(torch.int16) != 0).sum())                  # ... as a stored value
    x = torch.randn(5, 192, generator=g).half()
    assert _rel_err(p, w, x, splits=2) < 1e-3


def test_split_k_twice_resets_its_counters():
    """Each call twice with new inputs: a counter left non-zero by the last block of an output tile would
    elect no block to write that tile on the second call (its outputs stay NaN)."""
    splits = 3
    w, g = _weight(64, 448, 0.5, seed=splits)
    p = encode(w)
    for _ in range(2):
        x = torch.randn(3, 448, generator=g).half()
        assert _rel_err(p, w, x, splits=splits) < 1e-3


def test_more_than_32_steps_reload_the_offset_window():
    """34 GroupTile columns in one split: lane l holds the offsets of steps l and 32 + l; steps 32 and 33
    come from the window loaded 32 steps ahead. (The window is indexed by step, not by column, so the
    rotated starts of other row blocks, covered above, do not change it: one row block here.)"""
    w, g = _weight(64, 64 * 34, 0.5, seed=5)
    x = torch.randn(1, 64 * 34, generator=g).half()
    assert _rel_err(encode(w), w, x, splits=1, stages=2) < 1e-3


def test_a_planted_offset_bug_fails():
    """The same checks on a weight whose strip 1 of every GroupTile claims to start one value later must
    fail: the kernel reads values through the offsets (start mod 8 in the stage header)."""
    w, g = _weight(64, 128, 0.5, seed=7)
    p = encode(w)
    so = p.strip_offsets.clone().view(-1, 4)
    so[:, 1] += 1
    bad = TcaBme(bitmaps=p.bitmaps, values=p.values, gtile_offsets=p.gtile_offsets,
                 strip_offsets=so.reshape(-1), shape=p.shape)
    x = torch.randn(2, 128, generator=g).half()
    assert _rel_err(p, w, x) < 1e-3
    assert _rel_err(bad, w, x) > 0.05


def test_unknown_kernel_name_is_one_error():
    w, g = _weight(64, 64, 0.5, seed=1)
    with pytest.raises(ValueError, match="unknown TCA-BME kernel"):
        tcabme_matmul(torch.randn(1, 64, generator=g).half().to(DEV), encode(w).to(DEV), kernel="row")
