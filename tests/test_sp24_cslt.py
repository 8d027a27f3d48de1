"""cuSPARSELt's compressed 2:4 buffer (sparsekit.packed.cslt) and the kernel that writes it from a 2:4 tile-mosaic
layout (sparsekit.kernels.sp24_cslt): the reference against nibble positions read off ``torch._cslt_compress`` on an
H100 (cuSPARSELt 0.8.0), decoded back by plain loops; the kernel against the reference under Numba's CUDA simulator;
and a planted metadata bug that must show. ``runtime.cusparselt`` (ctypes into cuSPARSELt) needs a GPU:
scripts/checks/gpu_sp24.py ``--kernels cslt`` checks it there byte for byte and against float64."""
from __future__ import annotations

import pytest
import torch

from sparsekit.kernels.common import SIM
from sparsekit.packed import sp24
from sparsekit.packed.cslt import compress, cslt_shape
from sparsekit.pruning.patterns import nm_mask
from sparsekit.runtime import cusparselt

DEV = "cpu" if SIM else "cuda"

# (row, group of 4 columns, nibble index in the metadata) read off torch._cslt_compress (one compress per bit of a
# group's index, session 34, H100, torch 2.11, cuSPARSELt 0.8.0), for an [M, K] weight.
OBSERVED = {
    (4096, 64): [(2230, 3, 35308), (1164, 14, 19019), (1278, 15, 20463), (3691, 13, 59191), (2238, 6, 35307),
                 (3527, 6, 56442), (345, 0, 5265), (3716, 9, 59972), (2112, 8, 34304), (2094, 4, 33123)],
    (12288, 128): [(10743, 7, 342526), (5181, 30, 165851), (9292, 27, 298573), (1619, 16, 52400),
                   (6228, 30, 200394), (4726, 16, 151008), (10480, 7, 334222), (4998, 12, 160354),
                   (5116, 15, 162767), (7267, 17, 232756)],
}


def weight(m, k, seed=0, kept_zero=False):
    """A 2:4 fp16 weight whose kept values are nonzero (cuSPARSELt may keep other slots of a group with fewer than
    two nonzeros), with -0.0 in pruned slots (they hold zeros in the buffer either way)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(m, k, generator=g)
    v = torch.where(v.abs() < 0.01, 1.0, v).half()
    w = v * nm_mask(torch.rand(m, k, generator=g), 2, 4)
    if kept_zero:
        w[0, :4] = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float16)
    return w


def nibble_of(r: int, grp: int, k: int) -> int:
    """The metadata nibble of row r, group grp, as packed.cslt's docstring writes it down."""
    rr, gg = r % 64, grp % 8
    p = ((rr >> 3) & 1) | ((gg >> 2) & 1) << 1 | (gg & 1) << 2 | ((gg >> 1) & 1) << 3 | (rr & 7) << 4 | (rr >> 4) << 7
    return ((r // 64) * (k // 32) + grp // 8) * 512 + p


@pytest.mark.parametrize("shape", sorted(OBSERVED))
def test_the_written_down_nibble_order_is_the_one_observed(shape):
    m, k = shape
    assert [(r, grp, nibble_of(r, grp, k)) for r, grp, _ in OBSERVED[shape]] == OBSERVED[shape]


def decode(buf: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """The dense [M, K] weight of a buffer, by plain loops over groups."""
    raw = buf.reshape(-1).view(torch.int16)
    vals, meta = raw[: m * k // 2], raw[m * k // 2:].view(torch.uint8)
    out = torch.zeros(m, k, dtype=torch.int16)
    for r in range(m):
        for grp in range(k // 4):
            q = nibble_of(r, grp, k)
            code = (int(meta[q // 2]) >> (4 * (q % 2))) & 15
            i0, i1 = code & 3, code >> 2
            assert i0 < i1
            out[r, 4 * grp + i0] = vals[r * k // 2 + 2 * grp]
            out[r, 4 * grp + i1] = vals[r * k // 2 + 2 * grp + 1]
    return out.view(torch.float16)


@pytest.mark.parametrize("m,k", [(64, 64), (128, 192), (192, 128)])
def test_reference_buffer_decodes_back_to_the_weight(m, k):
    w = weight(m, k, seed=m + k)
    buf = compress(w)
    assert buf.shape == cslt_shape(m, k) == (m, k // 2 + k // 16) and buf.dtype == torch.float16
    back = decode(buf, m, k)
    assert torch.equal(back, w)      # pruned -0.0 comes back +0.0: equal as values
    assert not (back.view(torch.int16) == -32768).any()


def test_reference_refuses_what_it_does_not_cover():
    with pytest.raises(ValueError, match="multiples of 64"):
        cslt_shape(64, 96)
    w = weight(64, 64)
    w[3, :4] = 1.0
    with pytest.raises(ValueError, match="more than 2 nonzeros"):
        compress(w)


def test_a_group_with_one_nonzero_keeps_it_and_the_lowest_free_slot():
    w = weight(64, 64, kept_zero=True)                 # row 0, group 0: only column 3 nonzero
    raw = compress(w).reshape(-1).view(torch.int16)
    assert raw[0] == 0 and raw[1] == torch.tensor(1.0, dtype=torch.float16).view(torch.int16)
    q = nibble_of(0, 0, 64)
    assert (int(raw[64 * 32:].view(torch.uint8)[q // 2]) >> (4 * (q % 2))) & 15 == 0 | 3 << 2


@pytest.mark.parametrize("m,k", [(64, 64), (128, 192)])
def test_kernel_writes_the_reference_buffer(m, k):
    from sparsekit.kernels.sp24_cslt import sp24_to_cslt

    w = weight(m, k, seed=7 + m)
    lay = sp24.transcode(w).to(DEV)
    ours = sp24_to_cslt(lay).cpu()
    assert torch.equal(ours.view(torch.int16), compress(w).view(torch.int16))


def test_kernel_shows_a_planted_metadata_bug():
    """The layout with each metadata word's row halves swapped must give another buffer."""
    from sparsekit.kernels.sp24_cslt import sp24_to_cslt
    from sparsekit.kernels.sp24_probe import swap_halves

    w = weight(64, 128, seed=3)
    lay = sp24.transcode(w)
    sp = lay.sp.clone().reshape(-1, sp24.SP_STRIP_WORDS)
    sp[:, sp24.SP_VALUE_WORDS:] = swap_halves(sp[:, sp24.SP_VALUE_WORDS:])
    bad = sp24.Sp24Layout(dense=lay.dense, sp=sp.reshape(-1), tiles=lay.tiles, shape=lay.shape)
    got = sp24_to_cslt(bad.to(DEV)).cpu()
    assert not torch.equal(decode(got, 64, 128), w)


def test_kernel_refuses_dense_tiles():
    from sparsekit.kernels.sp24_cslt import sp24_to_cslt

    w = weight(64, 128)
    w[:, :64] = torch.randn(64, 64).half()             # one dense tile
    with pytest.raises(ValueError, match="dense tiles"):
        sp24_to_cslt(sp24.transcode(w).to(DEV))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_cusparselt_says_why_it_cannot_run_without_a_gpu():
    assert cusparselt.available() == "no CUDA device"
    with pytest.raises(ValueError, match="fp16 tensors on one GPU"):
        cusparselt.mm(compress(weight(64, 64)), torch.zeros(3, 64, dtype=torch.float16), 64)
