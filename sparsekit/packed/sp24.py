"""The runtime layout of 2:4 and hybrid weights for the sparse tensor cores (``mma.sp``), made at
load time from TCA-BME or a dense weight. Nothing here is written to disk.

A weight ``[M, K]`` is zero-padded to multiples of 64 and cut into 64x64 tiles, the GroupTiles of
TCA-BME and the tiles of ``--pattern hybrid`` (whose default tile is 64). Each tile is one of:

- **2:4** (``SP24``): every group of 4 consecutive columns (along K, from column 0) of every row holds
  at most 2 nonzeros. Stored as the 2 kept values of each group (``idx0 < idx1``; a group with fewer
  nonzeros keeps zeros in its free slots) and a 4-bit code ``idx0 | idx1 << 2`` per group.
- **dense** (``DENSE``): anything else with at most ``DENSE_MAX_ZEROS`` of its real elements zero:
  plain fp16.

A tile that is neither (an unstructured sparse tile) is refused with a ``SparsekitError``: such a
weight belongs on the TCA-BME kernel. "Zero" means equal to zero, so a ``-0.0`` that a pruner left in a
pruned slot counts as pruned (and comes back as ``+0.0`` from :func:`to_dense`).

Tile words (uint32, each two fp16, the lower column in the low half), in the register order of the
warp that multiplies the tile (``g = lane >> 2``, ``t = lane & 3``; strip ``s`` = rows ``16s ..
16s+15``; the kernel loads one 16-byte row of 4 words per lane):

- dense strip, 512 words: ``[q = 0..3 (16 columns each)][lane][4]``, the ``mma.sync.m16n8k16`` A
  fragment: (row g, cols 2t, 2t+1), (row g+8, same), (row g, cols 8+2t, 8+2t+1), (row g+8, same).
- 2:4 strip, 288 words: ``[c = 0..1 (32 columns each)][lane][4]``, the ``mma.sp.m16n8k32`` A
  fragment of the compressed 16x16 chunk (compressed column ``2j + p`` = the p-th kept value of group
  j), then ``[lane]`` one metadata word per lane: lane ``(g, t)`` holds chunk ``c = t >> 1`` for
  thread ``t & 1`` of selector 0 (groups ``4(t&1) .. 4(t&1)+3`` of the chunk; row g in bits 0-15,
  row g+8 in bits 16-31, group j at bits ``4j``), docs/kernels-notes.md "v13-sp". So lanes t = 0, 1
  carry chunk 0's metadata and lanes t = 2, 3 chunk 1's: one register per lane, and the kernel
  moves chunk 1's to lanes 0, 1 with one shuffle (lane ^ 2).

Tiles are stored by kind, in tile order, in two buffers (``dense``: 2048 words per tile, ``sp``:
1152 words = 4608 bytes per tile); ``tiles[gm * GK + gk] = slot << 1 | kind`` says which buffer and
which slot. Bytes: 2 per weight for dense tiles, 1.125 for 2:4 tiles, 4 per tile for the map.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekit.errors import SparsekitError

TILE = 64
DENSE, SP24 = 0, 1
DENSE_STRIP_WORDS = 512
SP_STRIP_WORDS = 288          # 256 value words + 32 metadata words
SP_VALUE_WORDS = 256
DENSE_TILE_WORDS = 4 * DENSE_STRIP_WORDS
SP_TILE_WORDS = 4 * SP_STRIP_WORDS
DENSE_MAX_ZEROS = 0.125       # a tile that is not 2:4 and has more zeros than this is refused


@dataclass
class Sp24Layout:
    """One weight in the tile mosaic layout (see the module docstring)."""

    dense: torch.Tensor     # int32 [n_dense * DENSE_TILE_WORDS]
    sp: torch.Tensor        # int32 [n_sp * SP_TILE_WORDS]
    tiles: torch.Tensor     # int32 [GM * GK]: slot << 1 | kind
    shape: tuple[int, int]  # true (M, K)
    dtype: torch.dtype = torch.float16

    @property
    def grid(self) -> tuple[int, int]:
        m, k = self.shape
        return -(-m // TILE), -(-k // TILE)

    @property
    def kinds(self) -> torch.Tensor:
        """uint8 [GM, GK]: DENSE (0) or SP24 (1) per tile."""
        return (self.tiles & 1).to(torch.uint8).reshape(self.grid)

    @property
    def device(self) -> torch.device:
        return self.tiles.device

    @property
    def nbytes(self) -> int:
        return 4 * (self.dense.numel() + self.sp.numel() + self.tiles.numel()) + 16

    @property
    def dense_nbytes(self) -> int:
        m, k = self.shape
        return 2 * m * k

    def to(self, device) -> "Sp24Layout":
        return Sp24Layout(self.dense.to(device), self.sp.to(device), self.tiles.to(device), self.shape, self.dtype)


def _tiled(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The 2-D ``t`` zero-padded to whole tiles, as [GM * GK, 64, 64] tiles in row-major order; GM, GK."""
    m, k = t.shape
    gm, gk = -(-m // TILE), -(-k // TILE)
    if (gm * TILE, gk * TILE) != (m, k):
        pad = torch.zeros((gm * TILE, gk * TILE), dtype=t.dtype, device=t.device)
        pad[:m, :k] = t
        t = pad
    return t.reshape(gm, TILE, gk, TILE).permute(0, 2, 1, 3).reshape(gm * gk, TILE, TILE), gm, gk


def _tiles_of(w: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """int16 bit patterns [GM * GK, 64, 64] of the zero-padded weight, tiles in row-major order."""
    return _tiled(w.contiguous().view(torch.int16))


def _classes(nz: torch.Tensor, m: int, k: int, gm: int, gk: int):
    """(2:4-valid, neither 2:4 nor dense, zeros, real elements) per tile from the nonzero mask [NT, 64, 64]."""
    sp_ok = (nz.reshape(-1, TILE, TILE // 4, 4).sum(-1) <= 2).all(-1).all(-1)
    rows = torch.arange(gm, device=nz.device).repeat_interleave(gk)
    cols = torch.arange(gk, device=nz.device).repeat(gm)
    real = (torch.clamp(m - rows * TILE, max=TILE) * torch.clamp(k - cols * TILE, max=TILE))
    zeros = real - nz.sum((1, 2))
    return sp_ok, ~sp_ok & (zeros > DENSE_MAX_ZEROS * real), zeros, real


def tile_census(weight: torch.Tensor) -> dict[str, int]:
    """How many 64x64 tiles of a dense ``[M, K]`` weight (any float dtype; zero = equal to zero) are 2:4,
    dense, or neither (``{"2:4": a, "dense": b, "other": c}``; a tile both 2:4-valid and dense counts as
    2:4). ``encode`` records it per layer, so the loader knows which layers the 2:4 layout can take
    without scanning their weights: those with no "other" tile."""
    m, k = (int(s) for s in weight.shape)
    nz, gm, gk = _tiled(weight != 0)
    sp_ok, bad, _, _ = _classes(nz, m, k, gm, gk)
    n_sp, n_bad = int(sp_ok.sum()), int(bad.sum())
    return {"2:4": n_sp, "dense": gm * gk - n_sp - n_bad, "other": n_bad}


def census_fits(census) -> bool | None:
    """Whether a recorded census (``tile_census``) lets the 2:4 layout take the layer: some 2:4 tile and
    no tile that is neither; None when nothing was recorded (an older checkpoint: scan to know)."""
    if not isinstance(census, dict) or "other" not in census:
        return None
    return int(census["other"]) == 0 and int(census.get("2:4", 0)) > 0


def _kinds(nz: torch.Tensor, m: int, k: int, gm: int, gk: int) -> torch.Tensor:
    """Kind per tile from the nonzero mask [NT, 64, 64]; refuses tiles that are neither."""
    sp_ok, bad, zeros, real = _classes(nz, m, k, gm, gk)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        frac = float(zeros[i]) / float(real[i])
        raise SparsekitError(
            f"tile ({i // gk}, {i % gk}) of a [{m}, {k}] weight is neither 2:4 nor dense ({frac:.0%} zeros, "
            f"{int(bad.sum())} such tiles): the 2:4 layout takes 2:4 or hybrid masks only; keep this weight on TCA-BME")
    return torch.where(sp_ok, SP24, DENSE).to(torch.int32)


def _dense_words(t: torch.Tensor) -> torch.Tensor:
    """[n, 64, 64] int16 -> [n * 2048] int32 in the dense tile order."""
    # rows (s, rh, g), cols (q, kh, t, pair) -> (s, q, g, t, kh, rh, pair): register j = rh + 2 kh
    x = t.reshape(-1, 4, 2, 8, 4, 2, 4, 2).permute(0, 1, 4, 3, 6, 5, 2, 7)
    return x.contiguous().view(torch.int32).reshape(-1)


def _sp_words(t: torch.Tensor, nz: torch.Tensor) -> torch.Tensor:
    """[n, 64, 64] int16 (2:4-valid) -> [n * 1152] int32 in the 2:4 tile order."""
    n = t.shape[0]
    grp = t.reshape(n, TILE, TILE // 4, 4)
    gnz = nz.reshape(n, TILE, TILE // 4, 4)
    pos = torch.arange(4, device=t.device, dtype=torch.int32)
    # kept slots: the nonzero positions first, then the lowest zero positions; in increasing order
    order = torch.argsort((~gnz).to(torch.int32) * 4 + pos, dim=-1)[..., :2]
    idx = torch.sort(order, dim=-1).values                              # [n, 64, 16, 2]
    vals = torch.where(torch.gather(gnz, -1, idx), torch.gather(grp, -1, idx), 0).to(torch.int16)
    comp = vals.reshape(n, TILE, TILE // 2)                             # [n, 64 rows, 32 compressed cols]
    # rows (s, rh, g), compressed cols (c, kh, t, pair) -> (s, c, g, t, kh, rh, pair)
    a = comp.reshape(n, 4, 2, 8, 2, 2, 4, 2).permute(0, 1, 4, 3, 6, 5, 2, 7).contiguous().view(torch.int32)
    a = a.reshape(n, 4, SP_VALUE_WORDS)
    code = (idx[..., 0] | (idx[..., 1] << 2)).to(torch.int64)          # [n, 64, 16]
    # rows (s, rh, g), groups (c, th, jj) -> (s, g, c, th, rh, jj); nibble rh * 4 + jj of the word
    code = code.reshape(n, 4, 2, 8, 2, 2, 4).permute(0, 1, 3, 4, 5, 2, 6).reshape(n, 4, 32, 8)
    shifts = 4 * torch.arange(8, device=t.device, dtype=torch.int64)
    meta = (code << shifts).sum(-1)
    meta = torch.where(meta >= 2**31, meta - 2**32, meta).to(torch.int32)   # as int32 bit patterns
    return torch.cat([a, meta], dim=-1).reshape(-1)


def transcode(weight) -> Sp24Layout:
    """The 2:4 tile-mosaic layout of a dense ``[M, K]`` fp16 weight or a ``TcaBme`` (decoded first),
    on the weight's device. Refuses (``SparsekitError``) a tile that is neither 2:4 nor dense."""
    if hasattr(weight, "gtile_offsets"):          # a TcaBme
        from sparsekit.packed.tcabme import decode

        weight = decode(weight)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != torch.float16:
        what = f"{weight.dtype} tensor of shape {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise SparsekitError(f"the 2:4 layout takes a 2-D fp16 weight or a TcaBme, got a {what}")
    m, k = (int(s) for s in weight.shape)
    tiles, gm, gk = _tiles_of(weight)
    nz = tiles.view(torch.float16) != 0            # -0.0 counts as zero
    kinds = _kinds(nz, m, k, gm, gk)
    is_sp = kinds == SP24
    slot = torch.cumsum(is_sp.to(torch.int32), 0) - is_sp.to(torch.int32)
    slot = torch.where(is_sp, slot, torch.cumsum((~is_sp).to(torch.int32), 0) - (~is_sp).to(torch.int32))
    dense = _dense_words(tiles[~is_sp])
    sp = _sp_words(tiles[is_sp], nz[is_sp])
    return Sp24Layout(dense=dense, sp=sp, tiles=(slot << 1 | kinds).to(torch.int32), shape=(m, k))


def _dense_tiles(words: torch.Tensor) -> torch.Tensor:
    x = words.reshape(-1, 4, 4, 8, 4, 2, 2).contiguous().view(torch.int16).reshape(-1, 4, 4, 8, 4, 2, 2, 2)
    # (s, q, g, t, kh, rh, pair) -> (s, rh, g, q, kh, t, pair)
    return x.permute(0, 1, 6, 3, 2, 5, 4, 7).reshape(-1, TILE, TILE)


def _sp_tiles(words: torch.Tensor) -> torch.Tensor:
    w = words.reshape(-1, 4, SP_STRIP_WORDS)
    n = w.shape[0]
    a = w[..., :SP_VALUE_WORDS].contiguous().view(torch.int16).reshape(n, 4, 2, 8, 4, 2, 2, 2)
    comp = a.permute(0, 1, 6, 3, 2, 5, 4, 7).reshape(n, TILE, TILE // 4, 2)   # (s, rh, g), (c, kh, t, pair)
    meta = w[..., SP_VALUE_WORDS:].to(torch.int64) & 0xFFFFFFFF              # [n, 4, 32]
    nib = (meta[..., None] >> (4 * torch.arange(8, device=w.device))) & 0xF  # [n, 4, 32 = (g, c, th), 8 = (rh, jj)]
    code = nib.reshape(n, 4, 8, 2, 2, 2, 4).permute(0, 1, 5, 2, 3, 4, 6).reshape(n, TILE, TILE // 4)
    pos = torch.arange(4, device=w.device)
    i0, i1 = (code & 3)[..., None], (code >> 2)[..., None]
    out = torch.where(pos == i0, comp[..., 0:1], torch.where(pos == i1, comp[..., 1:2], 0))
    return out.to(torch.int16).reshape(n, TILE, TILE)


def to_dense(layout: Sp24Layout) -> torch.Tensor:
    """The ``[M, K]`` fp16 weight back from the layout (exact; a ``-0.0`` that was pruned is ``+0.0``)."""
    m, k = layout.shape
    gm, gk = layout.grid
    is_sp = (layout.tiles & 1) == SP24
    tiles = torch.zeros((gm * gk, TILE, TILE), dtype=torch.int16, device=layout.device)
    n_sp = int(is_sp.sum())              # (a buffer may run past its last slot: runtime.fusion.equalize_sp24_layouts)
    tiles[~is_sp] = _dense_tiles(layout.dense[: (is_sp.numel() - n_sp) * DENSE_TILE_WORDS])
    tiles[is_sp] = _sp_tiles(layout.sp[: n_sp * SP_TILE_WORDS])
    w = tiles.reshape(gm, gk, TILE, TILE).permute(0, 2, 1, 3).reshape(gm * TILE, gk * TILE)
    return w[:m, :k].contiguous().view(torch.float16)
