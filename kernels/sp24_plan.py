"""Launch planning for the 2:4 tile-mosaic kernels (sp24_kernel, sp24_rows, sp24_wg, sp24_ws): pure functions of
shapes (no numba), each rule from the GPU sweeps it names (docs/kernels-notes.md; scripts/checks/gpu_sp24.py).
"""
from __future__ import annotations

from .work import RowsPlan, split_work

XS = 144                   # bytes per staged X row: 64 halves + 16 pad (conflict-free ldmatrix)
SMEM_MAX = 44 * 1024       # dynamic shared memory per block (no opt-in past 48 KB needed)
MAX_WARPS = 8

MAX_NT = 32                # tokens per block; more run as further blocks of the same launch


def tokens(n: int) -> int:
    """Token rows per block (the compiled chunk): 8, 16 or 32 (64 compiles, but spills: see
    docs/kernels-notes.md "v13-sp")."""
    nt = 8
    while nt < min(n, MAX_NT):
        nt *= 2
    return nt


def strips(m: int, nt: int, sms: int = 132) -> int:
    """Strip rows per block: 4 (a whole tile row) while that leaves >= 2 blocks per SM, fewer below;
    at most 2 at 16 tokens and 1 from 32 on (the variants ptxas fits in 128 registers without spills)."""
    rows = -(-m // 16)
    cap = 4 if nt <= 8 else (2 if nt == 16 else 1)
    r = cap
    while r > 1 and -(-rows // r) < 2 * sms:
        r //= 2
    return r


def smem_bytes(nw: int, nt: int, r: int) -> int:
    """Dynamic shared bytes: each warp's X slot, reused for the warps' fp32 sums at the end."""
    return nw * max(nt * XS, r * 16 * nt * 4)


def warps(gk: int, nt: int, r: int, want: int | None = None) -> int:
    """Warps per block (split over the tile columns): about 8 steps each, at most MAX_WARPS, and
    within SMEM_MAX."""
    nw = want or max(1, min(MAX_WARPS, -(-gk // 8)))
    nw = max(1, min(nw, gk))
    while nw > 1 and smem_bytes(nw, nt, r) > SMEM_MAX:
        nw -= 1
    return nw


def plan(m: int, gk: int, n: int, sms: int = 132, warps_: int | None = None, strips_: int | None = None):
    """(nt, r, warps, row blocks, token chunks, dynamic shared bytes) of one launch. The blocks of one
    row block's token chunks are adjacent in the grid (they read the same weights, from L2)."""
    nt = tokens(n)
    r = strips_ or strips(m, nt, sms)
    nw = warps(gk, nt, r, warps_)
    rb = -(-(-(-m // 16)) // r)
    return nt, r, nw, rb, -(-n // nt), smem_bytes(nw, nt, r)


# ---- sp24_rows (block = R tile rows, X shared by its 4 warps, K split across blocks)
ROWS_MAX_NT = 64           # tokens per block; more run as further chunks of the same launch
ROWS_MAX_BLOCKS_PER_SM = 4 # splits stop before the launch passes this many blocks per SM (2 from
ROWS_FEW_BLOCKS_N = 16     # this many tokens on) ...
ROWS_MIN_STEPS = 16        # ... or a split would cover fewer tile columns than this
ROWS_MIN_WEIGHTS = 2**24   # kernel "auto" (kernel_for): sp24_rows above this many weights, or from
ROWS_AUTO_N = 64           # this many tokens on; else sp24_kernel
ROWS_MIN_M = 8192          # rows_plan: two tile rows per block from ROWS_MIN_N tokens on, on this many
ROWS_MIN_N = 128           # output rows or more (all-2:4 weights); from ROWS_FEW_BLOCKS_N tokens on
ROWS_DEEP_GK = 256         # where K has this many tile columns or more


SLOTS = (1152, 2048)       # bytes of one staged strip: 2:4 only (values + metadata), or room for a dense one


def stage_bytes(nt: int, r: int = 1, aslot: int = 2048) -> int:
    """One stage of sp24_rows' ring: the X slice (``nt`` rows of XS bytes), then the 4 warps' ``r`` strips."""
    return nt * XS + 4 * r * aslot


def rows_smem_bytes(nt: int, stages: int, r: int = 1, aslot: int = 2048) -> int:
    """sp24_rows' dynamic shared bytes: the ring, reused for the block's fp32 tile at the end."""
    return max(stages * stage_bytes(nt, r, aslot), nt * 64 * r * 4)


def kernel_for(m: int, k: int, n: int = 1, wg_ok: bool = False, hybrid: bool = False, fast: bool = False) -> str:
    """The 2:4 kernel ``sp24_matmul(kernel="auto")`` runs for ``[n, k] @ [m, k]^T``: "rows" (sp24_rows) for
    weights of more than ROWS_MIN_WEIGHTS, from ROWS_AUTO_N tokens on, and on weights of exactly ROWS_MIN_WEIGHTS from
    ROWS_FEW_BLOCKS_N tokens on, else "warps" (sp24_kernel). The last from two H100 runs of "v37" on 4096x4096, rows
    against warps x cuBLAS: 1.20 / 0.95 against 1.13 / 0.82 at 16 / 32 tokens, and 1.25 / 0.94 against 1.17 / 0.81
    (1.29 against 1.32 at one token, a tie at 8).
    From the H200 sweep after v14's B-fragment batching (docs/kernels-notes.md "v14"): rows won at every
    N on 22016x4096, 8192x28672 and 4096x11008 (with the split rule above); on 4096x4096 warps won by
    5-10% at 8-32 tokens, rows from 64 on.

    ``wg_ok`` (a Hopper GPU; ``hybrid``: the weight has dense tiles too), from the H100 runs of
    docs/kernels-notes.md "v17" and "v18 outcome" (x cuBLAS, timed by ``scripts/checks/gpu_sp24.py``,
    each kernel's own plan):
    - "wg" (sp24_wg) on weights both tall (WG_MIN_M rows or more) and K-deep (WG_DEEP_K columns or more)
      up to WS_MIN_N tokens: 28672x8192 1.66 / 1.58 at 1 / 16 against sp24_ws's 1.54 / 1.52.
    - "ws" (sp24_ws, warp-specialized) on weights of WS_MIN_M rows or more, or K-deep ones, from WS_MIN_N
      tokens on, where it beat rows and wg at every measured count but 16 tokens on 4096x11008
      (1.17 against 1.20):
      22016x4096 1.43 / 1.33 / 1.13 / 0.66 / 0.47 at 16 / 32 / 64 / 128 / 256 against rows' 1.37 / 1.17 /
      0.90 / 0.67 / 0.35; 28672x8192 1.45 / 1.40 / 0.86 / 0.52 at 32 / 64 / 128 / 256 against wg's 1.48 /
      1.20 / 0.79 / 0.46; 8192x28672 1.55 / 1.48 / 1.24 / 0.73 at 16 / 32 / 64 / 128 against rows' 1.47 /
      1.36 / 0.97 / 0.58; 12288x4096 (WS_MIN_M rows) 1.21 / 1.23 / 0.85 / 0.67 at 16 / 32 / 64 / 128
      against 1.16 / 1.07 / 0.78 / 0.47. Not on 4096x4096, where it lost up to 32 tokens (0.93 against
      rows' 0.99 at 16). Past 256 tokens too, its prefill tile of ``ws_tokens`` ("v31": 1.6-3x rows' speed at 512-4096
      on 7B and 70B shapes), and past WS_ANY_FROM on every all-2:4 weight ("v37": 1.1-3x rows' at 257-4096).
    - Below WS_MIN_N tokens elsewhere, rows (22016x4096 1.59 at one token against wg's 1.50).
    - Weights with dense tiles: sp24_ws (``kernel="ws"``, one warpgroup a block: ``ws_shape``) from WS_HYBRID_FROM
      tokens on weights of WS_MIN_M rows or more, from WS_HYBRID_DEEP_FROM on K-deep ones (WG_DEEP_K columns) and from
      WS_HYBRID_ANY_FROM on all; sp24_rows below. H100, 35% (70% of tiles 2:4), 17-128 tokens ("v38"): ws with one
      warpgroup beat rows on 22016x4096 (1.30 against 1.17 at 32), 12288x4096 and from 48 tokens on 4096x11008 and
      4096x4096; rows keeps 1-16 tokens (1.40-1.48 on 22016x4096 against 1.33-1.34). (Two warpgroups lost: "v37".)
    - "wg" also on K-deep weights of WG_FEW_MAX_M rows or fewer up to WG_FEW_N tokens, with ``wg_plan``'s ring and
      split (H100, "v27"): 4096x11008 24.8-25.7 us at 1-4 tokens against rows' 26.7-27.1, 4096x14336 30.7-31.2 against
      31.9-32.5; at 8 tokens rows was as fast; on 8192x28672 and 5120x13824 the two within 1% at 1-4.
    ``fast`` (a GPU of fast memory, ``gpu_facts.fast_memory``; H200 sweep, docs/kernels-notes.md "v41", x cuBLAS at
    16 tokens): sp24_ws from FAST_WS_MIN_N tokens on weights that are not tall, so rows (with ``rows_splits``' fast
    cap) keeps 16 (12288x4096 1.24 against 1.13, 4096x11008 1.31 against 1.15); on tall weights with dense tiles
    sp24_ws from FAST_WS_HYBRID_TALL_FROM (22016x4096, 35%: 1.15 against rows' 1.07), on K-deep ones from
    FAST_WS_HYBRID_DEEP_FROM (4096x11008 at 32 tokens, one warpgroup: 0.93 against rows' 0.81); and on every weight
    from FAST_WS_ANY_FROM to FAST_WS_ONE_UNTIL tokens (4096x4096 at 64: 20.1 us against rows' 22.0, 35%: 23.4 against
    27.5; at 32 the two tied)."""
    tall, deep = m >= WG_MIN_M, k >= WG_DEEP_K
    ws_from = FAST_WS_MIN_N if fast and not tall else WS_MIN_N
    hyb_from = FAST_WS_HYBRID_TALL_FROM if fast and tall else WS_HYBRID_FROM
    hyb_deep = FAST_WS_HYBRID_DEEP_FROM if fast else WS_HYBRID_DEEP_FROM
    window = fast and FAST_WS_ANY_FROM <= n <= FAST_WS_ONE_UNTIL
    if wg_ok and not hybrid and tall and deep and n <= WS_MIN_N:
        return "wg"
    if wg_ok and not hybrid and wg_few(m, k, n):
        return "wg"
    if wg_ok and not hybrid and ((m >= WS_MIN_M or deep) and n >= ws_from or n > WS_ANY_FROM or window):
        return "ws"
    if wg_ok and hybrid and (m >= WS_MIN_M and n >= hyb_from or deep and n >= hyb_deep
                             or n >= WS_HYBRID_ANY_FROM or window):
        return "ws"
    if n >= ROWS_AUTO_N:
        return "rows"
    few = m * k > ROWS_MIN_WEIGHTS or m * k == ROWS_MIN_WEIGHTS and n >= ROWS_FEW_BLOCKS_N
    return "rows" if few else "warps"


def rows_tokens(n: int) -> int:
    """Token rows per block: the smallest of 8, 16, 32, 64 that covers ``n`` (64 past that)."""
    nt = 8
    while nt < min(n, ROWS_MAX_NT):
        nt *= 2
    return nt


def rows_splits(blocks: int, gk: int, sms: int = 132, n: int = 1, per_sm: int | None = None,
                fast: bool = False) -> tuple[int, int]:
    """(splits, tile columns per split) for ``blocks`` blocks per split: the largest power of two that
    keeps the launch within ROWS_MAX_BLOCKS_PER_SM blocks per SM (half that from ROWS_FEW_BLOCKS_N
    tokens on, unless ``fast``; ``per_sm`` instead where given) and every split at ROWS_MIN_STEPS columns or more
    (GPU sweeps on an H200, docs/kernels-notes.md "v13-sp rows" and "v14"); no empty split. ``fast`` (fast memory,
    "v41": more bytes in flight pay): at 16 tokens 12288x4096 took 2 splits, 23.5 us against 29.0 with one, and
    4096x11008 8, 22.9 against 24.9 with 4."""
    cap = per_sm or ROWS_MAX_BLOCKS_PER_SM // (2 if n >= ROWS_FEW_BLOCKS_N and not fast else 1)
    ks = 1
    while blocks * ks * 2 <= cap * sms and gk // (ks * 2) >= ROWS_MIN_STEPS:
        ks *= 2
    kper = -(-gk // ks)
    return -(-gk // kper), kper


ROWS_MAX_STAGES = 4        # the kernel takes up to 8


def rows_stages(nt: int, r: int = 1, aslot: int = 2048) -> int:
    """The deepest ring (at most ROWS_MAX_STAGES) within SMEM_MAX."""
    st = ROWS_MAX_STAGES
    while st > 2 and rows_smem_bytes(nt, st, r, aslot) > SMEM_MAX:
        st -= 1
    return st


def rows_plan(m: int, gk: int, n: int, sms: int = 132, tokens_: int | None = None, splits_: int | None = None,
              stages_: int | None = None, strips_: int | None = None, aslot: int = 2048,
              fast: bool = False) -> RowsPlan:
    """The launch plan (:class:`RowsPlan`). ``splits_`` forces the K split's splits (``per`` = the tile
    columns over the splits); without it the split rule of ``rows_splits``."""
    nt = tokens_ or rows_tokens(n)
    gm = -(-m // 64)
    # two tile rows per block (every B fragment serves two strips): only where the sweeps found it faster,
    # on ROWS_MIN_M rows or more of an all-2:4 weight from ROWS_MIN_N tokens on (H200, 22016x4096 N = 128:
    # 106 us against 168), and from ROWS_FEW_BLOCKS_N tokens on where K is deep (H100, 8192x28672: 1.47 /
    # 1.36 / 0.97x cuBLAS at N = 16 / 32 / 64 against 1.43 / 1.22 / 0.91x; on 22016x4096, K = 4096, one
    # tile row stays faster below 128 tokens; mixed mosaics were not timed with it)
    tall = m >= ROWS_MIN_M and aslot == SLOTS[0]
    r = strips_ or (2 if tall and (n >= ROWS_MIN_N or (n >= ROWS_FEW_BLOCKS_N and gk >= ROWS_DEEP_GK)) else 1)
    while rows_smem_bytes(nt, 2, r, aslot) > SMEM_MAX and nt > 8:
        nt //= 2
    rb = -(-gm // r)
    chunks = -(-n // nt)
    rule = None if splits_ else rows_splits(rb * chunks, gk, sms, n, fast=fast)
    ks, per, blocks = split_work(rb * chunks, gk, rule, splits_)
    st = stages_ or rows_stages(nt, r, aslot)
    dyn = rows_smem_bytes(nt, st, r, aslot)
    if dyn > 48 * 1024 - 1024:
        raise ValueError(f"this sp24_rows plan (tokens {nt}, stages {st}, strips {r}) needs {dyn} bytes of shared "
                         "memory, more than a block may take without opting in (47 KB): fewer stages or tokens")
    return RowsPlan(nt, st, r, rb, chunks, ks, per, blocks, dyn)


# ---- sp24_wg (Hopper sparse warpgroup MMA: WG warpgroups x R tile rows per block, all-2:4 weights)
WG_NTS = (8, 16, 32, 64, 128)   # tokens per output tile; more run as further chunks of the same launch
WG_SMEM_MAX = 160 * 1024        # dynamic shared bytes per block the default plan may take (one block per SM)
WS_SMEM_MAX = 164 * 1024        # sp24_ws's: its 4-stage ring of 256-token tiles (167,936 bytes) fits
WG_SMEM_OPTIN = 220 * 1024      # the most a forced plan may take (Hopper's opt-in limit is 227 KB)
WG_STAGES = 4                   # ring depth (6 and 8 measured no faster on the H100, but see WG_FEW_STAGES)
WG_MIN_M = 16384                # kernel_for: tall weights (this many rows or more) ...
WG_DEEP_K = 8192                # ... and K-deep ones (this many columns or more)
WS_MIN_M = 12288                # sp24_ws on weights of this many rows or more (or K-deep ones) ...
WS_MIN_N = 16                   # ... from this many tokens on (sp24_wg below it, on tall and deep weights; past 256
#                                 tokens, prefill, it beats rows 1.6-3x: H100, docs/kernels-notes.md "v31")
WS_HYBRID_FROM = 17             # kernel_for: sp24_ws on weights with dense tiles from this many tokens (WS_MIN_M rows
WS_HYBRID_DEEP_FROM = 33        # or more), from this many on K-deep ones, and from WS_HYBRID_ANY_FROM on all
WS_HYBRID_ANY_FROM = 128        # (sp24_rows below; v37, v38)
WS_ANY_FROM = 256               # kernel_for: sp24_ws on every all-2:4 weight past this many tokens (v37)
WS_WIDE_NT = 256                # sp24_ws's prefill tile: tokens per output tile past 256 tokens on tall weights, ...
WS_WIDE_FROM = 1024             # ... and from this many tokens on the others (128 below: H100, "v31")
WS_STAGES_FEW, WS_STAGES_MANY = 6, 4   # sp24_ws's ring up to 32 tokens a tile, and from 64 (H100 sweeps, v35)
WS_STAGES_DECODE = 8            # ... and on all-2:4 weights that are not tall, up to 64 tokens (``ws_shape``, v36)
WS_MIN_SPLIT_COLS = 40          # sp24_ws's K split leaves every split this many tile columns or more
WS_CLUSTER_FROM = 1024          # sp24_ws's default plan takes clusters of 2 from this many tokens (``ws_cluster``)
WG_FEW_N = 4                    # kernel_for: sp24_wg up to this many tokens on K-deep weights of ...
WG_FEW_MAX_M = 4096             # ... at most this many rows (a 7B or 8B model's down projection), with
WG_FEW_STAGES = 6               # this deep a ring and a K split of about WG_FEW_PER_SM blocks per SM
WG_FEW_PER_SM = 2
# fast memory (``gpu_facts.fast_memory``: an H200), docs/kernels-notes.md "v41"
FAST_WS_MIN_N = 17              # kernel_for: sp24_ws from this many tokens on weights that are not tall (rows at 16)
FAST_WS_HYBRID_TALL_FROM = 16   # kernel_for: sp24_ws from this many tokens on tall weights with dense tiles, ...
FAST_WS_HYBRID_DEEP_FROM = 32   # ... from this many on K-deep ones, ...
FAST_WS_ANY_FROM = 33           # ... and on every weight from this many tokens to FAST_WS_ONE_UNTIL
FAST_WS_ONE_UNTIL = 64          # ws_shape: one warpgroup of one tile row on tall or K-deep weights up to this many
FAST_WS_MIN_SPLIT_COLS = 16     # tokens; ws_splits up to there: two blocks an SM, splits of this many columns or more
FAST_BIG = 1 << 27              # fast_for: weights of this many or more (70B's) plan as on an H100 from ...
FAST_BIG_FROM = 33              # ... this many tokens (all 2:4), and up to FAST_WS_HYBRID_TALL_FROM (tall hybrids)


def fast_for(m: int, k: int, n: int, hybrid: bool, fast: bool) -> bool:
    """``fast`` for this launch: not on weights of FAST_BIG or more from FAST_BIG_FROM tokens (all 2:4) or up to
    FAST_WS_HYBRID_TALL_FROM (tall, dense tiles too). H200, both plan sets in one run (docs/kernels-notes.md "v42"),
    x cuBLAS: 28672x8192 1.36 / 1.42 at 48 / 64 tokens against 1.47 / 1.52, 8192x28672 1.17 / 1.24 against 1.24 /
    1.31; 28672x8192 with 35% dense tiles 0.87 against 1.20 at 16; elsewhere the fast plans won or tied."""
    if not fast or m * k < FAST_BIG:
        return fast
    return not (m >= WG_MIN_M and n <= FAST_WS_HYBRID_TALL_FROM) if hybrid else n < FAST_BIG_FROM


def wg_few(m: int, k: int, n: int) -> bool:
    """The few-token case of sp24_wg (``kernel_for``, ``wg_plan``): up to WG_FEW_N tokens on K-deep weights
    (WG_DEEP_K columns or more) of WG_FEW_MAX_M rows or fewer."""
    return n <= WG_FEW_N and m <= WG_FEW_MAX_M and k >= WG_DEEP_K


def wg_tokens(n: int) -> int:
    """Tokens per output tile: the smallest of WG_NTS that covers ``n`` (the widest past that)."""
    for nt in WG_NTS:
        if nt >= n:
            return nt
    return WG_NTS[-1]


def ws_tokens(n: int, m: int = 0, hybrid: bool = False) -> int:
    """sp24_ws's tokens per output tile: as ``wg_tokens``, but from 65 to 128 tokens two chunks of 64 (H100,
    docs/kernels-notes.md "v25": at 128 tokens 22016x4096 took 95.6 us against 104.7 with one chunk of 128,
    4096x11008 60.2 against 62.2; a 64-token tile needs 87-106 registers, so two blocks share an SM), except on
    tall all-2:4 weights (WG_MIN_M rows or more), which take one chunk of 128 tokens in tiles of two warpgroups
    of two tile rows (``ws_shape``; H100, "v29": 28672x8192 1.18x cuBLAS at 128 tokens against 0.88, 22016x4096
    0.88 against 0.82). Past 256 tokens, all-2:4 weights take WS_WIDE_NT-token tiles (one tile row, two warpgroups:
    128 x 256 outputs a block) on tall weights and from WS_WIDE_FROM tokens on the others, where the H100 sweep of
    "v31" found them fastest (22016x4096 at 2048 tokens 0.62x cuBLAS against 0.52 with 128-token tiles; 4096x11008
    at 512 0.32 against 0.41)."""
    if 64 < n <= 128:
        return 128 if m >= WG_MIN_M and not hybrid else 64
    if n > 256 and not hybrid and (m >= WG_MIN_M or n >= WS_WIDE_FROM):
        return WS_WIDE_NT
    return wg_tokens(n)


def ws_cluster(m: int, n: int, hybrid: bool = False) -> int:
    """Blocks a thread-block cluster of sp24_ws's default plan: 2 (neighbouring row blocks sharing each X slab by
    multicast, no K split) on all-2:4 weights of fewer than WG_MIN_M rows from WS_CLUSTER_FROM tokens on, else 1.
    H100, x cuBLAS at 1024 / 2048 / 4096 tokens with clusters against without (docs/kernels-notes.md "v34"):
    4096x11008 0.85 / 0.84 / 0.80 against 0.54 / 0.80 / 0.78, 4096x4096 0.78 / 0.79 / 0.76 against 0.75 / 0.76 /
    0.74, 12288x4096 0.84 / 0.82 / 0.78 against 0.83 / 0.83 / 0.79, 8192x28672 0.84 / 0.95 / 0.87 against 0.86 /
    0.91 / 0.76. At 512 tokens they lost on three of those four (4096x4096 0.56 against 0.63), on the tall
    22016x4096 they were within 4% either way, and at 16-128 tokens they lost on every shape."""
    return 2 if not hybrid and m < WG_MIN_M and n >= WS_CLUSTER_FROM else 1


def ws_shape(m: int, k: int, nt: int, n: int = 0, hybrid: bool = False, fast: bool = False) -> tuple[int, int, int]:
    """(tile rows per warpgroup, consumer warpgroups, ring depth) of sp24_ws's default plan, from the H100
    sweeps (docs/kernels-notes.md "v18 outcome"): two warpgroups on tall or K-deep weights, one elsewhere
    (12288x4096: 1.21 against 1.14 at 16 tokens); two tile rows each on tall weights up to 32 tokens a
    tile, and at one 128-token tile for 65 to 128 tokens (``ws_tokens``), else one; two warpgroups past 256 tokens too
    (12288x4096 0.49 / 0.59x cuBLAS at 512 / 2048 tokens against 0.43 / 0.56 with one, "v31"); a ring of 6 up to
    32 tokens, 4 from 64 (with the ring 128-byte aligned, "v35": 4 stages beat 3 on all four 7B and 70B shapes from
    128 to 4096 tokens, 22016x4096 496 against 534 us at 2048; the 16-byte aligned 4-stage ring had run 1.6x slower);
    a ring of WS_STAGES_DECODE on all-2:4 weights that are not tall, up to 64 tokens in all, with 32-token tiles or
    one warpgroup ("v36", x cuBLAS at 1 / 16 / 32 / 64 tokens, 8 stages against 6 and 4: 12288x4096 1.31 / 1.44 /
    1.49 / 1.32 against 1.26 / 1.38 / 1.42 / 1.23, 8192x28672 1.65 / 1.68 / 1.65 at 1-32 against 1.60 / 1.62 / 1.62,
    4096x11008 1-3% faster; on 22016x4096 (tall) 2-3% slower, on 8192x28672 at 64 tokens 3% slower, and from 65
    tokens, two 64-token chunks, 1.4x slower on 12288x4096). Weights with dense tiles up to 256 tokens: one
    warpgroup on tall ones, and on K-deep ones past 32 tokens; the ring of WS_STAGES_DECODE at 32-token tiles on those
    that are not tall ("v38", 35% hybrid, x cuBLAS at 24 / 32 / 64 / 128 tokens: 22016x4096 1.25 / 1.30 / 1.33 / 0.91
    against two warpgroups' 0.73 / 0.75 / 1.21 / 0.75; 4096x11008 0.91 / 0.70 at 64 / 128 against 0.83 / 0.68, but
    0.74-0.80 at 1-24 against 0.86-0.97; 12288x4096 with 8 stages 0.96 / 1.00 / 1.11 at 17 / 24 / 32 against 0.92 /
    0.97 / 1.06, 0.63 against 0.99 at 64). ``fast`` (fast memory): one warpgroup of one tile row on tall all-2:4
    weights up to FAST_WS_ONE_UNTIL tokens (H200, "v41", 22016x4096 1.47 / 1.48 / 1.35x cuBLAS at 16 / 32 / 64
    tokens against two of two rows' 1.22 / 1.21 / 1.20), and on K-deep weights that are not tall (4096x11008 at 32
    / 64 tokens with 4 K splits: 25.4 / 32.6 us against two warpgroups' 28.4 / 34.5; 35% at 32: 32.3 against 40.3)."""
    tall = m >= WG_MIN_M
    if fast and tall and not hybrid and 0 < n <= FAST_WS_ONE_UNTIL:
        return 1, 1, WS_STAGES_FEW if nt <= 32 else WS_STAGES_MANY
    if fast and not tall and k >= WG_DEEP_K and 0 < n <= FAST_WS_ONE_UNTIL:
        return 1, 1, WS_STAGES_DECODE if nt <= 32 else WS_STAGES_MANY
    r = 2 if tall and (nt <= 32 or (nt == 128 and 64 < n <= 128 and not hybrid)) else 1
    wg = 2 if (tall or k >= WG_DEEP_K or n > 256) and m > 64 * r else 1
    if hybrid and n <= 256 and (tall or n > 32):
        wg = 1
    if not tall and n <= 64 and (nt <= 32 or wg == 1 and not hybrid):
        return r, wg, WS_STAGES_DECODE
    return r, wg, WS_STAGES_FEW if nt <= 32 else WS_STAGES_MANY


def ws_splits(blocks: int, gk: int, sms: int, nt: int, fast: bool = False) -> tuple[int, int]:
    """(splits, tile columns per split) of sp24_ws on weights with few tile rows: about one block per SM up
    to 32 tokens a tile and two from 64 (two fit an SM there), every split WS_MIN_SPLIT_COLS columns or
    more. H100: 8192x28672 took 2 splits at 16-32 tokens and 4 at 64, 4096x11008 4 splits. ``fast`` (fast memory,
    up to FAST_WS_ONE_UNTIL tokens; H200, "v41"): two blocks per SM at every tile width and splits of
    FAST_WS_MIN_SPLIT_COLS columns or more (4096x11008 at 32 tokens 4 splits, 4096x4096 at 64 tokens 4: 20.1 us
    against 24.7 with one)."""
    target = sms * (1 if nt <= 32 and not fast else 2)
    ks = max(1, min(round(target / blocks), gk // (FAST_WS_MIN_SPLIT_COLS if fast else WS_MIN_SPLIT_COLS)))
    kper = -(-gk // ks)
    return -(-gk // kper), kper


def wg_plan(m: int, gk: int, n: int, sms: int = 132, tokens_: int | None = None, splits_: int | None = None,
            stages_: int | None = None, strips_: int | None = None, groups_: int | None = None,
            kstep_: int | None = None, specialized: bool = False, hybrid: bool = False, smem=None, fast: bool = False):
    """``(RowsPlan, R, WG, KS)`` of one sp24_wg launch: the plan's ``r`` counts the block's tile rows (R x WG);
    KS tile columns per step. On tall weights (WG_MIN_M rows or more) two warpgroups of two tile rows each
    (256 rows share one X slice) and whole tiles (no K split), which the H100 sweep found fastest on
    22016x4096 and 28672x8192 from 16 to 256 tokens (86 and 112 blocks: fewer than the SMs, but a split
    costs more); elsewhere one tile row per warpgroup, two warpgroups from 64 tokens on, and the K split
    of ``rows_splits``. The ring: WG_STAGES deep, shallower where WG_SMEM_MAX (sp24_ws: WS_SMEM_MAX) needs it.
    ``kernel_for``'s few-token case (K-deep weights of WG_FEW_MAX_M rows or fewer, up to WG_FEW_N tokens): a ring of
    WG_FEW_STAGES and a split of about WG_FEW_PER_SM blocks per SM (4096x11008: 4 splits, not 8). ``specialized``:
    sp24_ws's plan (its ring holds whole tiles and one X slab per stage; no ``kstep``): the shape of
    ``ws_shape`` and, on weights that are not tall, the K split of ``ws_splits``; ``hybrid`` (dense tiles
    too): one tile row per warpgroup, tile slots of a dense tile's size; ``smem`` (``(nt, stages, r, wg) ->
    bytes``): another kernel's stage sizes on the same plan (spmm_ws); ``fast``: fast memory's shapes (``ws_shape``)."""
    from . import sp24_wg, sp24_ws

    if specialized:
        if kstep_ not in (None, 1):
            raise ValueError("the warp-specialized kernel takes one tile column per step (kstep=1)")

        def smem_bytes(nt, st, r, wg, ks):
            return smem(nt, st, r, wg) if smem else sp24_ws.smem_bytes(nt, st, r, wg, hybrid)
    else:
        smem_bytes = sp24_wg.smem_bytes

    nt = tokens_ or (ws_tokens(n, m, hybrid) if specialized and smem is None else wg_tokens(n))
    tall = m >= WG_MIN_M
    gm = -(-m // 64)
    chunks = -(-n // nt)
    if specialized:
        r, wg, st = ws_shape(m, gk * 64, nt, n, hybrid, fast)
        r, wg = strips_ or (1 if hybrid else r), groups_ or wg
        if hybrid and r != 1:
            raise ValueError("the warp-specialized kernel takes weights with dense tiles one tile row per "
                             "warpgroup (strips=1)")
        rb = -(-gm // (r * wg))
        rule = (1, gk) if tall else ws_splits(rb * chunks, gk, sms, nt, fast and n <= FAST_WS_ONE_UNTIL)
        st = stages_ or st
    else:
        r = strips_ or (2 if tall else 1)
        wg = groups_ or (2 if (tall or nt >= 64) and m > 64 * r else 1)
        rb = -(-gm // (r * wg))
        few = wg_few(m, gk * 64, n)
        rule = (1, gk) if tall else rows_splits(rb * chunks, gk, sms, n, WG_FEW_PER_SM if few else None)
        st = stages_ or (WG_FEW_STAGES if few else WG_STAGES)
    ks, per, blocks = split_work(rb * chunks, gk, None if splits_ else rule, splits_)
    ksz = kstep_ or 1
    cap = WS_SMEM_MAX if specialized else WG_SMEM_MAX
    while not stages_ and st > 3 and smem_bytes(nt, st, r, wg, ksz) > cap:
        st -= 1
    dyn = smem_bytes(nt, st, r, wg, ksz)
    if dyn > WG_SMEM_OPTIN:
        raise ValueError(f"this sp24_wg plan (tokens {nt}, stages {st}, tile rows {r} x {wg}) needs {dyn} bytes "
                         "of shared memory: fewer stages or tokens")
    return RowsPlan(nt, st, r * wg, rb, chunks, ks, per, blocks, dyn), r, wg, ksz
