"""TCA-BME (Tensor-Core-Aware Bitmap Encoding, SpInfer EuroSys'25): one weight <-> packed tensors.

The layout is specified in docs/format.md (format ``tcabme``, version 1). In short, a weight
``[M, K]`` is zero-padded to multiples of 64 and cut into

    GroupTile 64x64 (row-major) > strip 16x64 (4) > TCTile 16x16 along K (4) > BitmapTile 8x8 (4,
    column-major: top-left, bottom-left, top-right, bottom-right)

Each BitmapTile has a 64-bit bitmap (bit ``r*8 + c``) and contributes its nonzero values in
row-major order; each GroupTile's values are zero-padded to a multiple of 8.

Both directions are pure tensor code (reshape/permute, masks, cumsum, scatter): no Python loop
over tiles, and they run on whatever device the input lives on.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from sparsekit.errors import SparsekitError

FORMAT_NAME = "tcabme"
FORMAT_VERSION = 1

GROUP = 64        # GroupTile edge
BT_PER_GT = 64    # BitmapTiles per GroupTile: 4 strips x 4 TCTiles x 4 BitmapTiles
ALIGN = 8         # each GroupTile's values are padded to a multiple of 8 (16 bytes)
DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class TcaBme:
    """One packed weight. See docs/format.md for the meaning of every field."""

    bitmaps: torch.Tensor        # uint64 [NBT], NBT = 64 * NGT
    values: torch.Tensor         # fp16 / bf16 [L], L = gtile_offsets[-1]
    gtile_offsets: torch.Tensor  # int32 [NGT + 1]
    strip_offsets: torch.Tensor  # int32 [NGT * 4]
    shape: tuple[int, int]       # true (M, K) before padding

    @property
    def padded_shape(self) -> tuple[int, int]:
        m, k = self.shape
        return _ceil(m, GROUP) * GROUP, _ceil(k, GROUP) * GROUP

    @property
    def grid(self) -> tuple[int, int]:
        """(GM, GK): GroupTiles along M and along K."""
        mp, kp = self.padded_shape
        return mp // GROUP, kp // GROUP

    @property
    def ngt(self) -> int:
        return int(self.gtile_offsets.numel()) - 1

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nnz(self) -> int:
        """Number of stored nonzeros (popcount of all bitmaps; padding values excluded)."""
        return int(popcount(self.bitmaps).sum())

    @property
    def nbytes(self) -> int:
        """Bytes of all five tensors as stored (shape counts as int64[2])."""
        return (
            self.bitmaps.numel() * 8
            + self.values.numel() * self.values.element_size()
            + self.gtile_offsets.numel() * 4
            + self.strip_offsets.numel() * 4
            + 16
        )

    def to(self, device=None, dtype: torch.dtype | None = None) -> "TcaBme":
        """Move to ``device``; ``dtype`` (fp16/bf16) converts the values only when given.

        Converting fp16 <-> bf16 may turn tiny values into zeros that stay marked in the bitmap;
        the layout stays valid (the value is simply stored as a zero).
        """
        values = self.values.to(device=device, dtype=dtype) if dtype is not None else self.values.to(device)
        return TcaBme(
            bitmaps=self.bitmaps.to(device),
            values=values,
            gtile_offsets=self.gtile_offsets.to(device),
            strip_offsets=self.strip_offsets.to(device),
            shape=self.shape,
        )

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The five on-disk tensors, named ``<prefix>.tcabme.<field>``."""
        return {
            f"{prefix}.tcabme.bitmaps": self.bitmaps,
            f"{prefix}.tcabme.values": self.values,
            f"{prefix}.tcabme.gtile_offsets": self.gtile_offsets,
            f"{prefix}.tcabme.strip_offsets": self.strip_offsets,
            f"{prefix}.tcabme.shape": torch.tensor(self.shape, dtype=torch.int64),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "TcaBme":
        shape = tensors[f"{prefix}.tcabme.shape"]
        return cls(
            bitmaps=tensors[f"{prefix}.tcabme.bitmaps"],
            values=tensors[f"{prefix}.tcabme.values"],
            gtile_offsets=tensors[f"{prefix}.tcabme.gtile_offsets"],
            strip_offsets=tensors[f"{prefix}.tcabme.strip_offsets"],
            shape=(int(shape[0]), int(shape[1])),
        )


FIELDS = ("bitmaps", "values", "gtile_offsets", "strip_offsets", "shape")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# Bit weights of the 8 columns of one BitmapTile row: column c -> bit c of that row's byte.
def _byte_weights(device) -> torch.Tensor:
    return torch.tensor([1 << c for c in range(8)], dtype=torch.uint8, device=device)


_ROW_MAGIC = 0x0102040810204080
_POPCOUNT8 = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int32)

# Each GroupTile row of the work buffer holds its 4096 elements in BitmapTile order followed by
# ALIGN spare slots; marking the first PAD spare slots as "kept" makes one masked gather produce
# the values *with* their per-GroupTile zero padding (and one masked scatter consume them).
_ROW = BT_PER_GT * 64 + ALIGN


def _tile_view(buf: torch.Tensor, gm: int, gk: int) -> torch.Tensor:
    """The [NGT, 4096] part of the work buffer as (gm, gk, s, t, colhalf, rowhalf, r, c)."""
    return buf[:, : BT_PER_GT * 64].view(gm, gk, 4, 4, 2, 2, 8, 8)


def _dense_view(w: torch.Tensor, gm: int, gk: int) -> torch.Tensor:
    """[Mp, Kp] with rows (gm, s, rowhalf, r) and cols (gk, t, colhalf, c), permuted to tile order."""
    return w.reshape(gm, 4, 2, 8, gk, 4, 2, 8).permute(0, 4, 1, 5, 6, 2, 3, 7)


def _popcount_bytes(by: torch.Tensor) -> torch.Tensor:
    """Set bits of each uint8, as int32."""
    if _numpy_path(by) and hasattr(np, "bitwise_count"):
        return torch.from_numpy(np.bitwise_count(by.numpy()).astype(np.int32))
    return _POPCOUNT8.to(by.device)[by.long()]


def popcount(bitmaps: torch.Tensor) -> torch.Tensor:
    """Set bits of each uint64 bitmap, as int32."""
    if _numpy_path(bitmaps) and hasattr(np, "bitwise_count"):
        return torch.from_numpy(np.bitwise_count(bitmaps.contiguous().view(torch.int64).numpy().view(np.uint64)).astype(np.int32))
    by = bitmaps.contiguous().view(torch.uint8).reshape(-1, 8)
    return _POPCOUNT8.to(by.device)[by.long()].sum(dim=1, dtype=torch.int32)


# CPU fast path through numpy (compress / flatnonzero / unpackbits are several times faster than
# torch's boolean indexing on CPU). Tests turn it off to exercise the pure-torch (GPU) path on CPU.
NUMPY_ON_CPU = True


def _numpy_path(t: torch.Tensor) -> bool:
    return NUMPY_ON_CPU and t.device.type == "cpu"


def _unpack_bits(bitmaps: torch.Tensor) -> torch.Tensor:
    """uint64 [NBT] -> bool [NBT * 64], element r*8+c of each tile (little-endian bytes: byte r = row r)."""
    by = bitmaps.contiguous().view(torch.uint8)
    if _numpy_path(by):
        return torch.from_numpy(np.unpackbits(by.numpy(), bitorder="little").view(np.bool_))
    return ((by.unsqueeze(-1) & _byte_weights(by.device)) != 0).reshape(-1)


def _gather(buf: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """buf[mask] for flat tensors."""
    if _numpy_path(buf):
        return torch.from_numpy(np.compress(mask.numpy(), buf.numpy()))
    return buf[mask]


def _scatter(buf: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> None:
    """buf[mask] = values for flat tensors."""
    if _numpy_path(buf):
        buf.numpy()[np.flatnonzero(mask.numpy())] = values.numpy()
    else:
        buf[mask] = values


def _check_weight(weight: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor):
        raise SparsekitError(f"encode expects a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise SparsekitError(
            f"TCA-BME packs 2-D linear weights, got shape {tuple(weight.shape)}: pass an [out, in] matrix"
        )
    if weight.dtype not in DTYPES:
        raise SparsekitError(
            f"TCA-BME stores fp16 or bf16 weights, got {weight.dtype}: cast the weight to float16 or bfloat16 first"
        )
    if weight.numel() == 0:
        raise SparsekitError(f"cannot pack an empty weight of shape {tuple(weight.shape)}")


@contextlib.contextmanager
def _cpu_threads(device: torch.device):
    """Run CPU work on one intra-op thread: these ops are memory-bound, and on a small (2-core) or
    busy machine torch's parallel regions wait on descheduled workers (~80 ms per small weight)."""
    if device.type != "cpu" or torch.get_num_threads() == 1:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def encode(weight: torch.Tensor) -> TcaBme:
    """Pack a dense ``[M, K]`` fp16/bf16 weight (zeros = pruned) into TCA-BME, on its device."""
    _check_weight(weight)
    with _cpu_threads(weight.device):
        return _encode(weight)


def _encode(weight: torch.Tensor) -> TcaBme:
    m, k = (int(s) for s in weight.shape)
    gm, gk = _ceil(m, GROUP), _ceil(k, GROUP)
    mp, kp = gm * GROUP, gk * GROUP
    ngt = gm * gk
    dev = weight.device
    raw = weight.detach().view(torch.int16)  # raw bit patterns: -0.0 is nonzero, bf16 goes through numpy
    if (mp, kp) != (m, k):
        padded = torch.zeros((mp, kp), dtype=torch.int16, device=dev)
        padded[:m, :k] = raw
        raw = padded

    buf = torch.empty((ngt, _ROW), dtype=torch.int16, device=dev)
    buf[:, BT_PER_GT * 64:] = 0
    _tile_view(buf, gm, gk).copy_(_dense_view(raw, gm, gk))
    mask = buf != 0                                      # [NGT, 4096 + 8]

    # Bitmaps: one byte per tile row (bit c = column c); 8 bytes little-endian = one uint64.
    # The 8 bools of a tile row, read as one little-endian int64 (byte c = 0/1), times
    # 0x0102040810204080 moves byte c's bit to bit 56 + c without carries: >> 56 is the row byte.
    rows = mask[:, : BT_PER_GT * 64].view(torch.int64)                    # [NGT, 512]
    row_bytes = ((rows * _ROW_MAGIC) >> 56).bitwise_and_(0xFF).to(torch.uint8)  # [NGT, 512]
    bitmaps = row_bytes.view(torch.uint64).reshape(ngt * BT_PER_GT)

    counts = _popcount_bytes(row_bytes).reshape(ngt, 4, BT_PER_GT * 2).sum(dim=-1)  # [NGT, 4 strips]
    gt_counts = counts.sum(dim=1)
    pad = (-gt_counts) % ALIGN
    mask[:, BT_PER_GT * 64:] = torch.arange(ALIGN, device=dev) < pad[:, None]
    values = _gather(buf.reshape(-1), mask.reshape(-1)).view(weight.dtype)

    gtile_offsets = torch.zeros(ngt + 1, dtype=torch.int64, device=dev)
    gtile_offsets[1:] = torch.cumsum(gt_counts + pad, dim=0)
    strip_start = torch.cumsum(counts, dim=1) - counts   # exclusive, within the GroupTile
    strip_offsets = (gtile_offsets[:-1, None] + strip_start).reshape(ngt * 4).to(torch.int32)
    gtile_offsets = gtile_offsets.to(torch.int32)
    return TcaBme(bitmaps=bitmaps, values=values, gtile_offsets=gtile_offsets,
                  strip_offsets=strip_offsets, shape=(m, k))


def decode(packed: TcaBme) -> torch.Tensor:
    """Rebuild the dense ``[M, K]`` weight bit-exactly, on the packed weight's device."""
    with _cpu_threads(packed.values.device):
        return _decode(packed)


def _decode(packed: TcaBme) -> torch.Tensor:
    m, k = packed.shape
    gm, gk = packed.grid
    ngt = gm * gk
    dev = packed.values.device
    if packed.bitmaps.numel() != ngt * BT_PER_GT or packed.gtile_offsets.numel() != ngt + 1:
        raise SparsekitError(
            f"corrupt TCA-BME weight: shape {packed.shape} needs {ngt * BT_PER_GT} bitmaps and "
            f"{ngt + 1} GroupTile offsets, got {packed.bitmaps.numel()} and {packed.gtile_offsets.numel()}"
        )
    mask = torch.empty((ngt, _ROW), dtype=torch.bool, device=dev)
    mask[:, : BT_PER_GT * 64] = _unpack_bits(packed.bitmaps.to(dev)).view(ngt, BT_PER_GT * 64)
    gt_counts = popcount(packed.bitmaps.to(dev)).reshape(ngt, BT_PER_GT).sum(dim=1)
    offsets = packed.gtile_offsets.to(device=dev, dtype=torch.int64)
    pad = offsets.diff() - gt_counts
    if ngt and (int(pad.min()) < 0 or int(pad.max()) >= ALIGN or int(offsets[0]) != 0
                or int(offsets[-1]) != packed.values.numel()):
        raise SparsekitError(
            "corrupt TCA-BME weight: GroupTile offsets do not match the bitmap popcounts and the "
            f"{packed.values.numel()} stored values: re-encode the checkpoint"
        )
    mask[:, BT_PER_GT * 64:] = torch.arange(ALIGN, device=dev) < pad[:, None]
    buf = torch.zeros((ngt, _ROW), dtype=torch.int16, device=dev)
    _scatter(buf.reshape(-1), mask.reshape(-1), packed.values.contiguous().view(torch.int16))
    dense = _tile_view(buf, gm, gk).permute(0, 2, 5, 6, 1, 3, 4, 7).reshape(gm * GROUP, gk * GROUP)
    return dense[:m, :k].contiguous().view(packed.values.dtype)


def decode_dense(packed: TcaBme) -> torch.Tensor:
    """The dense ``[M, K]`` weight, bit-exact like ``tcabme.decode`` but with fixed-size tensor
    ops only: no host synchronisation and no data-dependent shapes, so it runs on a GPU without the bundled
    kernels (``sparsekit.kernels.decode`` is 10-25x faster) and could be captured. The value of the element at
    bit ``j`` of BitmapTile ``i`` (GroupTile ``g``) is ``values[gtile_offsets[g] + (set bits of g before it)]``.
    """
    m, k = packed.shape
    gm, gk = packed.grid
    ngt = gm * gk
    dev = packed.values.device
    weights = torch.tensor([1 << c for c in range(8)], dtype=torch.uint8, device=dev)
    rows = packed.bitmaps.contiguous().view(torch.uint8).reshape(ngt, 64 * 8, 1)   # byte = tile row
    mask = ((rows & weights) != 0).reshape(ngt, 64 * 64)        # value order inside each GroupTile
    rank = torch.cumsum(mask, dim=1, dtype=torch.int32)         # 1-based rank of each set bit
    idx = (rank + packed.gtile_offsets[:-1, None].to(torch.int32)) * mask  # 0 where the bit is clear
    ext = torch.cat([packed.values.new_zeros(1), packed.values])  # ext[0] = 0, ext[1 + v] = values[v]
    tiles = ext[idx]                                             # [NGT, 4096]
    # (gm, gk, s, t, colhalf, rowhalf, r, c) -> (gm, s, rowhalf, r, gk, t, colhalf, c)
    x = tiles.reshape(gm, gk, 4, 4, 2, 2, 8, 8).permute(0, 2, 5, 6, 1, 3, 4, 7)
    return x.reshape(gm * 64, gk * 64)[:m, :k]
