"""spmm_ws's sizes and launch plan (``ws_plan``): the stage layout, the register caps, the ring depth and the K
split, and the largest GroupTile's value room of a weight (``value_room``). The kernel is ``spmm_ws``."""
from __future__ import annotations

from .common import SIM, quarter_regs
from .block import tile_bytes
from .sp24_wg import NTS

TABLE_BYTES = 1536                      # a GroupTile's decode table (``_publish_table``)
BITMAP_BYTES = 512                      # a GroupTile's 64 bitmaps
VALUE_BYTES = 8192 + 16                 # the most value bytes a GroupTile holds (all 4096, fp16), and 16 that the
                                        # decode's unconditional loads may read past them
WINDOW = 32                             # steps whose offsets the producer warp loads at once (one per lane)
SMEM_PER_SM = 228 * 1024                # Hopper's shared memory per SM ...
SMEM_RESERVED = 1024 + 256              # ... less, per block, the driver's reserve and this kernel's static arrays
MIN_SPLIT_COLS = 32                     # a K split leaves every split this many tile columns or more
_VROOM: dict = {}


def slot_bytes(vbytes: int = VALUE_BYTES) -> int:
    """A tile row's part of a stage: its decode table, its bitmaps and room for ``vbytes`` of values (16-byte
    aligned)."""
    return TABLE_BYTES + BITMAP_BYTES + -(-vbytes // 16) * 16


def stage_bytes(nt: int, wg: int, vbytes: int = VALUE_BYTES) -> int:
    return nt * 128 + wg * slot_bytes(vbytes)


def smem_bytes(nt: int, stages: int, wg: int, vbytes: int = VALUE_BYTES) -> int:
    """Dynamic shared bytes: the ring, reused for the block's fp32 tile at the end."""
    return max(stages * stage_bytes(nt, wg, vbytes), tile_bytes(nt, 64 * wg))


def block_warps(wg: int) -> int:
    """Warps of a block: ``wg`` consumer warpgroups, the copy warp and the table warp."""
    return 4 * wg + 2


def max_registers(nt: int, wg: int) -> int:
    """The register cap, the lowest with no spills (ptxas, sm_90a): 64 up to 16 tokens a tile (five blocks of one
    warpgroup per SM), 72 at 32 (four), 96 at 64 (three), 128 at 128, 184 at 256; never more than the block's warps
    can share in a quarter of the SM (``common.quarter_regs``: 168 for two warpgroups)."""
    want = 64 if nt <= 16 else 72 if nt <= 32 else 96 if nt <= 64 else 128 if nt <= 128 else 184
    return min(want, quarter_regs(block_warps(wg)))


def value_room(w) -> int:
    """Bytes of values the weight's largest GroupTile holds, and 16 (``plan.vcap``). Reading it is a device to
    host copy, so it is cached per weight; inside CUDA-graph capture an unseen weight gets a dense tile's."""
    from . import launch, plan

    capturing = launch._capturing()
    key = (w.gtile_offsets.data_ptr(), w.gtile_offsets.numel(), w.values.numel())
    v = _VROOM.get(key)
    if v is None:
        v = 8 * plan.vcap(w, capturing)
        if not capturing and not SIM:
            if len(_VROOM) >= 4096:
                _VROOM.clear()
            _VROOM[key] = v
    return v


def ws_plan(m: int, gk: int, n: int, sms: int = 132, tokens: int | None = None, stages: int | None = None,
            groups: int | None = None, splits: int | None = None, vbytes: int = VALUE_BYTES,
            regs: int | None = None, cluster: int = 1, alt: bool = False):
    """``(RowsPlan, 1, WG)`` of one launch for a weight whose largest GroupTile holds ``vbytes`` of values.

    One warpgroup (one tile row) per block by default: the H100 sweep of session 15 found two slower on
    every shape (fewer, larger blocks leave SMs idle). The blocks per SM the register cap allows
    (``max_registers``) set the rest: the ring is as deep as that many blocks' shared memory allows, 2-4
    stages (session 16, H100: 4 beat 5 and 6 by 4-6% on 22016x4096 and 28672x8192), and a K split (powers of
    two, each split ``MIN_SPLIT_COLS`` columns or more) fills those block slots on weights with few tile rows.
    ``tokens``, ``stages``, ``groups``, ``splits`` force the plan; a forced plan that needs more shared memory
    than Hopper grants is one ``ValueError`` line. ``cluster``
    (2, 4): clusters of that many blocks on neighbouring tile rows, one warpgroup each and no K split (the
    tile rows are padded to whole clusters; the padding blocks only receive X). ``alt``: two warpgroups share
    each block's one tile row, taking its steps in turn (twice the consumer warps per tile row; v23)."""
    from .sp24_plan import WG_SMEM_OPTIN, wg_tokens
    from .work import RowsPlan, split_work

    nt = tokens or wg_tokens(n)
    wg = 2 if alt else groups or 1
    if nt not in NTS or wg not in (1, 2) or (alt and (groups or 2) != 2):
        raise ValueError(f"spmm_ws takes tokens in {NTS} and one or two warpgroups (two with alt), got {nt} and "
                         f"{groups}")
    tg = 1 if alt else wg                                    # tile rows per block
    gm = -(-m // 64)
    rb = -(-gm // tg)
    chunks = -(-n // nt)
    per_warp = -(-(regs or max_registers(nt, wg)) * 32 // 256) * 256
    fit = max(1, 65536 // (per_warp * block_warps(wg)))       # blocks per SM the registers allow
    room = SMEM_PER_SM // fit - SMEM_RESERVED
    st = stages or max(2, min(4, room // stage_bytes(nt, tg, vbytes)))
    ks = 1
    while ks * 2 * rb * chunks <= fit * sms and gk // (ks * 2) >= MIN_SPLIT_COLS:
        ks *= 2
    if cluster > 1:
        if cluster not in (2, 4) or wg != 1 or alt or (splits or 1) > 1:
            raise ValueError(f"spmm_ws clusters take 2 or 4 blocks of one warpgroup and no K split, got cluster "
                             f"{cluster}, {wg} warpgroups, {splits} splits")
        ks = 1
    ks, per, blocks = split_work(rb * chunks, gk, (ks, -(-gk // ks)), splits)
    if cluster > 1:
        blocks = -(-rb // cluster) * cluster * chunks
    dyn = smem_bytes(nt, st, tg, vbytes)
    if dyn > WG_SMEM_OPTIN:
        raise ValueError(f"this spmm_ws plan (tokens {nt}, stages {st}, warpgroups {wg}) needs {dyn} bytes of shared "
                         "memory: fewer stages or tokens")
    return RowsPlan(nt, st, tg, rb, chunks, ks, per, blocks, dyn), 1, wg
