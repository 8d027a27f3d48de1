"""CATS kernels (kernels/cats.py) and the runtime module (runtime/cats_mlp.py) against float64 references.

Under Numba's CUDA simulator when there is no GPU (tiny sizes: every thread runs in Python), on the
GPU otherwise. Outputs are poisoned (NaN) before each call, so a value never written shows up.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.kernels.cats import cats_down, cats_up, tile_down, token_bucket
from sparsekit.kernels.common import SIM
from sparsekit.packed.rowpack import GROUP, rowpack, rowunpack

DEV = "cpu" if SIM else "cuda"
if not SIM and not torch.cuda.is_available():  # pragma: no cover - conftest sets the simulator
    pytest.skip("neither the CUDA simulator nor a GPU", allow_module_level=True)


def _weights(i, h, wsp, seed):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(s, generator=g).half() * 0.3 for s in ((i, h), (i, h), (h, i))]
    if wsp:
        ws = [torch.where(torch.rand(w.shape, generator=g) < wsp, torch.zeros_like(w), w) for w in ws]
    x = torch.randn(3, h, generator=g).half()
    return ws, x


def _reference(x, wg, wu, wd, t):
    """The paper's definition, in the runtime's rounding: a = silu(gate x) in fp16, zeroed where |a| < t;
    h = a * (up x) in fp16; y = h @ down^T (float64)."""
    a = F.silu((x.double() @ wg.double().t()).half().float()).half()
    a = a.masked_fill(a.abs() < t.half(), 0)
    h = (a.double() * (x.double() @ wu.double().t()).half().double()).half()
    return h, h.double() @ wd.double().t()


def _err(y, ref):
    return float((y.cpu().double() - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("n,i,h,wsp,rows,threshold,splits", [
    (1, 40, 64, 0.0, False, 0.5, 3),        # dense rows, dense down tiles, split over 3 chunks
    (3, 16, 72, 0.0, False, 0.5, 8),        # 3 tokens (bucket 4), H not a multiple of 128, 8 chunks
    (2, 12, 264, 0.5, True, 0.4, 2),        # row-packed up and down^T, partial last group
    (1, 6, 1096, 0.5, True, 0.0, 1),        # row-packed, two 4-group words per row, all neurons active
])
def test_kernels_match_reference(n, i, h, wsp, rows, threshold, splits):
    (wg, wu, wd), x = _weights(i, h, wsp, seed=n + i)
    x = x[:n].contiguous()
    t = torch.tensor([threshold])
    ref_h, ref_y = _reference(x, wg, wu, wd, t)
    g = (x.double() @ wg.double().t()).half()
    up = rowpack(wu) if rows else wu
    down = rowpack(wd.t().contiguous()) if rows else tile_down(wd.t().contiguous())
    dev = lambda a: a.to(DEV) if isinstance(a, torch.Tensor) else a.to(DEV)   # noqa: E731
    out_h = torch.full((n, i), float("nan"), dtype=torch.float16, device=DEV)
    got_h = cats_up(dev(g), dev(x), dev(up), dev(t), out_h)
    assert not torch.isnan(got_h).any()
    assert _err(got_h, ref_h.double()) < 2e-3
    # inactive neurons are exact zeros, and only they (the kernel saw the same activations)
    assert torch.equal(got_h.cpu() == 0, ref_h == 0)
    out_y = torch.full((n, h), float("nan"), dtype=torch.float16, device=DEV)
    got_y = cats_down(dev(ref_h), dev(down), out_y, splits=splits)
    assert not torch.isnan(got_y).any()
    assert _err(got_y, ref_y) < 2e-3


@pytest.mark.parametrize("rows", [False, True])
def test_all_inactive_mlp_reads_nothing_and_gives_zeros(rows):
    (wg, wu, wd), x = _weights(16, 64, 0.5 if rows else 0.0, seed=3)
    x = x[:1].contiguous()
    up = rowpack(wu) if rows else wu
    down = rowpack(wd.t().contiguous()) if rows else tile_down(wd.t().contiguous())
    g = (x.double() @ wg.double().t()).half()
    t = torch.tensor([1e4])           # no activation reaches it
    h = cats_up(g.to(DEV), x.to(DEV), up.to(DEV), t.to(DEV),
                torch.full((1, 16), float("nan"), dtype=torch.float16, device=DEV))
    assert torch.equal(h.cpu(), torch.zeros(1, 16, dtype=torch.float16))
    y = cats_down(h, down.to(DEV), torch.full((1, 64), float("nan"), dtype=torch.float16, device=DEV), splits=2)
    assert torch.equal(y.cpu(), torch.zeros(1, 64, dtype=torch.float16))


def test_rowpack_round_trip_is_bit_exact_and_matches_its_definition():
    w = torch.randn(5, 300).half()
    w[torch.rand(5, 300) < 0.6] = 0
    w[0, 3] = -0.0                      # a stored value: -0.0 is kept bit-exact
    p = rowpack(w)
    assert torch.equal(rowunpack(p).view(torch.int16), w.view(torch.int16))
    groups = p.groups
    assert groups % 4 == 0 and groups * GROUP >= 300
    # mask byte of (row r, group gi, segment s): bit b <=> column gi*256 + 8s + b holds a value
    m = p.masks.view(5, groups // 4, 32, 4)
    r, gi, s_, b = 0, 0, 0, 3
    assert (int(m[r, gi // 4, s_, gi % 4]) >> b) & 1 == 1
    # values in row-major order, each group's first value at goff
    nz = w.view(torch.int16) != 0
    assert int(p.goff[groups]) == int(nz[0].sum())                    # row 1 starts after row 0's values
    assert torch.equal(p.values[: int(nz.sum())].view(torch.int16), w[nz].view(torch.int16))


def test_tile_down_layout():
    wdt = torch.randn(6, 200).half()
    t = tile_down(wdt, 128)
    assert t.shape == (2, 6, 128)
    assert torch.equal(t[1, 4, :72], wdt[4, 128:])
    assert torch.equal(t[1, 4, 72:], torch.zeros(56, dtype=torch.float16))


def test_token_buckets():
    assert [token_bucket(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    with pytest.raises(ValueError):
        token_bucket(3, rows=True)
    with pytest.raises(ValueError):
        token_bucket(9)


class _MLP(nn.Module):
    """A Llama-form gated MLP."""

    def __init__(self, h, i, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.gate_proj, self.up_proj, self.down_proj = (nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False),
                                                       nn.Linear(i, h, bias=False))
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _cats_mlp(h=64, i=32):
    from sparsekit.runtime.cats import apply_threshold

    mlp = _MLP(h, i).half().to(DEV)
    apply_threshold(mlp, 0.05)
    return mlp


def test_cats_mlp_kernel_path_matches_the_module_and_larger_n_is_the_module():
    from sparsekit.runtime.cats_mlp import CatsMLP

    mlp = _cats_mlp()
    cats = CatsMLP(mlp)
    assert cats.mlp is mlp and isinstance(mlp.down_proj, nn.Linear)   # the original is left as it was
    x = torch.randn(1, 1, 64).half().to(DEV)
    with torch.no_grad():
        ref = mlp(x)
        got = cats(x)
        assert got.shape == ref.shape
        assert _err(got, ref.double().cpu()) < 5e-3
        x2 = torch.randn(1, 4, 64).half().to(DEV)    # 4 tokens > max_tokens: the module itself
        assert torch.equal(cats(x2), mlp(x2))


def test_fuse_projections_leaves_cats_mlps_apart():
    from sparsekit.runtime.cats_mlp import CatsMLP
    from sparsekit.runtime.fusion import fuse_projections

    holder = nn.Module()
    holder.mlp = CatsMLP(_cats_mlp())
    holder.other = _MLP(64, 32).half().to(DEV)
    assert fuse_projections(holder) == 1          # the plain MLP's gate/up only
    assert isinstance(holder.mlp.mlp.gate_proj, nn.Linear) and isinstance(holder.mlp.mlp.up_proj, nn.Linear)


def test_eligible_says_why_not(monkeypatch):
    from sparsekit.runtime.cats import apply_threshold
    from sparsekit.runtime.cats_mlp import eligible

    plain = _MLP(64, 32).half()
    assert "no CATS threshold" in eligible(plain)
    gelu = _MLP(64, 32).half()
    gelu.act_fn = nn.GELU()
    apply_threshold(gelu, 0.1)
    assert "SiLU" in eligible(gelu)
    biased = _MLP(64, 32).half()
    biased.up_proj = nn.Linear(64, 32, bias=True).half()
    apply_threshold(biased, 0.1)
    assert "bias" in eligible(biased)
    from sparsekit.packed.tcabme import encode
    from sparsekit.runtime.sparse_linear import SparseLinear

    packed = _cats_mlp().to("cpu")   # on the CPU too: the packed rule comes before where the weights are
    packed.up_proj = SparseLinear(encode(packed.up_proj.weight.data))
    monkeypatch.delenv("SPARSEKIT_CATS_ROWS", raising=False)
    assert eligible(packed).startswith("up_proj packed: the row-packed CATS kernels are slower")
    monkeypatch.setenv("SPARSEKIT_CATS_ROWS", "1")   # row-packed kernels asked for: the next rule speaks
    assert eligible(packed) == "weights not fp16 on a GPU"
