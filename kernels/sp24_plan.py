"""Launch planning for the 2:4 tile-mosaic kernel (sp24_kernel): pure functions of shapes (no numba).

First guesses, not tuned on a GPU yet (docs/kernels-notes.md "v13-sp" gives the reasoning and
scripts/checks/gpu_sp24.py the knobs to sweep): enough blocks for two per SM where the rows allow,
whole tiles (4 strip rows) per block when they do, and every warp streaming several tile columns.
"""
from __future__ import annotations

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
