"""The 2:4 tile-mosaic layout (sparsekit.packed.sp24): kinds, refusals, bytes, the exact inverse, and
every stored word against the mma.sp / mma.sync fragment contract of docs/kernels-notes.md "v13-sp",
decoded here by plain loops (an implementation independent of the transcoder's tensor code)."""
from __future__ import annotations

import pytest
import torch

from sparsekit.errors import SparsekitError
from sparsekit.packed import sp24
from sparsekit.packed.tcabme import encode
from sparsekit.pruning.patterns import hybrid_mask, nm_mask


def weight(m, k, kind, seed=0, sparsity=0.35):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k, generator=g).half()
    s = torch.rand(m, k, generator=g)
    if kind == "2:4":
        return w * nm_mask(s, 2, 4)           # w * mask: -0.0 wherever a negative weight was pruned
    if kind == "hybrid":
        return w * hybrid_mask(s, sparsity, 64)
    return w


def _bits(w):
    return w.contiguous().view(torch.int16)


def _same(a, b):
    """Equal as numbers, and bit-equal wherever nonzero."""
    assert torch.equal(a.float(), b.float())
    nz = b != 0
    assert torch.equal(_bits(a)[nz], _bits(b)[nz])


@pytest.mark.parametrize("m,k,kind", [(64, 64, "2:4"), (128, 192, "2:4"), (100, 200, "2:4"), (130, 72, "2:4"),
                                      (128, 256, "hybrid"), (192, 128, "hybrid"), (64, 128, "dense"),
                                      (70, 90, "dense")])
def test_round_trip_is_exact(m, k, kind):
    w = weight(m, k, kind)
    lay = sp24.transcode(w)
    _same(sp24.to_dense(lay), w)
    assert lay.shape == (m, k)


def test_kinds_follow_the_hybrid_tiles_and_tcabme_gives_the_same_layout():
    w = weight(192, 256, "hybrid", seed=3)
    lay = sp24.transcode(w)
    tile_zero_frac = (w == 0).float().reshape(3, 64, 4, 64).mean((1, 3))
    assert torch.equal(lay.kinds, (tile_zero_frac >= 0.5).to(torch.uint8))
    assert 0 < int(lay.kinds.sum()) < 12
    other = sp24.transcode(encode(w))          # from TCA-BME, -0.0 values and all
    for a, b in ((lay.dense, other.dense), (lay.sp, other.sp), (lay.tiles, other.tiles)):
        assert torch.equal(a, b)


def test_negative_zero_in_a_pruned_slot_keeps_the_group_valid():
    w = torch.zeros(64, 64, dtype=torch.float16)
    w[:, 0::4] = 1.5
    w[:, 1::4] = -2.0
    w[:, 2::4] = -0.0                           # three nonzero bit patterns per group, two values
    lay = sp24.transcode(w)
    assert lay.kinds.tolist() == [[sp24.SP24]]
    back = sp24.to_dense(lay)
    assert torch.equal(back, w) and not bool(torch.signbit(back[:, 2::4]).any())


def test_unstructured_tiles_are_refused_in_one_line():
    w = weight(128, 128, "dense")
    w[torch.rand(128, 128, generator=torch.Generator().manual_seed(1)) < 0.4] = 0
    with pytest.raises(SparsekitError, match=r"neither 2:4 nor dense .*keep this weight on TCA-BME") as e:
        sp24.transcode(w)
    assert "\n" not in str(e.value)
    with pytest.raises(SparsekitError, match="fp16"):
        sp24.transcode(w.float())


def test_padding_does_not_count_as_zeros_of_a_dense_tile():
    lay = sp24.transcode(weight(70, 90, "dense"))    # the last tiles are mostly padding
    assert lay.kinds.tolist() == [[0, 0], [0, 0]]


def test_bytes():
    w = weight(256, 512, "2:4")
    lay = sp24.transcode(w)
    assert lay.nbytes <= 0.57 * lay.dense_nbytes
    h = sp24.transcode(weight(512, 512, "hybrid", sparsity=0.35))
    n_sp = int(h.kinds.sum())
    n_dense = h.kinds.numel() - n_sp
    assert 0 < n_sp and 0 < n_dense
    assert h.nbytes <= (n_dense * 4096 * 2 + n_sp * 4096 * 1.13) * 1.01


def test_gpu_path_is_the_same_tensor_code():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    w = weight(128, 192, "hybrid")
    a, b = sp24.transcode(w), sp24.transcode(w.cuda())
    assert torch.equal(a.sp, b.sp.cpu()) and torch.equal(a.dense, b.dense.cpu())


# ---- every word against the fragment contract, by loops -----------------------------------------------
def _half(word, h):
    return torch.tensor([(int(word) >> (16 * h)) & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.float16)[0]


def _decode_sp_tile(words):
    """A 64x64 tile from its 1152 words, read as the mma.sp m16n8k32 operands of 4 strips x 2 chunks."""
    out = torch.zeros(64, 64, dtype=torch.float16)
    for s in range(4):
        strip = words[s * sp24.SP_STRIP_WORDS:(s + 1) * sp24.SP_STRIP_WORDS]
        for c in range(2):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                mlane = g * 4 + 2 * c + (t & 1)        # chunk c's metadata: lanes t = 2c, 2c + 1
                if t > 1:
                    continue
                meta = int(strip[256 + mlane]) & 0xFFFFFFFF
                for rh in range(2):
                    for jj in range(4):
                        code = (meta >> (16 * rh + 4 * jj)) & 0xF
                        i0, i1 = code & 3, code >> 2
                        assert i0 < i1, "kept positions must be increasing"
                        j = 4 * t + jj                    # group within the chunk
                        # compressed cols 2j, 2j+1: lane (g, j % 4), register rh + 2 * (j >= 4)
                        word = strip[c * 128 + 4 * (g * 4 + (j & 3)) + rh + 2 * (j >> 2)]
                        row, col = 16 * s + g + 8 * rh, 32 * c + 4 * j
                        out[row, col + i0] = _half(word, 0)
                        out[row, col + i1] = _half(word, 1)
    return out


def _decode_dense_tile(words):
    """A 64x64 tile from its 2048 words, read as mma.sync m16n8k16 A fragments (4 strips x 4 chunks)."""
    out = torch.zeros(64, 64, dtype=torch.float16)
    for s in range(4):
        for q in range(4):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for i in range(4):
                    word = words[s * 512 + q * 128 + lane * 4 + i]
                    row, col = 16 * s + g + 8 * (i & 1), 16 * q + 8 * (i >> 1) + 2 * t
                    out[row, col] = _half(word, 0)
                    out[row, col + 1] = _half(word, 1)
    return out


def test_every_word_follows_the_fragment_contract():
    w = weight(128, 128, "hybrid", seed=5, sparsity=0.25)
    w[0, 4:8] = torch.tensor([0.0, 0.0, 0.0, 3.0])        # one nonzero at the group's end: kept (0, 3)
    w[1, 8:12] = torch.tensor([-0.0, 0.0, 0.0, 0.0])      # empty group
    lay = sp24.transcode(w)
    assert lay.kinds[0, 0] == sp24.SP24 and (lay.kinds == sp24.DENSE).any()
    for i, ref in enumerate(lay.tiles.tolist()):
        kind, slot = ref & 1, ref >> 1
        tile = w[64 * (i // 2):64 * (i // 2) + 64, 64 * (i % 2):64 * (i % 2) + 64]
        if kind == sp24.SP24:
            got = _decode_sp_tile(lay.sp[slot * sp24.SP_TILE_WORDS:(slot + 1) * sp24.SP_TILE_WORDS])
        else:
            got = _decode_dense_tile(lay.dense[slot * sp24.DENSE_TILE_WORDS:(slot + 1) * sp24.DENSE_TILE_WORDS])
        _same(got, tile)


def test_tile_census_counts_each_kind_and_says_which_layers_fit():
    """The census encode records: a hybrid mask's 2:4 and dense tiles as laid out, an unstructured tile as
    'other'; the padding of edge tiles is not counted as zeros; the layout takes exactly the layers with no
    'other' tile and some 2:4 tile."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(130, 200, generator=g).half()
    sp = torch.tensor([[True, False, True, True], [False, True, False, True], [True, True, False, False]])
    keep = nm_mask(torch.rand(130, 200, generator=g), 2, 4)
    tile_sp = sp.repeat_interleave(64, 0).repeat_interleave(64, 1)[:130, :200]
    hyb = torch.where(tile_sp & ~keep, torch.zeros((), dtype=torch.float16), w)
    c = sp24.tile_census(hyb)
    # edge tiles (rows 128-129 / columns 192-199) that are "dense" may also be 2:4-valid by chance
    assert c["other"] == 0 and c["2:4"] + c["dense"] == 12 and c["2:4"] >= int(sp.sum())
    assert c == {"2:4": int((sp24.transcode(hyb).tiles & 1).sum()), "dense": 12 - c["2:4"], "other": 0}
    assert sp24.census_fits(c) is True
    hyb[5:40, 70:120] = 0                      # tile (0, 1) was dense: now 27% zeros, not 2:4: neither
    c2 = sp24.tile_census(hyb)
    assert c2["other"] == 1 and sp24.census_fits(c2) is False
    assert sp24.tile_census(w) == {"2:4": 0, "dense": 12, "other": 0} and sp24.census_fits({"2:4": 0, "dense": 12, "other": 0}) is False
    assert sp24.census_fits(None) is None and sp24.tile_census(w.float()) == sp24.tile_census(w)


def test_encode_records_each_layers_census(tmp_path):
    """encode writes the census of every packed layer into the index, so the loader picks the 2:4 layout
    from it (SparseLinear.tile_census) without scanning."""
    from sparsekit.packed.encoding import encode as encode_dir
    from sparsekit.packed.shards import read_packed
    from sparsekit.runtime.loader import load_packed

    from test_packing import make_pruned

    make_pruned(tmp_path / "pruned")
    encode_dir(tmp_path / "pruned", tmp_path / "packed", force=True)
    layers = read_packed(tmp_path / "packed").layers
    packed = {n: i for n, i in layers.items() if i.get("packed")}
    assert packed and all(set(i["tiles"]) == {"2:4", "dense", "other"} for i in packed.values())
    assert all(i["tiles"]["other"] > 0 for i in packed.values())          # magnitude 50%: unstructured
    model = load_packed(tmp_path / "packed", device="cpu")
    sl = {n: m for n, m in model.named_modules() if hasattr(m, "tile_census")}
    assert sl and all(m.tile_census == packed[n]["tiles"] for n, m in sl.items())
